#!/usr/bin/env bash
# Build, on a networked machine, the wheelhouse tools/gpu_check.sh installs from on a GPU machine without network:
# wheels of dtnb's dependencies and test tools (the list comes from `tools/gpu_check.sh --requirements`), never torch.
#
#   tools/build_wheelhouse.sh [DEST]    default .whl/ (ignored by git); must stay under 64 MiB
#
# HAVE names a file of what the GPU machine already has (`python3 -m pip list --format=freeze` run there, or one
# name per line): those projects are left out (the offline install there uses its own), which keeps the wheelhouse
# small. Default: tools/gpu_image_packages.txt, the borrowed GPU machines' image (torch, numpy, matplotlib,
# transformers, tensorboard...). HAVE= (empty) fetches every wheel (about 100 MiB: too much to carry).
# PYVER and ARCH (default x86_64) name the GPU machine's Python and CPU, so binary wheels match it. PYVER's default:
# the HAVE file's `# python X.Y` line (3.12 for the image), else this python's version. Then copy DEST there beside
# the repo. So on a networked machine, one command builds the image's wheelhouse: bash tools/build_wheelhouse.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${1:-.whl}
HAVE=${HAVE-tools/gpu_image_packages.txt}
[ -z "$HAVE" ] || [ -n "${PYVER:-}" ] || PYVER=$(sed -n 's/^# python \([0-9.]*\)$/\1/p' "$HAVE" | head -1)
PYVER=${PYVER:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
ARCH=${ARCH:-x86_64}
reqs=$(mktemp); trap 'rm -f "$reqs"' EXIT
PYTHON=$PY tools/gpu_check.sh --requirements >"$reqs"
mkdir -p "$DEST"
plats=()
for p in manylinux_2_28 manylinux_2_17 manylinux2014 linux; do plats+=(--platform "${p}_$ARCH"); done
"$PY" -m pip download --dest "$DEST" --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${plats[@]}" -r "$reqs"
if [ -n "${HAVE:-}" ]; then
  "$PY" - "$DEST" "$HAVE" <<'EOF'
import re, sys, pathlib
dest, have = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
norm = lambda n: re.sub(r'[-_.]+', '-', n).lower()
name = lambda req: norm(re.split(r'[=<>~!; @\[]', req.strip(), maxsplit=1)[0])
names = {name(l) for l in have.read_text().splitlines() if l.strip() and not l.startswith('#')}
try: import tomllib  # Python 3.11+; pip vendors the same parser for 3.10
except ImportError: from pip._vendor import tomli as tomllib
# the build requirements stay: pip builds dtnb in an isolated env that sees no installed package
names -= {name(r) for r in tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']}
gone = [w for w in sorted(dest.glob('*.whl')) if norm(w.name.split('-')[0]) in names]
for w in gone: w.unlink()
print(f"left out {len(gone)} wheels the GPU machine has ({have}): {' '.join(w.name.split('-')[0] for w in gone)}")
EOF
fi
bytes=$(cat "$DEST"/* | wc -c)
echo "wheelhouse $DEST: $(ls "$DEST" | wc -l) wheels, $((bytes / 1048576)) MiB, for CPython $PYVER on $ARCH"
if [ "$bytes" -ge $((64 * 1048576)) ]; then
  echo "64 MiB or more: too big to carry to a GPU machine. The largest:"; ls -S "$DEST" | head -5
  echo "Pass HAVE=<file> with the GPU machine's \`python3 -m pip list --format=freeze\` to leave out what it has"
  exit 1
fi
