#!/usr/bin/env bash
# One command for a GPU machine: the GPU tests, then bench/gpu.py, then a summary.
# Downloads nothing (the machine has no network).  It uses $PYGGML_PYTHON, else python3
# (on the H200 image: Python 3.12 with CuPy, numba, tokenizers ...); what that lacks (gguf,
# lz4) comes from .gpu-deps/, made beforehand by bench/gpu_deps.sh and carried along.
# pyggml itself is installed from this tree (--no-deps, no build isolation: offline).
# Budget: under 8 minutes on an H200, inside the device tool's 10-minute limit per command: the
# tests are cut at 3 minutes, the backend-ops table at 2, the bench at 290 s (the 8B model is skipped with QUICK=1).
# Knobs for a rehearsal on the CUDA emulator (tests/test_bench.py does one): SIZES (models,
# default 1b,8b), TEST_SELECT and OPS_SELECT (pytest -k), BENCH_ARGS (more bench/gpu.py options).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYGGML_PYTHON:-python3}"
# .gpu-deps holds compiled wheels for one Python version (bench/gpu_deps.sh records it)
py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -d .gpu-deps/site ]; then
  if [ "$(cat .gpu-deps/python-version 2>/dev/null || echo 3.12)" = "$py_version" ]; then
    export PYTHONPATH="$PWD/.gpu-deps/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: .gpu-deps is for Python $(cat .gpu-deps/python-version 2>/dev/null || echo 3.12), $PY is $py_version: not used" >&2
  fi
fi
# pyggml.models, .rpc, ... live in top-level folders that only the install maps into pyggml
if ! "$PY" -c "import pathlib, sys, pyggml.models; sys.exit(pathlib.Path(pyggml.models.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "gpu_check: pip install -e . failed; trying the tree as it is" >&2
fi
out="${OUT:-/tmp}/gpu_check"
mkdir -p "$out"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
if ! "$PY" -c "import cupy, numpy, gguf, lz4, click, numba, pyggml.models; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"; then
  echo "gpu_check: $PY cannot import CuPy, pyggml or its dependencies (run bench/gpu_deps.sh here and carry .gpu-deps)" >&2
  exit 2
fi

# tests/cuda/test_cuda.py only: the kernel tests (tests/cuda/test_cuda_kernels.py: nvcc compiles, the CUDA
# emulator) need no GPU and run in CI; here they would spend device minutes building the emulator
echo "== GPU tests (real models only where ~/.cache/pyggml holds them: no downloads here)"
select="not real_model"
ls ~/.cache/pyggml/models/*.gguf >/dev/null 2>&1 && select=""
select="${TEST_SELECT-$select}"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py ${select:+-k "$select"} \
  2>&1 | tee "$out/tests.txt" | tail -25
tests_rc=${PIPESTATUS[0]}
# every op and weight type of the backend-ops table on the GPU, against float64 references
ops_select="${OPS_SELECT-CUDA}"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_backend_ops.py -k "$ops_select" \
  2>&1 | tee "$out/ops.txt" | tail -8
ops_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] && tests_rc=$ops_rc

echo "== bench/gpu.py"
sizes="1b,8b"
[ "${QUICK:-0}" = "1" ] && sizes="1b"
sizes="${SIZES:-$sizes}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout 290 "$PY" bench/gpu.py --sizes "$sizes" --dir "${TMPDIR:-/tmp}" --profile ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}

echo "== summary"
grep -E "passed|failed|error" "$out/tests.txt" | tail -1
grep -E "passed|failed|error" "$out/ops.txt" | tail -1 | sed 's/^/backend ops: /'
grep -E "copy bandwidth" "$out/bench.txt"
awk '$1 ~ /^Q/ && NF == 6 {split($6, p, "%"); s[$1] += p[1]; n[$1]++} END {for (t in s) printf "  %-5s mean %.0f%% of copy bandwidth\n", t, s[t] / n[t]}' "$out/bench.txt" | sort
grep -E "^llama|^  fastest generation|^  decode profile|^    [A-Z_]+ " "$out/bench.txt"
echo "tests exit $tests_rc, bench exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
