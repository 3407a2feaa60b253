"""A stand-in for the ``cupy`` package on machines without a GPU: numpy arrays in "device"
memory, and ``RawModule`` kernels run by the CUDA emulator (tests/cuda/emulator.py).

Put ``tests/cuda/fake`` first on ``PYTHONPATH`` and pyggml's CUDA backend runs unmodified
(``pyggml.devices()`` lists one emulated GPU, "CUDA0"); tests/cuda/test_cuda_emulated.py runs the
GPU tests so.  It covers the part of CuPy that pyggml and bench/gpu.py use, and keeps CuPy's
rules where breaking them would pass here and fail on a GPU:

- a kernel takes device arrays only (a numpy array is a TypeError, as in CuPy), and
  arguments of another size than the kernel's parameters are refused (the emulator);
- device arrays do not mix with numpy arrays in arithmetic (TypeError, as in CuPy);
- every allocation ends at a guard page (``cuda.alloc``, ``empty`` ...): a kernel that reads
  or writes past it raises instead of reading garbage;
- fresh memory is not zeros, as on a GPU: it holds 0xff bytes (NaN as floats), so that reading
  what nothing wrote shows;
- allocations count against a fixed memory size (``PYGGML_FAKE_GPU_MEMORY``, bytes; 16 GiB by
  default), and running out raises ``cuda.memory.OutOfMemoryError``.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import sys
import tempfile
import types
import weakref
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.cuda import emulator

__version__ = "0.0+emulated"
PAGE = mmap.PAGESIZE
TOTAL_MEMORY = int(os.environ.get("PYGGML_FAKE_GPU_MEMORY", str(16 << 30)))
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_allocated = 0
_live: weakref.WeakSet = weakref.WeakSet()  # allocations not yet freed: what cuBLAS may be pointed at
run_kernels = True  # False: launches are checked and counted but not run (bench/gpu_launches.py --host-time)
launches = 0  # device operations so far (ufuncs, copies, casts, our kernels): what a GPU would launch
_nested = 0   # inside a counted operation: what numpy does for it is not counted again


def _count() -> None:
    global launches
    if _nested == 0 and _capturing():
        raise _CUDARuntimeError("cudaErrorStreamCaptureUnsupported: a device operation other than a kernel launch "
                                "while a stream captures (only our kernels' launches may be captured)")
    launches += _nested == 0


def _capturing() -> bool:
    return bool(_streams) and _streams[-1].captured is not None

for _name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64", "bool_", "dtype", "newaxis", "pi", "inf", "nan"):
    globals()[_name] = getattr(numpy, _name)


class _Memory:
    """One allocation: ``size`` bytes, 256-byte aligned, ending where a PROT_NONE page starts."""

    def __init__(self, size: int) -> None:
        global _allocated
        if _capturing():  # legal in CUDA's relaxed mode, but the graph would outlive a temporary
            raise _CUDARuntimeError("fake cupy: memory allocated while a stream captures")
        rounded = -(-(size or 1) // 256) * 256  # (max, min, sum, abs are CuPy's here)
        if _allocated + rounded > TOTAL_MEMORY:
            raise cuda.memory.OutOfMemoryError(size, TOTAL_MEMORY - _allocated)
        span = -(-rounded // PAGE) * PAGE
        self.map = mmap.mmap(-1, span + PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        if _libc.mprotect(base + span, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self.start, self.size, self.rounded = span - rounded, size, rounded
        self.ptr = base + self.start
        # cudaMalloc's memory holds what was there before: poisoned here with 0xff bytes (NaN
        # as F32 and F16, -1 as ints), so that a kernel or buffer that relies on zeros fails here too
        ctypes.memset(self.ptr, 0xFF, rounded)
        _allocated += rounded
        _live.add(self)

    def __del__(self) -> None:
        global _allocated
        if _allocated is not None:  # None at interpreter exit
            _allocated -= getattr(self, "rounded", 0)


class MemoryPointer:
    def __init__(self, mem: _Memory, offset: int = 0) -> None:
        self.mem, self.offset = mem, offset

    def __add__(self, n: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.offset + int(n))

    @property
    def ptr(self) -> int:
        return self.mem.ptr + self.offset


def _plain(x) -> bool:
    return isinstance(x, numpy.ndarray) and not isinstance(x, ndarray) and x.ndim > 0


class ndarray(numpy.ndarray):  # CuPy's name
    """A device array: a numpy array over emulated device memory."""

    def __new__(cls, shape, dtype=float, memptr: MemoryPointer | None = None, strides=None, order="C"):
        if memptr is None:
            n = int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
            memptr = MemoryPointer(_Memory(n))
        buf = memoryview(memptr.mem.map)[memptr.mem.start:memptr.mem.start + memptr.mem.size]
        arr = numpy.ndarray.__new__(cls, shape, dtype, buffer=buf, offset=memptr.offset, strides=strides,
                                    order=order)
        arr._memptr = memptr  # keeps the allocation alive
        return arr

    @property
    def data(self) -> MemoryPointer:  # CuPy's: the allocation, pointing at this view's first element
        root = self
        while getattr(root, "_memptr", None) is None:
            if root.base is None:
                raise AssertionError("fake cupy: an array outside emulated device memory (made by numpy itself)")
            root = root.base
        return MemoryPointer(root._memptr.mem, self.ctypes.data - root._memptr.mem.ptr)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _count()
        if any(_plain(x) for x in (*inputs, *kwargs.get("out", ()))):
            raise TypeError(f"Unsupported type {numpy.ndarray} (a numpy array mixed with CuPy arrays in {ufunc.__name__})")
        args = [x.view(numpy.ndarray) if isinstance(x, ndarray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(numpy.ndarray) if isinstance(x, ndarray) else x for x in kwargs["out"])
        with numpy.errstate(all="ignore"):  # a GPU does not warn about overflow or NaN
            result = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(result)

    def __setitem__(self, key, value) -> None:  # a copy kernel on a GPU
        _count()
        if _plain(value):
            raise TypeError(f"Unsupported type {numpy.ndarray} assigned into a CuPy array")
        super().__setitem__(key, value.view(numpy.ndarray) if isinstance(value, ndarray) else value)

    def astype(self, dtype, *args, **kwargs):
        _count()
        return _device_copy(self.view(numpy.ndarray).astype(dtype, *args, **kwargs))

    def copy(self, order="C"):
        _count()
        return _device_copy(self.view(numpy.ndarray).copy(order))

    def get(self) -> numpy.ndarray:
        return numpy.array(self.view(numpy.ndarray))

    def set(self, arr) -> None:  # as strict as CuPy's
        if not isinstance(arr, numpy.ndarray) or isinstance(arr, ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        self.view(numpy.ndarray)[...] = arr


def _device_copy(x) -> ndarray:
    x = numpy.asarray(x)
    out = ndarray(x.shape, x.dtype)
    out.view(numpy.ndarray)[...] = x
    return out


def _wrap(result):
    """numpy's result as device arrays (copied into guarded device memory when new)."""
    if isinstance(result, tuple):
        return tuple(_wrap(r) for r in result)
    if isinstance(result, numpy.generic):  # a reduction's result: a 0-d device array in CuPy
        return _device_copy(numpy.asarray(result))
    if isinstance(result, ndarray) or not isinstance(result, numpy.ndarray):
        return result
    return _device_copy(result)


def _device_function(name: str):
    fn = getattr(numpy, name)

    def call(*args, **kwargs):
        global _nested
        for a in (*args, *kwargs.values()):
            seq = a if isinstance(a, (list, tuple)) else (a,)
            if any(_plain(x) for x in seq):
                raise TypeError(f"Unsupported type {numpy.ndarray} passed to cupy.{name}")
        _count()
        _nested += 1
        try:
            with numpy.errstate(all="ignore"):
                return _wrap(fn(*args, **kwargs))
        finally:
            _nested -= 1
    call.__name__ = name
    return call


for _name in ("matmul", "tile", "concatenate", "stack", "where", "clip", "mean", "sum", "max", "min", "argmax",
              "exp", "tanh", "sqrt", "reciprocal", "abs", "maximum", "minimum", "cos", "sin", "log", "add",
              "subtract", "multiply", "divide", "negative", "square", "arange", "full", "ones", "zeros_like", "log2",
              "exp2",
              "ones_like", "isfinite", "allclose", "array_equal", "float_power", "power", "floor", "ceil"):
    globals()[_name] = _device_function(_name)


def empty(shape, dtype=float, order="C") -> ndarray:
    return ndarray(shape if isinstance(shape, tuple) else (shape,), dtype)


def zeros(shape, dtype=float, order="C") -> ndarray:
    out = empty(shape, dtype)
    out.view(numpy.ndarray)[...] = 0
    return out


def empty_like(a, dtype=None) -> ndarray:
    return empty(a.shape, dtype or a.dtype)


def asarray(a, dtype=None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or numpy.dtype(dtype) == a.dtype):
        return a
    return _device_copy(numpy.asarray(a.view(numpy.ndarray) if isinstance(a, ndarray) else a, dtype=dtype))


array = asarray


def ascontiguousarray(a, dtype=None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)} passed to cupy.ascontiguousarray")
    if a.flags.c_contiguous and (dtype is None or numpy.dtype(dtype) == a.dtype):
        return a
    return _device_copy(numpy.ascontiguousarray(a.view(numpy.ndarray), dtype=dtype))


def asnumpy(a) -> numpy.ndarray:
    return a.get() if isinstance(a, ndarray) else numpy.asarray(a)


class RawModule:
    """Kernels from CUDA source text, compiled (once per text) for the emulator.  ``options``
    are read for ``-I`` include directories, as NVRTC reads them."""

    def __init__(self, code: str, options=(), name_expressions=None, **_) -> None:
        self.code, self.options, self._module = code, tuple(options), None

    def compile(self, *_) -> None:
        if self._module is None:
            includes = [o[2:] for o in self.options if o.startswith("-I")]
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "source.cu"
                src.write_text(self.code)
                try:
                    self._module = emulator.Module(str(src), include_dirs=includes, device_array=ndarray)
                except emulator.BuildError as e:
                    log = re.sub(r"source\.cu:(\d+):\d+:", r"source.cu(\1):", str(e))  # NVRTC's "file(line):"
                    raise cuda.compiler.CompileException(log) from None

    def get_function(self, name: str):
        self.compile()
        kernel = self._module.get_function(name)

        def launch(*args, **kwargs):
            if _capturing():  # recorded into the stream's graph, run when the graph is launched
                _streams[-1].captured.append((kernel, args, kwargs))
                return None
            _count()
            return kernel(*args, **kwargs) if run_kernels else None
        return launch


# -- cupy.cuda.cublas: gemmEx, reading and writing device memory by address as cuBLAS does -----

class _CUBLASError(RuntimeError):
    pass


_CUDA_R = {0: numpy.float32, 2: numpy.float16}  # cudaDataType values: CUDA_R_32F, CUDA_R_16F
_COMPUTE_32F, _COMPUTE_16F = 68, 64
_HANDLE = 0x5EED
_pointer_mode = {_HANDLE: 0}  # CUBLAS_POINTER_MODE_HOST, as cublasCreate leaves it


def _device_region(ptr: int, nbytes: int, what: str) -> numpy.ndarray:
    """The bytes [ptr, ptr + nbytes) of one live allocation (a GPU would fault, or read another
    tensor, anywhere else)."""
    if not any(m.ptr <= ptr and ptr + nbytes <= m.ptr + m.size for m in list(_live)):
        raise _CUDARuntimeError(f"cudaErrorIllegalAddress: cuBLAS {what} reads {nbytes} bytes at {ptr:#x}, "
                                "outside every allocation")
    return numpy.frombuffer((ctypes.c_char * nbytes).from_address(ptr), numpy.uint8)


def _matrix(ptr: int, dtype, rows: int, cols: int, ld: int, what: str) -> numpy.ndarray:
    """The column-major rows x cols matrix cuBLAS reads at ptr with leading dimension ld."""
    if ld < 1 or ld < rows:  # (max and min are CuPy's in this module)
        raise _CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: {what}'s leading dimension {ld} < {rows} rows")
    item = numpy.dtype(dtype).itemsize
    flat = _device_region(ptr, ((cols - 1) * ld + rows) * item, what).view(dtype)
    return numpy.lib.stride_tricks.as_strided(flat, (rows, cols), (item, ld * item))


def _scalar(ptr: int, handle: int) -> float:
    if _pointer_mode[handle] == 0:
        return float(ctypes.c_float.from_address(ptr).value)
    return float(_device_region(ptr, 4, "a scalar").view(numpy.float32)[0])


def _gemm_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c, ctype, ldc,
             compute_type, algo) -> None:
    """C (m x n) = alpha op(A) op(B) + beta C, column-major, as cublasGemmEx; products and sums in
    float32 (what CUBLAS_COMPUTE_32F promises; a GPU's summation order differs in the last bits)."""
    if handle not in _pointer_mode:
        raise _CUBLASError("CUBLAS_STATUS_NOT_INITIALIZED: not a cuBLAS handle")
    types_ = (_CUDA_R.get(atype), _CUDA_R.get(btype), _CUDA_R.get(ctype))
    if (compute_type != _COMPUTE_32F or types_[0] != types_[1] or None in types_
            or (types_[0] == numpy.float32 and types_[2] != numpy.float32)):
        raise _CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: types {atype}, {btype}, {ctype}, compute {compute_type}")
    if m < 0 or n < 0 or k < 0 or transa not in (0, 1) or transb not in (0, 1):
        raise _CUBLASError("CUBLAS_STATUS_INVALID_VALUE: sizes or operations")
    _count()
    if m == 0 or n == 0:
        return
    c_mat = _matrix(c, types_[2], m, n, ldc, "C")
    op_a = _matrix(a, types_[0], *((m, k) if transa == 0 else (k, m)), lda, "A") if k else numpy.zeros((m, 0))
    op_b = _matrix(b, types_[1], *((k, n) if transb == 0 else (n, k)), ldb, "B") if k else numpy.zeros((0, n))
    op_a, op_b = (op_a if transa == 0 else op_a.T), (op_b if transb == 0 else op_b.T)
    result = _scalar(alpha, handle) * (op_a.astype(numpy.float32) @ op_b.astype(numpy.float32))
    beta_value = _scalar(beta, handle)
    if beta_value != 0:  # with beta 0, cuBLAS does not read C (NaN there stays out)
        result += beta_value * c_mat.astype(numpy.float32)
    with numpy.errstate(all="ignore"):
        c_mat[...] = result.astype(types_[2])


def _set_pointer_mode(handle: int, mode: int) -> None:
    if handle not in _pointer_mode or mode not in (0, 1):
        raise _CUBLASError("CUBLAS_STATUS_INVALID_VALUE: setPointerMode")
    _pointer_mode[handle] = mode


_cublas = types.SimpleNamespace(
    gemmEx=_gemm_ex, getPointerMode=lambda handle: _pointer_mode[handle], setPointerMode=_set_pointer_mode,
    CUBLASError=_CUBLASError, CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_POINTER_MODE_HOST=0,
    CUBLAS_POINTER_MODE_DEVICE=1, CUBLAS_COMPUTE_16F=_COMPUTE_16F, CUBLAS_COMPUTE_32F=_COMPUTE_32F,
    CUBLAS_GEMM_DEFAULT=-1)


# -- cupy.cuda ---------------------------------------------------------------------------------

class _OutOfMemoryError(MemoryError):
    def __init__(self, size: int, free: int) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {TOTAL_MEMORY - free:,} bytes).")


class _CompileException(Exception):
    pass


class _CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, index: int = 0) -> None:
        if not 0 <= int(index) < 1:
            raise _CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self.id = int(index)

    def __enter__(self) -> Device:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Stream:
    """CuPy's Stream as a context (the current stream), with graph capture: kernel launches on a
    capturing stream are recorded, not run; any other device operation then is an error."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int = 0, priority=None) -> None:
        self.null, self.captured = null, None

    def __enter__(self) -> Stream:  # noqa: PYI034
        _streams.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _streams.remove(self)

    def begin_capture(self, mode=None) -> None:
        if self.null:
            raise _CUDARuntimeError("cudaErrorStreamCaptureUnsupported: the legacy default stream cannot capture")
        if not _streams or _streams[-1] is not self:
            raise _CUDARuntimeError("fake cupy: capture a stream that is current (with stream: ...)")
        self.captured = []

    def end_capture(self) -> _Graph:
        if self.captured is None:
            raise _CUDARuntimeError("cudaErrorIllegalState: the stream is not capturing")
        graph, self.captured = _Graph(self.captured), None
        return graph

    def is_capturing(self) -> bool:
        return self.captured is not None

    def synchronize(self) -> None:
        if self.captured is not None:
            raise _CUDARuntimeError("cudaErrorStreamCaptureUnsupported: synchronize while capturing")


class _Graph:
    """A captured graph: one launch runs its kernels in order (one device operation counted)."""

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def launch(self, stream=None) -> None:
        global _nested
        _count()
        _nested += 1
        try:
            for kernel, args, kwargs in self.launches:
                if run_kernels:
                    kernel(*args, **kwargs)
        finally:
            _nested -= 1


_streams: list[Stream] = []  # the current stream is the last; none: the legacy default stream


class Event:
    """Host time stands in for GPU time: launches finish before they return here."""

    def record(self, stream=None) -> None:
        import time
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


def _elapsed_ms(start: Event, stop: Event) -> float:
    return (stop.t - start.t) * 1000


def _properties(index: int) -> dict:
    Device(index)
    return {"name": b"pyggml CUDA emulator", "totalGlobalMem": TOTAL_MEMORY, "major": 9, "minor": 0}


cuda = types.SimpleNamespace(
    alloc=lambda size: MemoryPointer(_Memory(size)),
    Device=Device,
    Event=Event,
    Stream=Stream,
    get_elapsed_time=_elapsed_ms,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=_properties,
                                  memGetInfo=lambda: (TOTAL_MEMORY - _allocated, TOTAL_MEMORY),
                                  CUDARuntimeError=_CUDARuntimeError, CUDA_R_32F=0, CUDA_R_16F=2),
    cublas=_cublas,
    device=types.SimpleNamespace(get_cublas_handle=lambda: _HANDLE),
    memory=types.SimpleNamespace(OutOfMemoryError=_OutOfMemoryError, MemoryPointer=MemoryPointer),
    compiler=types.SimpleNamespace(CompileException=_CompileException),
)
