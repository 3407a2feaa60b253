"""Loading our CUDA C sources (``kernels/*.cu``) with CuPy's ``RawModule``.

Each source is compiled once per process (and cached on disk by CuPy between processes)
with ``kernels/`` on the include path.  A compile error becomes :class:`KernelCompileError`
naming the file and the line NVRTC complained about.
"""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from .replay import Kernel

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
if not (KERNEL_DIR / "common.cuh").exists():  # installed (non-editable): kernels ship as pyggml.kernels
    import pyggml.kernels
    KERNEL_DIR = Path(pyggml.kernels.__file__).parent


class KernelCompileError(RuntimeError):
    pass


def kernel_source(name: str) -> str:
    return (KERNEL_DIR / name).read_text()


@cache
def module(name: str):
    """The compiled ``kernels/<name>`` as a ``cupy.RawModule``."""
    import cupy as cp
    try:
        mod = cp.RawModule(code=kernel_source(name), options=("-std=c++17", f"-I{KERNEL_DIR}"),
                           name_expressions=None)
        mod.compile()
    except cp.cuda.compiler.CompileException as e:
        raise KernelCompileError(compile_error_message(name, str(e))) from None
    return mod


def compile_error_message(name: str, log: str) -> str:
    """'kernels/<file>:<line>' of NVRTC's first complaint, then its whole log.  NVRTC knows the
    source by a temporary name (CuPy's); headers keep theirs, since -I finds them."""
    where = re.search(r"([\w./-]+?\.cuh?)\((\d+)\)", log)
    if where is None:
        return f"CUDA kernel kernels/{name} failed to compile:\n{log}"
    file = Path(where.group(1)).name if where.group(1).endswith(".cuh") else name
    return f"CUDA kernel kernels/{file}:{where.group(2)} failed to compile:\n{log}"


@cache
def function(source: str, name: str) -> Kernel:
    """A kernel of ``kernels/<source>``, looked up once (it is launched for every op of every
    token); launching it also records the launch when a graph is being recorded (replay.py)."""
    return Kernel(module(source).get_function(name))
