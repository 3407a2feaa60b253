"""The kernel and op tests once more with numba's bounds checks on.

The CPU kernels are compiled with ``boundscheck=False`` for speed, so an index past an array
reads (or writes) whatever memory lies there: wrong results at best, a crash of the RPC server
at worst, and no test failure.  ``NUMBA_BOUNDSCHECK=1`` overrides every kernel's setting, so
the same tests raise ``IndexError`` at the first such index.  The checked build compiles into a
cache folder of its own (kernel_cache.py keys the folder by the setting).

Kernels that index raw pointers in LLVM IR (simd.py, blockdot.py) are not checked this way;
each says in a comment how its bounds are guaranteed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["tests/cpu/test_ops.py", "tests/test_backend_ops.py", "tests/cpu/test_mul_mat.py", "tests/cpu/test_ggml_exact.py",
           "tests/cpu/test_cpu_simd.py", "tests/test_quants.py"]
ONLY = "not RPC and not CUDA and not GGML"  # the op table on the CPU devices (an RPC server would compile
                                           # the checked build too)


@pytest.mark.skipif(os.environ.get("NUMBA_BOUNDSCHECK") == "1", reason="already the checked run")
def test_kernel_and_op_tests_pass_with_numba_bounds_checks():
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", ONLY, *CHECKED],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-40:])
    assert run.returncode == 0, f"with NUMBA_BOUNDSCHECK=1:\n{tail}"
    assert " passed" in tail
