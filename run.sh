#!/usr/bin/env bash
# The two commands of the README:
#   bash run.sh main   set up .venv and run the main job (dtnb report --quick, written to dtnb-report/)
#   bash run.sh test   set up .venv and run every test (nbdev-test, then pytest tests/)
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
}

case "${1:-}" in
  setup) setup ;;
  main)  setup; "$VENV/bin/dtnb" report --quick --out dtnb-report ;;
  test)  setup
         "$VENV/bin/nbdev-test" ${DTNB_NBDEV_TEST_ARGS:-}
         "$VENV/bin/pytest" tests/ -q ;;
  *) echo "usage: bash run.sh main|test|setup" >&2; exit 2 ;;
esac
