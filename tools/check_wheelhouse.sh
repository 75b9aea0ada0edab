#!/usr/bin/env bash
# The two steps a GPU machine without network needs, end to end on this machine (CI runs it; it needs PyPI):
# 1. a stand-in for the GPU image: a fresh venv with torch and the big packages such images carry;
# 2. tools/build_wheelhouse.sh against that image's package list (HAVE);
# 3. tools/gpu_check.sh --install-only with no index, no PIP_* settings and no reachable proxy: offline;
# 4. dtnb's stack imports from the image, and the wheelhouse holds no torch and fits the 64 MiB carry limit.
# Not part of `bash run.sh test`: it downloads, and it checks a tool rather than the library.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/image"
img="$tmp/image/bin/python"
torch_version=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo 2.13.0)
"$img" -m pip install -q --no-compile "torch==$torch_version" numpy matplotlib transformers tensorboard
"$img" -m pip list --format=freeze >"$tmp/have.txt"
PYTHON="$img" HAVE="$tmp/have.txt" bash tools/build_wheelhouse.sh "$tmp/whl" | tail -2
if ls "$tmp/whl" | grep -q '^torch-'; then echo "check_wheelhouse: torch is in the wheelhouse"; exit 1; fi
for w in nbdev fastcore execnb setuptools; do
  ls "$tmp/whl" | grep -qi "^$w-" || { echo "check_wheelhouse: no $w wheel in the wheelhouse"; exit 1; }
done
( for v in $(env | grep -o '^PIP_[A-Z_]*'); do unset "$v"; done
  export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 \
         HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9
  PYTHON="$img" WHEELHOUSE="$tmp/whl" GPU_CHECK_VENV=none bash tools/gpu_check.sh --install-only \
    >"$tmp/install.log" 2>&1 || { tail -30 "$tmp/install.log"; echo "check_wheelhouse: offline install failed"
                                  exit 1; } )
where=$("$img" -c 'import dtnb, nbdev, execnb, fastcore, ipywidgets; print(dtnb.__file__)')
case "$where" in "$PWD"/*) ;; *) echo "check_wheelhouse: dtnb imports from $where, not this checkout"; exit 1 ;; esac
echo "check_wheelhouse: built against the image's package list, installed offline, dtnb's stack imports"
