#!/usr/bin/env bash
# The GPU check, made for a short borrowed slot (one GPU, no network, a few minutes, a few files back): the steps run
# in order of value, each inside its own time slice, and everything lands in ONE archive plus a small summary.json
# beside it, both rewritten after every step, so whatever ran is kept even if the slot ends early.
#
#   tools/gpu_check.sh [--budget SECONDS] [--slice STEP=SECONDS]... [--only STEP,...] [--dry-run] [OUT_DIR]
#   tools/gpu_check.sh --install-only   install from the wheelhouse, run nothing
#   tools/gpu_check.sh --requirements   print what the wheelhouse must hold (dtnb's deps, the test tools; no torch)
#   tools/gpu_check.sh --flags-for N    print the nbdev-test flags for N GPUs (multicuda only with 2 or more)
#   tools/gpu_check.sh --steps          print the steps in order, with their share of the budget (with --dry-run:
#                                       the dry run's shares)
#
# OUT_DIR (default $OUT, else gpu-check-<date>/) receives gpu-check.tar.gz (every log and result) and summary.json
# (each step: its slice, seconds, exit code, 'timeout' or 'skipped'). The steps, most valuable first:
#   1. install (offline, from the wheelhouse), env (`dtnb env --json`), nvidia_smi
#      predict     the step times gpu_bench is about to measure, predicted from the datasheet, the device's measured
#                  curves (if it has some yet) and its sampled ops (tools/gpu_predict_check.py); once gpu_bench.json
#                  exists, its measured steps are set beside them (--compare) and summary.json shows both
#      launch      detect() leaves CUDA alone and the next launch forks; after an export and a backward, launches start
#                  from the fork server, timed (tools/gpu_launch_check.py)
#      ranks       two ranks on the one GPU (launch(device='shared'): gloo; NCCL refuses two ranks on one GPU): which
#                  collectives gloo runs on CUDA tensors, wrap ddp/zero2/fsdp and parallelize(tp=2) equal to one
#                  process; with 2+ GPUs the same on NCCL (tools/gpu_ranks_check.py)
#      memory      estimate_memory's totals beside measured peaks (single, fsdp, checkpointing, bf16-mixed; two sizes)
#                  and find_batch_size's estimate beside trying (tools/gpu_memory_check.py)
#      fit         fit ÷ a plain loop on a few-ms GPU step, and host syncs per step of each (tools/gpu_fit_check.py)
#      io          checkpoint save/verified load ÷ dcp.save/dcp.load on GPU tensors; input_bound's verdict on a slow
#                  and a fast pinned loader (tools/gpu_io_check.py)
#   2. gpu_bench   benchmarks/gpu_bench.py --quick, every section, anchors held (DTNB_BENCH_STRICT=1)
#   3. report      dtnb report --quick (every section)
#   4. cuda_cells  only the `#| cuda` notebook cells and what they need (tools/cuda_cells.py; the CPU cells are CI's)
#      cuda_tests  only the `cuda`-marked tests
#      train       fit in bf16-mixed and find_batch_size's trying path (tools/gpu_train_check.py)
#      fp8         fit in fp8 beside bf16-mixed on a small GPT: step time ratio, loss after 260 steps of each; the
#                  refusal where the GPU has no FP8 tensor cores (tools/gpu_fp8_check.py)
# A step's slice is its share of the budget (or --slice), never more than what is left; a step that runs past it is
# stopped (TERM to its process group, KILL 5 s later, then any process that carries its tag) and the next one runs; a
# step with under 10 s left is skipped. A slice is at least 15 s. Exit 1 when a step failed or ran out of time.
#
# --dry-run runs the same sequence, slices, stopping and archive on a machine without a GPU: the CPU forms of the
# steps (predictions from ops sampled on the CPU, gpu_bench --device cpu, the report's first sections, the cells'
# slices without their GPU cells, under the one-GPU stand-in of tests/standin where a notebook is pinned to the CPU,
# fit and find_batch_size's estimate on the CPU) and PYTHON's own environment instead of the offline install
# (tools/check_wheelhouse.sh checks that). CI runs it with the default budget (CI machines differ in speed). Without
# --dry-run, on a machine without a GPU it says so and exits 0, doing nothing else.
#
# Environment: PYTHON (default python3: the one that has torch), WHEELHOUSE (default .whl), GPU_CHECK_VENV (where to
# install when PYTHON is not a venv already; default $TMPDIR/dtnb-gpu-venv, made with --system-site-packages so the
# preinstalled torch is used; `none` installs into PYTHON itself), GPU_CHECK_HANG=STEP (tests: that step's command
# becomes a sleep that outlasts any slice, with a child of its own).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
PY0=$PY  # writes the summary: the python given, whatever the install step made of it
WHEELS=${WHEELHOUSE:-.whl}

# The steps in order of value, with their share of the budget in percent (the shares add up to more than 100: most
# steps end well inside their slice, and none gets more than what is left). Sized on the first GPU run (one H200,
# 480 s): install 17 s, env 9, gpu_bench 46, report 79, cuda_cells 111 (more now: 07's rounds), cuda_tests 16, train 14;
# predict (added after it, not yet run on a GPU) is torch's import, CUDA's start and about 150 op replays.
STEPS="install:12 env:6 nvidia_smi:3 predict:6 launch:6"
STEPS+=" ranks:8 memory:8 fit:4 io:6"  # issue 41 (2-5), not yet run on a GPU: small models, seconds each, sized by hand
STEPS+=" gpu_bench:30 report:25 cuda_cells:40 cuda_tests:10 train:12"
# The dry run's CPU forms cost otherwise: no GPU benchmark to speak of, the cells' slices and the imports dominate.
STEPS_DRY="install:5 env:10 nvidia_smi:3 predict:5 launch:8"
STEPS_DRY+=" ranks:5 memory:6 fit:5 io:8"  # issue 41 (2-5): 7, 11, 9 and 17 s here (2 shared cores, loaded)
STEPS_DRY+=" gpu_bench:20 report:25 cuda_cells:35 cuda_tests:5 train:20"
STEPS+=" fp8:6"; STEPS_DRY+=" fp8:5"  # fp8 (not yet run on a GPU): 2 fits of a 140M GPT, < 30 s

requirements() {  # from pyproject.toml: build requirements, dependencies and the nvml/safetensors/fp8/dev extras
  "$PY" - <<'EOF'
try: import tomllib  # Python 3.11+; pip vendors the same parser for 3.10
except ImportError: from pip._vendor import tomli as tomllib
t = tomllib.load(open('pyproject.toml', 'rb'))
p, x = t['project'], t['project']['optional-dependencies']
import re
# torch: the GPU machine's own build; playwright: only the docs-site test uses it; torchdata: left out as it always
# was (its tests skip without it). By name: torchao (the fp8 extra) is not torch
skip = ('torch', 'playwright', 'torchdata')
for r in t['build-system']['requires'] + p['dependencies'] + x['nvml'] + x['safetensors'] + x['fp8'] + x['dev']:
    if re.split(r'[<>=!~;\[ ]', r, maxsplit=1)[0] not in skip: print(r)
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
    || return 1
  # dtnb itself without its dependencies: the check runs on the machine's own torch (the image's is 2.11, within the
  # floor, 2.10), never another one pip might pull in
  "${PIP[@]}" install --no-index --no-compile --no-deps --find-links "$WHEELS" -e . || return 1
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  export PATH="$BIN:$PATH"
}

flags_for() {  # nbdev-test flags for $1 GPUs: #| multicuda cells need two or more (on one they would oversubscribe it)
  if [ "${1:-0}" -ge 2 ]; then echo "cuda multicuda slow"; else echo "cuda slow"; fi
}

# ---------------------------------------------------------------- arguments
BUDGET=480; DRY=0; ONLY=""; OUT_DIR=""; SHOW_STEPS=0; declare -A SLICE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --requirements) requirements; exit ;;
    --flags-for) flags_for "${2:-0}"; exit ;;
    --install-only) install; exit ;;
    --steps) SHOW_STEPS=1 ;;
    --budget) BUDGET=$2; shift ;;
    --slice) SLICE[${2%%=*}]=${2#*=}; shift ;;
    --only) ONLY=",$2,"; shift ;;
    --dry-run) DRY=1 ;;
    -*) echo "gpu_check: unknown option $1 (see the head of $0)" >&2; exit 2 ;;
    *) OUT_DIR=$1 ;;
  esac
  shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check: --budget takes whole seconds, not '$BUDGET'" >&2; exit 2 ;; esac
[ $DRY = 0 ] || STEPS=$STEPS_DRY
if [ $SHOW_STEPS = 1 ]; then for s in $STEPS; do echo "${s%%:*} ${s##*:}%"; done; exit; fi

n=$(gpu_count)
if [ "${n:-0}" -eq 0 ] && [ $DRY = 0 ]; then
  echo "gpu_check: no GPU on this machine (nvidia-smi and torch see none): nothing to check, nothing run."
  echo "  (tools/gpu_check.sh --dry-run runs the same sequence on this machine's CPU)"
  exit 0
fi

OUT_DIR=${OUT_DIR:-${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$OUT_DIR"; OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX"); trap 'rm -rf "$WORK"' EXIT
RES=$WORK/gpu-check; mkdir -p "$RES"  # what the archive holds: one log per step and every result file
START=$SECONDS; STATUS=0; : >"$WORK/steps.tsv"
echo "gpu_check: $n GPU(s)$( [ $DRY = 1 ] && echo ', dry run on the CPU'); budget ${BUDGET} s; results in $OUT_DIR" |
  tee "$RES/gpu_check.log"

# ---------------------------------------------------------------- the step runner
say() { echo "$*" | tee -a "$RES/gpu_check.log"; }  # the console, kept in the archive too

pack() {  # summary.json and the archive, rewritten whole after each step (write, then rename: never half a file)
  if [ -f "$RES/predict.json" ] && [ -f "$RES/benchmarks/gpu_bench.json" ]; then  # measured beside predicted
    "$PY0" tools/gpu_predict_check.py --compare "$RES/predict.json" "$RES/benchmarks/gpu_bench.json" >/dev/null 2>&1
  fi
  "$PY0" - "$WORK/steps.tsv" "$RES/summary.json" "$BUDGET" "$DRY" "$n" "$((SECONDS - START))" "$RES/predict.json" \
    <<'EOF' || true
import json, os, sys
tsv, out, budget, dry, gpus, secs, pred = sys.argv[1:]
steps = []
for line in open(tsv):
    name, slice_s, seconds, code = line.rstrip('\n').split('\t')
    steps.append(dict(step=name, slice=int(slice_s), seconds=int(seconds),
                      exit=int(code) if code.lstrip('-').isdigit() else code, log=f'gpu-check/{name}.log'))
compare = json.load(open(pred)).get('compare') if os.path.exists(pred) else None  # predicted vs measured, per model
def headline(step):  # a step's tool may write $RES/<step>.json with a `headline` dict: its figures, in the summary
    try: return json.load(open(os.path.join(os.path.dirname(out), step + '.json'))).get('headline')
    except (OSError, ValueError, AttributeError): return None
heads = {s['step']: h for s in steps if (h := headline(s['step'])) is not None}
json.dump(dict(budget=int(budget), seconds=int(secs), dry_run=dry == '1', gpus=int(gpus), steps=steps,
               passed=all(s['exit'] in (0, 'skipped') for s in steps), predicted_vs_measured=compare,
               headlines=heads), open(out, 'w'), indent=1)
EOF
  cp "$RES/summary.json" "$OUT_DIR/.summary.json.part" && mv "$OUT_DIR/.summary.json.part" "$OUT_DIR/summary.json"
  tar czf "$OUT_DIR/.gpu-check.tar.gz.part" -C "$WORK" gpu-check &&
    mv "$OUT_DIR/.gpu-check.tar.gz.part" "$OUT_DIR/gpu-check.tar.gz"
}

sweep() {  # end every process still carrying the step's tag (one that left the process group, e.g. with setsid)
  local tag=$1 p
  for p in /proc/[0-9]*; do
    grep -qsz "^GPU_CHECK_TAG=$tag\$" "$p/environ" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null
  done
}

step() {  # step NAME COMMAND...: run it in its slice, its output in NAME.log; record slice, seconds, exit
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ $ONLY != *",$name,"* ]]; then return; fi
  local share=0 s; for s in $STEPS; do [ "${s%%:*}" = "$name" ] && share=${s##*:}; done
  local left=$((BUDGET - (SECONDS - START) - 10))  # 10 s kept for the last archive
  local slice=${SLICE[$name]:-$((BUDGET * share / 100 > 15 ? BUDGET * share / 100 : 15))}
  [ "$slice" -le "$left" ] || slice=$left
  if [ "$left" -lt 10 ]; then
    say "== $name: skipped (${left} s left of the budget)"
    printf '%s\t%s\t0\tskipped\n' "$name" "$slice" >>"$WORK/steps.tsv"; pack; return
  fi
  # a hang for the tests: children in the step's process group and one that left it (setsid), all to be ended
  [ "${GPU_CHECK_HANG:-}" != "$name" ] || set -- bash -c 'setsid sleep 100000 & sleep 100000 & sleep 100000'
  say "== $name (slice ${slice} s): $*"
  local t0=$SECONDS tag="$$-$name" rc
  GPU_CHECK_TAG=$tag timeout --kill-after=5 "$slice" "$@" >"$RES/$name.log" 2>&1 </dev/null; rc=$?
  sweep "$tag"
  local code=$rc; [ $rc -ne 124 ] && [ $rc -ne 137 ] || code=timeout
  [ $rc -ne 137 ] || [ $((SECONDS - t0)) -ge "$slice" ] || code=137  # killed by something else, inside its slice
  printf '%s\t%s\t%s\t%s\n' "$name" "$slice" "$((SECONDS - t0))" "$code" >>"$WORK/steps.tsv"
  say "   $( [ "$code" = timeout ] && echo "stopped at its slice" || echo "exit $code") after $((SECONDS - t0)) s"
  [ "$code" = 0 ] || { STATUS=1; tail -5 "$RES/$name.log" | sed 's/^/   | /' | tee -a "$RES/gpu_check.log"; }
  pack
}

# ---------------------------------------------------------------- what the steps run (functions, for `bash -c`)
env_json() { dtnb env --json >"$RES/env.json" && echo "wrote env.json"; }  # the text form is in the report
smi() {
  if command -v nvidia-smi >/dev/null; then nvidia-smi && nvidia-smi topo -m
  else echo "no nvidia-smi here (dry run)"; fi
}
cuda_tests() {  # only the test files that carry the marks; none yet is not a failure
  local files marks='cuda and not multicuda'; [ "$GPUS" -lt 2 ] || marks='cuda or multicuda'
  files=$(grep -lE 'mark\.(multi)?cuda\b' tests/test_*.py)
  if [ -z "$files" ]; then echo "no test carries the cuda or multicuda mark"; return 0; fi
  "$PY" -m pytest -q -p no:cacheprovider -m "$marks" --junitxml="$RES/cuda_tests.xml" $files
}
export -f install requirements env_json smi cuda_tests
export RES PY WHEELS GPUS=$n

# ---------------------------------------------------------------- the steps, most valuable first
export DTNB_GPU_CHECK=1  # tests/test_gpu_check.py skips itself under this script
export PYTHONUNBUFFERED=1
if [ $DRY = 1 ]; then  # PYTHON's own environment: the offline install is tools/check_wheelhouse.sh's to prove
  step install "$PY" -c 'import sys, dtnb, nbdev, execnb, fastcore
print("dry run: no offline install; dtnb", dtnb.__version__, "from", dtnb.__file__, "in", sys.prefix)'
  export PATH="$(dirname "$(command -v "$PY")"):$PATH"
else
  step install bash -c install
  # the venv that install made, for the steps after it (the step ran it in a process of its own)
  venv=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/dtnb-gpu-venv}
  if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' && [ "$venv" != none ] \
     && [ -x "$venv/bin/python" ]; then PY=$venv/bin/python; export PATH="$venv/bin:$PATH"
  else export PATH="$(dirname "$(command -v "$PY")"):$PATH"; fi
fi
step env bash -c env_json
step nvidia_smi bash -c smi
step predict "$PY" tools/gpu_predict_check.py --out "$RES/predict.json" $( [ $DRY = 1 ] && echo --device cpu )
step launch "$PY" tools/gpu_launch_check.py --out "$RES/launch.json" $( [ $DRY = 1 ] && echo --device cpu )
step ranks "$PY" tools/gpu_ranks_check.py --out "$RES/ranks.json" $( [ $DRY = 1 ] && echo --device cpu )
step memory "$PY" tools/gpu_memory_check.py --out "$RES/memory.json" $( [ $DRY = 1 ] && echo --device cpu )
step fit "$PY" tools/gpu_fit_check.py --out "$RES/fit.json" $( [ $DRY = 1 ] && echo --device cpu )
step io "$PY" tools/gpu_io_check.py --out "$RES/io.json" --dir "$WORK" $( [ $DRY = 1 ] && echo --device cpu )
if [ $DRY = 1 ]; then
  step gpu_bench "$PY" benchmarks/gpu_bench.py --device cpu --quick --out "$RES/benchmarks"
else
  step gpu_bench env DTNB_BENCH_STRICT=1 "$PY" benchmarks/gpu_bench.py --quick --out "$RES/benchmarks"
fi
if [ $DRY = 1 ]; then  # the CLI and the report's files; its loader and bench sections take a minute more on a CPU
  step report dtnb report --quick --sections env plan training --out "$RES/report"
else
  step report dtnb report --quick --out "$RES/report"
fi
step cuda_cells "$PY" tools/cuda_cells.py $( [ "$n" -ge 2 ] && echo --multi ) $( [ $DRY = 1 ] && echo --dry-run ) \
  --out "$RES/cuda_cells.json"
step cuda_tests bash -c cuda_tests
step train "$PY" tools/gpu_train_check.py --out "$RES/train.json" $( [ $DRY = 1 ] && echo --device cpu )
step fp8 "$PY" tools/gpu_fp8_check.py --out "$RES/fp8.json" $( [ $DRY = 1 ] && echo --device cpu )

files=$(find "$OUT_DIR" -type f | wc -l)
say "gpu_check: $( [ $STATUS -eq 0 ] && echo 'all passed' || echo 'FAILURES (see summary.json)' ) in" \
    "$((SECONDS - START)) s of ${BUDGET}; $files file(s) in $OUT_DIR: $(cd "$OUT_DIR" && ls | paste -sd' ')"
pack
exit $STATUS
