#!/usr/bin/env bash
# One command for a GPU machine (torch preinstalled, no network): install dtnb and its pure-Python dependencies
# from a wheelhouse built beforehand by tools/build_wheelhouse.sh, then run every GPU check and write all of it
# (logs, the report, JSON) to one folder. On a machine without a GPU it says so and exits 0, doing nothing else.
#
#   tools/gpu_check.sh [OUT_DIR]      default: $OUT, else gpu-check-<date>/
#   tools/gpu_check.sh --install-only install from the wheelhouse, run nothing
#   tools/gpu_check.sh --requirements print what the wheelhouse must hold (dtnb's deps, the test tools; no torch)
#   tools/gpu_check.sh --flags-for N  print the nbdev-test flags used with N GPUs (multicuda only with 2 or more)
#
# Environment: PYTHON (default python3: the one that has torch), WHEELHOUSE (default .whl), GPU_CHECK_VENV (where
# to install when PYTHON is not a venv already; default $TMPDIR/dtnb-gpu-venv, made with --system-site-packages so
# the preinstalled torch is used; `none` installs into PYTHON itself).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELHOUSE:-.whl}

requirements() {  # from pyproject.toml: build requirements, dependencies and the nvml/safetensors/dev extras
  "$PY" - <<'EOF'
import tomllib
t = tomllib.load(open('pyproject.toml', 'rb'))
p, x = t['project'], t['project']['optional-dependencies']
skip = ('torch', 'playwright')  # torch: the GPU machine's own build; playwright: only the docs-site test uses it
for r in t['build-system']['requires'] + p['dependencies'] + x['nvml'] + x['safetensors'] + x['dev']:
    if not r.startswith(skip): print(r)
EOF
}

gpu_count() {  # without initialising CUDA: nvidia-smi (NVML), else torch's NVML-based count; 0 without torch
  local n
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; return; fi
  fi
  "$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}

install() {  # into a venv over PYTHON's packages (torch stays the preinstalled one), offline, from $WHEELS
  local venv=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/dtnb-gpu-venv}
  if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || [ "$venv" = none ]; then
    PIP=("$PY" -m pip); BIN=$(dirname "$(command -v "$PY")")
  else
    [ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages "$venv" \
      || "$PY" -m venv --system-site-packages --without-pip "$venv" || return 1
    PIP=("$venv/bin/python" -m pip); BIN=$venv/bin; PY=$venv/bin/python
  fi
  if [ ! -d "$WHEELS" ]; then
    echo "no wheelhouse at $WHEELS: run tools/build_wheelhouse.sh on a networked machine"; return 1
  fi
  requirements >"${TMPDIR:-/tmp}/dtnb-gpu-requirements.txt" || return 1
  # --no-compile: the modules compile on first import anyway
  "${PIP[@]}" install --no-index --no-compile --find-links "$WHEELS" -r "${TMPDIR:-/tmp}/dtnb-gpu-requirements.txt" \
    -e . || return 1
  export PATH="$BIN:$PATH"
}

flags_for() {  # nbdev-test flags for $1 GPUs: #| multicuda cells need two or more (on one they would oversubscribe it)
  if [ "${1:-0}" -ge 2 ]; then echo "cuda multicuda slow"; else echo "cuda slow"; fi
}

case "${1:-}" in
  --requirements) requirements; exit ;;
  --flags-for) flags_for "${2:-0}"; exit ;;
  --install-only) install; exit ;;
esac

n=$(gpu_count)
if [ "${n:-0}" -eq 0 ]; then
  echo "gpu_check: no GPU on this machine (nvidia-smi and torch see none): nothing to check, nothing run."
  exit 0
fi

OUT_DIR=${1:-${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$OUT_DIR"; OUT_DIR=$(cd "$OUT_DIR" && pwd)
echo "gpu_check: $n GPU(s); everything goes to $OUT_DIR"
if ! install >"$OUT_DIR/install.log" 2>&1; then
  echo "install failed: see $OUT_DIR/install.log"; tail -20 "$OUT_DIR/install.log"; exit 1
fi
export DTNB_GPU_CHECK=1  # tests/test_gpu_check.py skips itself under this script

status=0; : >"$OUT_DIR/summary.tsv"
step() {  # step NAME COMMAND...: run, log to NAME.log, record exit code and seconds
  local name=$1; shift; local t0=$SECONDS
  echo "== $name: $*"
  "$@" >"$OUT_DIR/$name.log" 2>&1; local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT_DIR/summary.tsv"
  echo "   exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
}

{ nvidia-smi; nvidia-smi topo -m; } >"$OUT_DIR/nvidia-smi.txt" 2>&1
step env-json sh -c "dtnb env --json >'$OUT_DIR/env.json'"
step env dtnb env
flags=$(flags_for "$n")
[ "$n" -ge 2 ] || echo "gpu_check: one GPU: #| multicuda cells and multicuda tests are skipped"
step nbdev-test bash tools/test_notebooks.sh --flags "$flags" --n-workers 1 --timing  # pinned, then unpinned
marks=$( [ "$n" -ge 2 ] && echo "" || echo "not multicuda" )
step pytest "$PY" -m pytest -ra -p no:cacheprovider tests --ignore=tests/test_site.py -m "$marks" \
  --junitxml="$OUT_DIR/pytest.xml"
step bench dtnb bench --out "$OUT_DIR/bench"
for f in benchmarks/gpu_*.py; do  # GPU benchmarks: each prints its figures beside plain torch loops, writes JSON
  [ -e "$f" ] || continue          # to $DTNB_BENCH_OUT and, under DTNB_BENCH_STRICT=1, fails when an anchor is missed
  step "$(basename "$f" .py)" env DTNB_BENCH_OUT="$OUT_DIR/benchmarks" DTNB_BENCH_STRICT=1 "$PY" "$f"
done
step report dtnb report --quick --out "$OUT_DIR/report"

"$PY" - "$OUT_DIR" <<'EOF'
import json, sys
out = sys.argv[1]
steps = [dict(step=s, exit=int(rc), seconds=int(t)) for s, rc, t in (l.split('\t') for l in open(f'{out}/summary.tsv'))]
json.dump(dict(steps=steps, passed=all(s['exit'] == 0 for s in steps)), open(f'{out}/summary.json', 'w'), indent=1)
EOF
echo "gpu_check: $( [ $status -eq 0 ] && echo all passed || echo 'FAILURES (see summary.tsv)' ); results in $OUT_DIR"
exit $status
