#!/usr/bin/env bash
# The commands (the README names main and test):
#   bash run.sh main   set up .venv and run the main job (dtnb report --quick, written to dtnb-report/)
#   bash run.sh test   set up .venv, install mpirun and Chromium where it can (test_deps), run every test
#                      (nbdev-test through tools/test_notebooks.sh, the docs site from its outputs, then pytest tests/)
#                      but the namespace-host ones (markers cluster, cluster_long; DTNB_NO_CLUSTER=1 for the notebooks)
#                      and the `long` ones
#   bash run.sh test-long   those (minutes, as root: hosts made of network namespaces, a real SLURM, elastic
#                      restarts, the cluster tutorial), and the `long` ones (measured gains, stress, whole-tool runs,
#                      Ray Train); installs iproute2, slurm-wlm and munge where it can, and the `ray` extra
# Setup is idempotent: a second run reuses .venv. TORCH_SPEC picks another torch (default: the 2.13.0 wheel,
# the CPU build on machines that carry it; a GPU machine may set TORCH_SPEC=torch to get its CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

setup() {
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "run.sh: installing ${TORCH_SPEC:-torch==2.13.0} first (the CPU wheel where the machine has it)"
    "$VENV/bin/pip" install -q ${TORCH_SPEC:-torch==2.13.0}  # unquoted: may carry pip options
  fi
  "$VENV/bin/pip" install -q -e ".[dev]"
  # Bytecode for dtnb itself: pip compiled the installed packages, but an editable install is imported from the
  # sources, and where PYTHONDONTWRITEBYTECODE is set (these machines) every process would compile dtnb again
  "$VENV/bin/python" -m compileall -q dtnb >/dev/null || true
}

# What `run.sh test` needs outside Python: mpirun (tests/test_mpi.py), Chromium (tests/test_site.py) and iproute2's
# `ip`/`tc` (tools/cluster.sh: namespace hosts for tests/test_cluster.py, which skips without root). Missing ones
# are installed with apt-get when we are root; otherwise one line names the command (test_mpi.py then skips, and
# test_site.py fails unless DTNB_SKIP_BROWSER=1). DTNB_REQUIRE_TEST_DEPS=1 (CI) makes a failed install an error.
test_deps() {
  local missing=()
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
  { command -v ip && command -v tc; } >/dev/null 2>&1 || missing+=(iproute2)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run.sh: installing ${missing[*]} with apt-get (for tests/test_mpi.py, test_site.py, test_cluster.py)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) && return 0
  fi
  echo "run.sh: ${missing[*]} not installed: run \`sudo apt-get install -y ${missing[*]}\` for the MPI, browser" \
       "and cluster tests"
  [ "${DTNB_REQUIRE_TEST_DEPS:-0}" != 1 ] || exit 1
}

strip_outputs() { "$VENV/bin/python" tools/docs.py strip-outputs && "$VENV/bin/nbdev-clean"; }

# What `run.sh test-long` needs besides: SLURM's daemons and clients and munge (tests/test_slurm.py, through
# tools/slurm.sh; about 30 s of apt-get), installed the same way; without root the tests skip with the reason.
slurm_deps() {
  command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 &&
    return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run.sh: installing slurm-wlm munge with apt-get (for tests/test_slurm.py)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) && return 0
  fi
  echo "run.sh: slurm-wlm munge not installed: run \`sudo apt-get install -y slurm-wlm munge\` for the SLURM tests"
  [ "${DTNB_REQUIRE_TEST_DEPS:-0}" != 1 ] || exit 1
}

# And Ray Train for tests/test_ray.py (`long`): the `ray` extra, from PyPI with pip (skips there without it).
ray_deps() {
  "$VENV/bin/python" -c "import ray.train.torch" >/dev/null 2>&1 && return 0
  echo "run.sh: installing the ray extra (for tests/test_ray.py)"
  "$VENV/bin/pip" install -q -e ".[ray]" && return 0
  echo "run.sh: the ray extra did not install: tests/test_ray.py skips"
  [ "${DTNB_REQUIRE_TEST_DEPS:-0}" != 1 ] || exit 1
}

case "${1:-}" in
  setup) setup ;;
  main)  setup; "$VENV/bin/dtnb" report --quick --out dtnb-report ;;
  test)  # mpirun and Chromium install (apt-get: a minute or two on a fresh machine) beside the setup and the notebooks,
         # which need neither; pytest waits for them
         deps_log=$(mktemp); test_deps > "$deps_log" 2>&1 & deps=$!
         setup
         # The notebooks run once. nbdev-test keeps their outputs (--save), the docs site that tests/test_site.py checks
         # is rendered from them, then the outputs go again (notebooks are committed without outputs), also on failure.
         trap 'strip_outputs; wait $deps 2>/dev/null' EXIT  # never leave apt-get half done
         DTNB_NO_CLUSTER=1 NBDEV_TEST="$VENV/bin/nbdev-test" bash tools/test_notebooks.sh --save --timing ${DTNB_NBDEV_TEST_ARGS:-}
         "$VENV/bin/python" tools/docs.py build --no-exec
         strip_outputs; trap - EXIT
         deps_ok=0; wait $deps || deps_ok=$?; cat "$deps_log"; rm -f "$deps_log"; [ $deps_ok = 0 ] || exit $deps_ok
         "$VENV/bin/pytest" tests/ -q -m "not cluster and not cluster_long and not long" --durations=25 ;;  # the slowest 25: the budget
  test-long) setup  # minutes on namespace hosts (pytest markers cluster, cluster_long) and the cluster tutorial
         test_deps
         slurm_deps
         ray_deps
         "$VENV/bin/nbdev-test" --path-re "tutorials/cluster"
         "$VENV/bin/pytest" tests/ -q -m "cluster or cluster_long or long" --durations=30 ;;
  *) echo "usage: bash run.sh main|test|test-long|setup" >&2; exit 2 ;;
esac
