#!/usr/bin/env bash
# Run HERE (with network) before a GPU session: the device machine has no network, and its
# python3 (3.12, with CuPy, numba, tokenizers, jinja2, click, tqdm, pytest) lacks gguf
# and lz4.  This unpacks their cp312 x86-64 wheels into .gpu-deps/ (git-ignored, ~6 MB);
# name .gpu-deps in the device run's `carry`, and bench/gpu_check.sh puts it on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
rm -rf .gpu-deps && mkdir -p .gpu-deps/wheels .gpu-deps/site
python3 -m pip download -q --only-binary=:all: --no-deps --implementation cp --python-version "$PY_VERSION" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-deps/wheels gguf lz4
for w in .gpu-deps/wheels/*.whl; do
  python3 -m zipfile -e "$w" .gpu-deps/site
done
rm -rf .gpu-deps/wheels
echo "$PY_VERSION" > .gpu-deps/python-version
du -sh .gpu-deps
