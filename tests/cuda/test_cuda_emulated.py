"""The GPU tests (tests/cuda/test_cuda.py) on the CUDA emulator, for machines without a GPU.

CuPy is replaced by tests/cuda/fake/cupy.py (numpy arrays in guarded "device" memory, our
kernels run by the emulator, CuPy's rules on host and device arrays kept); pyggml's CUDA
backend (pyggml/cuda: device, buffers, op table, kernel loading) runs unmodified, in a process
of its own, with one emulated GPU, CUDA0.  What this cannot show: CuPy's own behaviour, NVRTC
(tests/cuda/test_cuda_kernels.py compiles every source with nvcc instead), and speed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda import emulator

ROOT = Path(__file__).resolve().parents[2]
FAKE_CUPY = ROOT / "tests" / "cuda" / "fake"
pytestmark = pytest.mark.skipif(not emulator.available, reason="no C++ compiler (g++ or clang++) for the emulator")


def run_gpu_tests(select: str, path: str = "tests/cuda/test_cuda.py") -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYGGML_NO_CUDA"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_CUPY), str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", path,
                        "-k", select], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000, check=False)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
    assert "passed" in summary and "skipped" not in summary, r.stdout[-4000:]
    return summary


def test_ops_and_weight_types_on_the_emulated_gpu():
    print(run_gpu_tests("not real_model"))


def test_real_models_on_the_emulated_gpu(smollm2_path, gemma3_path):  # (fetched here, once)
    print(run_gpu_tests("real_model"))


def test_the_backend_ops_table_on_the_emulated_gpu():
    print(run_gpu_tests("CUDA", "tests/test_backend_ops.py"))
