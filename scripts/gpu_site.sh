#!/usr/bin/env bash
# Pack what a GPU machine without TileLang or network needs to import flashkern: TileLang and its native
# dependencies (apache-tvm-ffi, z3's library, torch-c-dlpack-ext) and platformdirs, as wheels for CPython 3.12
# on x86-64 Linux, unpacked into one site folder and compressed into OUT/site.tar.xz (about 38 MB, under the
# 64 MiB a lent machine's call carries; the wheels themselves are 83 MB). Versions: those installed here.
# gpu_check.sh installs it with GPU_SITE=OUT/site.tar.xz. Takes about 3 minutes (xz).
#
# Usage: scripts/gpu_site.sh OUT_DIR     (PYTHON=... the interpreter whose installed versions to pack)
set -euo pipefail
out=$(realpath -m "${1:?usage: scripts/gpu_site.sh OUT_DIR}")
py=${PYTHON:-python3}
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" \
    "tilelang==$(version tilelang)" "apache-tvm-ffi==$(version apache-tvm-ffi)" "z3-solver==$(version z3-solver)" \
    "torch-c-dlpack-ext==$(version torch-c-dlpack-ext)" "platformdirs==$(version platformdirs)"
mkdir -p "$work/site" "$out"
for wheel in "$work"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$work/site"; done
rm -rf "$work"/site/z3_solver-*.data "$work/site/z3/include"  # TileLang loads z3's library only
tar cf - -C "$work/site" . | xz -9 -T2 > "$out/site.tar.xz"
ls -l "$out/site.tar.xz"
