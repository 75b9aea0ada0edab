#!/usr/bin/env bash
# Build, on a networked machine, the wheelhouse tools/gpu_check.sh installs from on a GPU machine without network:
# wheels of dtnb's dependencies and test tools (the list comes from `tools/gpu_check.sh --requirements`), never torch.
#
#   tools/build_wheelhouse.sh [DEST]    default .whl/ (ignored by git); must stay under 64 MiB
#
# PYVER (default: this python's version) and ARCH (default x86_64) name the GPU machine's Python and CPU, so
# binary wheels match it, e.g. PYVER=3.12 for a machine whose python3 is 3.12. Then copy DEST there beside the repo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${1:-.whl}
PYVER=${PYVER:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
ARCH=${ARCH:-x86_64}
reqs=$(mktemp); trap 'rm -f "$reqs"' EXIT
PYTHON=$PY tools/gpu_check.sh --requirements >"$reqs"
mkdir -p "$DEST"
plats=()
for p in manylinux_2_28 manylinux_2_17 manylinux2014 linux; do plats+=(--platform "${p}_$ARCH"); done
"$PY" -m pip download --dest "$DEST" --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${plats[@]}" -r "$reqs"
bytes=$(cat "$DEST"/* | wc -c)
echo "wheelhouse $DEST: $(ls "$DEST" | wc -l) wheels, $((bytes / 1048576)) MiB, for CPython $PYVER on $ARCH"
if [ "$bytes" -ge $((64 * 1048576)) ]; then echo "64 MiB or more: too big to carry to a GPU machine"; exit 1; fi
