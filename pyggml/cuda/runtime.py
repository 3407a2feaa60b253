"""Loading our CUDA C sources (``kernels/*.cu``) with CuPy's ``RawModule``, and launching their
kernels by the names of their parameters.

Each source is compiled once per process (and cached on disk by CuPy between processes)
with ``kernels/`` on the include path.  A compile error becomes :class:`KernelCompileError`
naming the file and the line NVRTC complained about.

A launch names every argument (``launch(grid, block, x=..., ne0=..., eps=...)``) and is checked
against the kernel's C signature, read from its source: a missing, unknown or repeated name is
an error, and every value is converted to its parameter's C type (``int``, ``i64``, ``float``,
a pointer).  Passed by position, two arguments of the same size could be swapped unnoticed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

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


# C parameter types -> the numpy scalar a launch passes (None: a pointer, given as an array or None)
_SCALARS = {"int": np.int32, "i64": np.int64, "long long": np.int64, "float": np.float32, "unsigned int": np.uint32,
            "u32": np.uint32}
_KERNEL = re.compile(r'extern "C" __global__ void ([\w#]+)\(([^)]*)\)')
_MACRO = re.compile(r"#define (\w+)\(([^)]*)\)")


def _kernels_of(text: str) -> dict[str, list[tuple[str, str]]]:
    """{kernel name: [(parameter, C type)]} of a source.  Kernels a macro defines are found at
    each use of the macro (``DEFINE_SET_ROWS(set_rows_f16, u16)``), or - for a macro applied
    through another one (``FOR_EACH_WEIGHT_TYPE(DEFINE_MMVQ)``) - under a pattern such as
    ``mul_mat_vec_##TYPE`` that :func:`signature` matches names against."""
    text = text.replace("\\\n", " ")
    bodies = []
    for m in _MACRO.finditer(text):
        name, params = m.group(1), [a.strip() for a in m.group(2).split(",")]
        body = text[m.end():text.find("\n", m.end())]
        if "__global__" not in body:
            continue
        uses = list(re.finditer(rf"^{name}\(([^)]*)\)", text, re.M))
        for use in uses:
            expanded = body
            for param, arg in zip(params, [a.strip() for a in use.group(1).split(",")]):
                expanded = re.sub(rf"\b{param}\b", arg, expanded)
            bodies.append(expanded)
        if not uses:
            bodies.append(body)
    bodies.append("\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#define")))
    found = {}
    for body in bodies:
        for m in _KERNEL.finditer(body):
            params = []
            for decl in m.group(2).split(","):
                decl = " ".join(decl.replace("__restrict__", "").split())
                pname = re.findall(r"\w+", decl)[-1]
                ctype = decl[:decl.rfind(pname)].strip()
                params.append((pname, "*" if "*" in ctype else ctype))
            found[m.group(1)] = params
    return found


@cache
def signature(source: str, name: str) -> tuple[tuple[str, object], ...]:
    """The parameters of kernel ``name`` in ``kernels/<source>``: (name, numpy scalar type or
    None for a pointer), in order."""
    kernels = _kernels_of(kernel_source(source))
    params = kernels.get(name)
    if params is None:  # a macro's kernel: dequantize_##TYPE##_f16 is dequantize_q4_0_f16
        patterns = sorted((p for p in kernels if "##" in p), key=lambda p: -len(re.sub(r"##\w+##|##\w+$", "", p)))
        for pattern in patterns:  # the most literal first: mul_mat_vec_##TYPE##_1 before mul_mat_vec_##TYPE
            candidate = kernels[pattern]
            if re.fullmatch(re.sub(r"##\w+##|##\w+$", r"\\w+", pattern), name):
                params = candidate
                break
    if params is None:
        raise KeyError(f"kernels/{source} defines no kernel {name}")
    out = []
    for pname, ctype in params:
        if ctype != "*" and ctype not in _SCALARS:
            raise TypeError(f"kernels/{source}: {name}'s parameter {pname} has a type ({ctype}) launches "
                            "cannot pass")
        out.append((pname, None if ctype == "*" else _SCALARS[ctype]))
    return tuple(out)


@dataclass(frozen=True)
class Launcher:
    """A kernel, launched with every argument named (see the module's docstring)."""
    source: str
    name: str
    kernel: Kernel
    params: tuple[tuple[str, object], ...]

    def __call__(self, grid: tuple, block: tuple, **args) -> None:
        if len(args) != len(self.params) or any(p not in args for p, _ in self.params):
            names = [p for p, _ in self.params]
            missing = [p for p in names if p not in args]
            unknown = [a for a in args if a not in names]
            raise TypeError(f"{self.name} (kernels/{self.source}): missing {missing}, unknown {unknown}")
        self.kernel(grid, block, tuple(args[p] if scalar is None else scalar(args[p]) for p, scalar in self.params))


@cache
def function(source: str, name: str) -> Launcher:
    """A kernel of ``kernels/<source>``, looked up once (it is launched for every op of every
    token); launching it also records the launch when a graph is being recorded (replay.py)."""
    return Launcher(source, name, Kernel(module(source).get_function(name)), signature(source, name))
