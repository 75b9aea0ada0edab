#!/usr/bin/env bash
# The suite once more on a torch that users install, in a venv of its own (CI: .ci/run):
#   bash tools/test_torch_build.sh PYTHON TORCH_SPEC [VENV]
#   e.g. python3.12 torch          PyPI's default build of the newest torch: the CUDA one, also without a GPU
#        python3.10 "torch==2.10.0"  the oldest torch pyproject.toml declares (torch>=2.10), on the oldest Python
# torch comes from PyPI as `pip install torch` gives it: PIP_FIND_LINKS and the pip configuration (which point some
# machines at a local CPU wheel) are left out for that one install.
# pytest only, and only what differs between torch builds (marker `builds`, listed in tests/conftest.py's BUILDS):
# the state of the process (autograd's device threads after torch.export and a backward, thread pools, CUDA), which
# decides how `launch` starts ranks, and the operators and numerics a build has (each strategy against one process,
# the version gates, detection). They run in one long-lived pytest process that imports those test modules (the
# state that broke `launch` on the CUDA build) and in fresh ones (tests/test_fork_safety.py). The whole suite, and
# the notebooks, run the same library code on the CPU wheel in `bash run.sh test` and `test-long`; running all of it
# again took about 34 minutes a build on a slower machine of this kind. TESTS_M overrides the selection
# (e.g. TESTS_M="not cluster and not cluster_long": the whole suite but the namespace hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?python}; SPEC=${2:?torch spec}; VENV=${3:-.venv-$(echo "$PY-$SPEC" | tr -c 'a-zA-Z0-9.\n' '-')}
# `python3.12` on PATH (GitHub's setup-python), else pyenv's newest 3.12.x (its shims answer only for the global one)
if ! "$PY" -c '' 2>/dev/null; then
  found=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/${PY#python}".*/bin/"$PY" 2>/dev/null |
          sort -V | tail -1)
  [ -n "$found" ] || { echo "test_torch_build: no $PY here (PATH or pyenv)" >&2; exit 1; }
  PY=$found
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q $SPEC  # unquoted: may carry options
# `pip install dtnb` over a torch the user has keeps it: dtnb alone first, then the test extras held to that torch
before=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q -e .
after=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
[ "$before" = "$after" ] || { echo "test_torch_build: installing dtnb replaced torch $before with $after" >&2; exit 1; }
echo "torch==${before%%+*}" > "$VENV/torch-constraint.txt"
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q -e ".[dev]" -c "$VENV/torch-constraint.txt"
"$VENV/bin/python" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__)"
# The namespace-host tests (markers cluster, cluster_long) are left to `run.sh test-long` on the CPU wheel: their
# subject is sockets and processes, and they would add 10 minutes per build.
"$VENV/bin/pytest" tests/ -q -p no:cacheprovider -m "${TESTS_M:-builds and not cluster and not cluster_long}" \
  --durations=10
