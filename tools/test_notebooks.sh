#!/usr/bin/env bash
# nbdev-test over every notebook, in two runs (arguments go to both, e.g. --flags "cuda slow"):
# 1. the notebooks that pin dtnb to the CPU (a cell `os.environ['DTNB_DEVICE'] = 'cpu'`: their 2-rank cells could not
#    share one GPU), with torch.accelerator answering as a one-GPU node where no GPU is (tests/standin: a stand-in for
#    that device query only), which proves they never reach for a GPU;
# 2. the others, as they are. Two runs, because nbdev-test's workers run notebook after notebook in one process and
#    a pin set by one notebook would stay for the next.
# NBDEV_TEST names the command (default: nbdev-test on PATH). Used by run.sh test.
set -euo pipefail
cd "$(dirname "$0")/.."
NBDEV_TEST=${NBDEV_TEST:-nbdev-test}
pinned=$(grep -l "os.environ\['DTNB_DEVICE'\] = 'cpu'" nbs/*.ipynb nbs/tutorials/*.ipynb | xargs -n1 basename |
         sed 's/[.]ipynb$//' | paste -sd'|')
status=0
PYTHONPATH="$PWD/tests/standin${PYTHONPATH:+:$PYTHONPATH}" DTNB_STANDIN_GPUS=1 \
  "$NBDEV_TEST" --file-re "^($pinned)[.]ipynb$" "$@" || status=1
"$NBDEV_TEST" --skip-file-re "^([_.]|($pinned)[.]ipynb$)" "$@" || status=1
exit $status
