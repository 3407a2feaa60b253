"""Our CUDA kernels (``kernels/*.cu``) run on the CPU, for tests on machines without a GPU.

A kernel source is compiled by the host C++ compiler with ``tests/cuda/emu.h`` in front: every
CUDA thread runs as a fiber, warp shuffles and barriers are resolved by a scheduler (see the
header).  :func:`module` mimics ``cupy.RawModule``: ``module("mmvq.cu").get_function(name)``
is called as CuPy's kernels are, ``fn(grid, block, args)``, with numpy arrays where CuPy
takes device arrays.  Arguments are checked against the kernel's parameters first: a numpy
or Python scalar of another size than the parameter (an ``int64`` for an ``int``: garbage on a
GPU) or an array for a number is a ``TypeError`` here.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE.parents[1] / "kernels"
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
CACHE = Path(os.environ.get("PYGGML_CACHE", Path.home() / ".cache" / "pyggml")) / "cuda-emulator"
# PYGGML_CHECK_ALIGNMENT: kernels/common.cuh traps on a misaligned load, which a GPU refuses
FLAGS = ["-std=c++17", "-O2", "-g0", "-fPIC", "-shared", "-w", "-U_FORTIFY_SOURCE", "-DPYGGML_CHECK_ALIGNMENT"]
MAX_THREADS, MAX_BLOCK, MAX_GRID = 1024, (1024, 1024, 64), (2**31 - 1, 65535, 65535)


class LaunchError(RuntimeError):
    """What CUDA would report for a launch (a bad configuration), or what the emulator found
    the kernel doing wrong (a shuffle with an exited lane, a deadlock, a memory fault)."""


class BuildError(RuntimeError):
    """The host compiler's complaint about a kernel source."""


def build(source: Path, include_dirs: list[Path]) -> Path:
    """The shared library of one kernel source, compiled once per content (cached on disk)."""
    headers = sorted(p for d in include_dirs for p in Path(d).glob("*.cuh"))
    inputs = [HERE / "emu.h", source, *headers]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + " ".join([CXX, *FLAGS]).encode())
    lib = CACHE / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    CACHE.mkdir(parents=True, exist_ok=True)
    front = [*(f"-I{d}" for d in include_dirs), "-include", str(HERE / "emu.h")]
    # the kernels' names: preprocess with __global__ left as a marker (macros make some of them)
    pre = subprocess.run([CXX, "-x", "c++", "-std=c++17", *front, "-E", "-P", "-D__global__=EMU_KERNEL_MARKER", str(source)],
                         capture_output=True, text=True, check=False)
    if pre.returncode:
        raise BuildError(pre.stderr)
    names = re.findall(r"EMU_KERNEL_MARKER\s+void\s+(\w+)\s*\(", pre.stdout)
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "unit.cpp"
        table = ",\n".join(f'    emu::make_kernel("{n}", &{n})' for n in names)
        unit.write_text(f'#include "{source}"\nstatic const emu::Kernel emu_kernels[] = {{\n{table}\n}};\nEMU_EXPORTS\n')
        out = Path(tmp) / lib.name
        r = subprocess.run([CXX, *FLAGS, *front, "-o", str(out), str(unit)], capture_output=True, text=True,
                           check=False)
        if r.returncode:
            raise BuildError(r.stderr)
        os.replace(out, lib)  # atomic: concurrent test processes may build the same library
    return lib


def _argument(value, size: int, kind: str, where: str, device_array: type):
    """The bytes CuPy would pass for ``value`` (an array: its data pointer; None: NULL; a numpy
    scalar: its bytes; a Python int / float: 8 bytes, as CuPy passes them), checked against the
    parameter."""
    if isinstance(value, np.ndarray):
        if not isinstance(value, device_array):
            raise TypeError(f"{where}: Unsupported type {type(value)} (host memory passed to a kernel)")
        if kind != "p":
            raise TypeError(f"{where}: an array passed for a parameter that is a number")
        return ctypes.c_void_p(value.ctypes.data)
    if value is None:  # CuPy passes None as a NULL pointer
        if kind != "p":
            raise TypeError(f"{where}: None passed for a parameter that is a number")
        return ctypes.c_void_p(None)
    scalar = value if isinstance(value, np.generic) else \
        np.int64(value) if isinstance(value, (int, np.integer)) else np.float64(value)
    if kind == "p":
        raise TypeError(f"{where}: a {scalar.dtype} passed for a pointer parameter")
    if (kind == "f") != np.issubdtype(scalar.dtype, np.floating) or scalar.dtype.itemsize != size:
        want = {"f": "floating point", "i": "integer"}[kind]
        raise TypeError(f"{where}: a {scalar.dtype} ({scalar.dtype.itemsize} bytes) passed for a {size}-byte "
                        f"{want} parameter")
    return ctypes.create_string_buffer(scalar.tobytes(), size)


def _dims(d, name: str) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(int(x) for x in d)
    if not 1 <= len(d) <= 3:
        raise LaunchError(f"{name} must have 1 to 3 dimensions, got {d}")
    return (*d, 1, 1)[:3]


class Kernel:
    def __init__(self, lib: ctypes.CDLL, index: int, name: str, device_array: type) -> None:
        self.lib, self.index, self.name, self.device_array = lib, index, name, device_array
        n = lib.emu_kernel_nargs(index)
        self.params = [(lib.emu_kernel_arg_size(index, j), lib.emu_kernel_arg_kind(index, j).decode())
                       for j in range(n)]

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if min(grid) < 1 or min(block) < 1 or any(g > m for g, m in zip(grid, MAX_GRID)) \
                or any(b > m for b, m in zip(block, MAX_BLOCK)) or block[0] * block[1] * block[2] > MAX_THREADS:
            raise LaunchError(f"{self.name}: invalid configuration argument (grid {grid}, block {block})")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, the launch passes {len(args)}")
        values = [_argument(a, size, kind, f"{self.name} argument {j}", self.device_array)
                  for j, (a, (size, kind)) in enumerate(zip(args, self.params))]
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        err = ctypes.create_string_buffer(512)
        dims = ctypes.c_uint * 3
        if self.lib.emu_launch(self.index, dims(*grid), dims(*block), ptrs, err, len(err)):
            raise LaunchError(f"{self.name}: {err.value.decode()}")


class Module:
    """A stand-in for ``cupy.RawModule``: the kernels of one source (a path, or a file name
    under ``kernels/``).  Array arguments must be instances of ``device_array``."""

    def __init__(self, source: str | Path, include_dirs=(KERNEL_DIR,), device_array: type = np.ndarray) -> None:
        path = Path(source) if os.sep in str(source) else KERNEL_DIR / source
        lib = ctypes.CDLL(str(build(path, [Path(d) for d in include_dirs])))
        lib.emu_kernel_name.restype = ctypes.c_char_p
        lib.emu_kernel_arg_kind.restype = ctypes.c_char
        lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                   ctypes.c_int]
        names = [lib.emu_kernel_name(i).decode() for i in range(lib.emu_kernel_count())]
        self.kernels = {name: Kernel(lib, i, name, device_array) for i, name in enumerate(names)}

    def get_function(self, name: str) -> Kernel:
        if name not in self.kernels:
            raise AttributeError(f"no kernel {name!r} in this module (it has {', '.join(sorted(self.kernels))})")
        return self.kernels[name]


@cache
def module(source: str) -> Module:
    return Module(source)


def function(source: str, name: str) -> Kernel:
    """The emulated counterpart of ``pyggml.cuda.runtime.function``."""
    return module(source).get_function(name)


available = CXX is not None
