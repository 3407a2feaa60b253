"""The CUDA backend's op table: our kernels (``kernels/``) and short CuPy expressions.

Matrix products with quantized weights run our kernels: for a few columns (decoding),
activations are quantized to q8_1 on the GPU and multiplied by the integer matrix-vector
kernel, which reads every weight byte once; for more columns (a prompt), the weights are
dequantized to F16 and cuBLAS multiplies on the tensor cores into an F32 result (blas.py).
F32 and F16 matrices of a few columns (the experts' router) have a matrix-vector kernel too
(kernels/mmv.cu), and MUL_MAT_ID runs both with the expert ids read on the GPU.
Every op a decode step runs (RMS norm, RoPE, softmax, GLU, attention over the F16 cache,
the cache update, element-wise ops, embedding rows, the experts' routing) is one kernel launch (attention: two),
since on a GPU the launches, not the arithmetic, are what such small ops cost - and a graph
of nothing but our kernels' launches can be recorded and replayed as a CUDA graph
(replay.py).  Ops that do more (CuPy expressions for unary ops, copies, concat, argmax;
cuBLAS; copies of odd layouts) call ``eager()``.  All have the CPU backend's semantics
(``pyggml/cpu/ops/``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from ..opdefs import (VIEW_OPS, ArgsortParams, ClampParams, ConcatParams, FlashAttnParams, GluOp, GluParams, NormParams, Op,
                      RopeMode, RopeParams, ScaleParams, SoftMaxParams, SortOrder, UnaryOp, UnaryParams)
from ..tensor import Tensor, TensorFlag
from ..types import Type
from .blas import gemm_f16_f32, to_f16_scaled
from .buffer import cupy_module, tensor_rows, tensor_view
from .replay import eager
from .runtime import function

Kernel = Callable[[Tensor], None]
MMVQ_MAX_COLS = 8    # columns one matrix-vector launch handles (kernels/mmvq.cu)
MMVQ_MAX_BATCH = 32  # up to this many tokens the matrix-vector kernel beats dequantize + GEMM
MMVQ_ID_MAX_PAIRS = 64  # (token, expert) pairs up to which MUL_MAT_ID runs one matrix-vector launch
GEMM_TILE_ROWS = 4096  # weight rows dequantized at a time for a prompt's GEMM (bounds the F16 copy)
QUANT_KERNELS = {Type.Q4_0: "q4_0", Type.Q4_1: "q4_1", Type.Q5_0: "q5_0", Type.Q5_1: "q5_1", Type.Q8_0: "q8_0",
                 Type.Q4_K: "q4_k", Type.Q5_K: "q5_k", Type.Q6_K: "q6_k", Type.MXFP4: "mxfp4"}
PLAIN = (Type.F32, Type.F16)


def supports(node: Tensor) -> bool:
    """Types the kernels handle: plain F32/F16 everywhere, quantized weights where listed;
    attention heads of at most ATTN_MAX_D.  (The RPC server asks with bare probes, no sources.)"""
    readable = (*PLAIN, Type.I32, *QUANT_KERNELS)
    if node.op == Op.SET_ROWS and len(node.src) > 1 and node.src[1] is not None and node.src[1].type == Type.I64:
        readable = (*readable, Type.I64)  # row ids of either width, as ggml's
    writable = (*PLAIN, Type.I32, *((Type.Q8_0,) if node.op in (Op.CPY, Op.DUP, Op.CONT) else ()))
    if not (all(s is None or s.type in readable for s in node.src) and node.type in writable):
        return False
    if node.op in (Op.MUL_MAT, Op.MUL_MAT_ID) and len(node.src) > 1 and node.src[1] is not None \
            and node.src[1].type not in PLAIN:
        return False  # (activations already in blocks: the CPU's; these kernels quantize to q8_1)
    if node.op == Op.UNARY:  # (a bare probe's zero parameters are ABS)
        try:
            return UnaryParams.of(node).op in UNARY
        except ValueError:
            return False
    if node.op == Op.GLU:
        try:
            return GluParams.of(node).op in (GluOp.REGLU, GluOp.GEGLU, GluOp.SWIGLU, GluOp.SWIGLU_OAI)
        except ValueError:
            return False
    return not (node.op == Op.FLASH_ATTN_EXT and node.src and node.src[0].ne[0] > ATTN_MAX_D)


def values(t: Tensor):
    """float32 [ne3, ne2, ne1, ne0] on the GPU (a view when the tensor already is F32)."""
    if t.type == Type.F32:
        return tensor_view(t)
    if t.type in (Type.F16, Type.I32):
        eager()
        return tensor_view(t).astype(np.float32)
    rows = tensor_rows(t)
    return dequantize(rows.reshape(-1, rows.shape[-1]), t.type, t.ne[0], np.float32).reshape(t.ne[::-1])


def dequantize(rows, qtype: Type, ncols: int, dtype):
    """Quantized rows (cupy uint8 [n, row_bytes], rows may be strided) -> [n, ncols] of dtype."""
    cp = cupy_module()
    n = rows.shape[0]
    out = cp.empty((n, ncols), dtype=dtype)
    groups = ncols // 32
    suffix = "f16" if dtype == np.float16 else "f32"
    fn = function("dequantize.cu", f"dequantize_{QUANT_KERNELS[qtype]}_{suffix}")
    threads = groups * n * 4  # one per part of a group (kernels/dequantize.cu)
    if threads == 0:
        return out
    fn(((threads + 255) // 256,), (256,), W=rows, y=out, groups=groups, rows=n, row_bytes=rows.strides[0],
       y_stride=ncols)
    return out


BINARY_OPS = {Op.ADD: 0, Op.SUB: 1, Op.MUL: 2, Op.DIV: 3}  # kernels/binary.cu


def _strides(a) -> tuple[int, int, int, int]:
    """Element strides of a 4-D array [ne3, ne2, ne1, ne0], innermost first: (s0, s1, s2, s3)."""
    return tuple(s // a.itemsize for s in reversed(a.strides))


def strides(prefix: str, a, dims: str = "0123") -> dict[str, int]:
    """A kernel's stride arguments of array ``a``, named as its C parameters are: ``prefix``
    then the dimension (``strides("xs", x, "123")`` is xs1, xs2, xs3)."""
    s = _strides(a)
    return {f"{prefix}{d}": s[int(d)] for d in dims}


def sizes(prefix: str, a) -> dict[str, int]:
    return {f"{prefix}{d}": n for d, n in enumerate(reversed(a.shape))}


def k_binary(node: Tensor) -> None:
    """ADD, SUB, MUL, DIV; src1 repeats over src0's shape where it is smaller (ggml_can_repeat)."""
    x, y = values(node.src[0]), values(node.src[1])
    _into_f32(node, lambda out: function("binary.cu", "binary_f32")(
        _grid(out.size), (256,), x=x, y=y, out=out, op=BINARY_OPS[node.op], **sizes("ne", out),
        **strides("xs", x), **sizes("ye", y), **strides("ys", y), **strides("os", out)))


def _map(node: Tensor, op: int, p: float, q: float) -> None:
    """SCALE (op 0: x * p + q) and CLAMP (op 1: x within [p, q]): kernels/binary.cu map_f32."""
    x = values(node.src[0])
    _into_f32(node, lambda out: function("binary.cu", "map_f32")(
        _grid(out.size), (256,), x=x, out=out, op=op, p=np.float32(p), q=np.float32(q), **sizes("ne", out),
        **strides("xs", x), **strides("os", out)))


def k_scale(node: Tensor) -> None:
    p = ScaleParams.of(node)
    _map(node, 0, p.scale, p.bias)


def k_add_id(node: Tensor) -> None:
    """ADD_ID (gpt-oss's per-expert biases): each (token, used slot) row plus its expert's bias row,
    the expert ids read on the GPU (kernels/binary.cu)."""
    a = _dense_rows(values(node.src[0]))[0]     # [n_tokens, n_used, n]
    b = _dense_rows(values(node.src[1]))[0, 0]  # [n_expert, n]
    ids = tensor_view(node.src[2])[0, 0]        # [n_tokens, n_used]
    n_tokens, n_used, n = a.shape

    def launch(y4) -> None:
        y = y4[0]
        function("binary.cu", "add_id_f32")(
            _grid(y.size), (256,), a=a, b=b, ids=ids, out=y, error=_index_errors(), ne0=n, n_used=n_used,
            n_tokens=n_tokens, n_expert=b.shape[0], as1=a.strides[1] // 4, as2=a.strides[0] // 4,
            bs1=b.strides[0] // 4, is0=ids.strides[1] // 4, is1=ids.strides[0] // 4, os1=y.strides[1] // 4,
            os2=y.strides[0] // 4)
    _into_f32(node, launch)


def k_clamp(node: Tensor) -> None:
    p = ClampParams.of(node)
    _map(node, 1, p.min, p.max)


def _gelu_tanh(x):
    cp = cupy_module()
    return 0.5 * x * (1 + cp.tanh(np.float32(math.sqrt(2 / math.pi)) * x * (1 + np.float32(0.044715) * x * x)))


def _silu(x):
    return x / (1 + cupy_module().exp(-x))


UNARY: dict[int, Callable] = {
    UnaryOp.ABS: lambda x: cupy_module().abs(x),
    UnaryOp.NEG: lambda x: -x,
    UnaryOp.TANH: lambda x: cupy_module().tanh(x),
    UnaryOp.RELU: lambda x: cupy_module().maximum(x, 0),
    UnaryOp.SIGMOID: lambda x: 1 / (1 + cupy_module().exp(-x)),
    UnaryOp.GELU: _gelu_tanh,
    UnaryOp.SILU: _silu,
    UnaryOp.EXP: lambda x: cupy_module().exp(x),
}


def k_unary(node: Tensor) -> None:
    eager()  # CuPy expressions
    op = UnaryParams.of(node).op
    fn = UNARY.get(op)
    if fn is None:
        raise NotImplementedError(f"CUDA backend: unary op {op.name} is not implemented")
    tensor_view(node)[...] = fn(values(node.src[0]))


# -- fused ops: one kernel each (kernels/norm.cu, softmax.cu, rope.cu, glu.cu, attention.cu, rows.cu) --------
# Their inputs are rows of contiguous elements with any row strides (views work as they are);
# they write F32 (into a temporary first when the output is F16).

def _rows(prefix: str, a) -> dict[str, int]:
    """The row strides of a 4-D array [ne3, ne2, ne1, ne0] as a kernel names them: prefix1..3."""
    return strides(prefix, a, "123")


def _dense_rows(a):
    """a with contiguous elements in its rows (any row strides): itself, or a dense copy."""
    if a.strides[3] == a.itemsize:
        return a
    eager()
    return cupy_module().ascontiguousarray(a)


def _flat(a):
    """a as one contiguous vector: a view, or a dense copy."""
    if not a.flags.c_contiguous:
        eager()
        a = cupy_module().ascontiguousarray(a)
    return a.reshape(-1)


def _optional_vector(node: Tensor, i: int):
    """Source i (attention sinks) as a contiguous F32 vector, or None where the op has none."""
    return _flat(values(node.src[i])) if len(node.src) > i and node.src[i] is not None else None


def _threads(n: int) -> int:
    """Threads of a block that loops over n elements of a row: whole warps, at most 256."""
    return min(256, 32 * max(1, -(-n // 32)))


def _grid(n: int, block: int = 256) -> tuple[int]:
    return (-(-n // block),)


def _into_f32(node: Tensor, launch: Callable) -> None:
    """launch(y) with y the node's output as float32 (a temporary, copied back, when it is F16)."""
    y = tensor_view(node)
    if y.size == 0:
        return
    if y.dtype == np.float32:
        launch(y)
    else:
        eager()
        tmp = cupy_module().empty(y.shape, dtype=np.float32)
        launch(tmp)
        y[...] = tmp


def k_rms_norm(node: Tensor, mul: Tensor | None = None) -> None:
    """RMS_NORM; with ``mul``, also the MUL by a weight vector that reads it (see fusions())."""
    x = _dense_rows(values(node.src[0]))
    w = _flat(tensor_view(mul.src[1])) if mul is not None else None
    ne3, ne2, ne1, ne0 = x.shape
    _into_f32(mul or node, lambda y: function("norm.cu", "rms_norm_f32")(
        (ne1 * ne2 * ne3,), (_threads(ne0),), x=x, w=w, y=y, ne0=ne0, ne1=ne1, ne2=ne2, **_rows("xs", x),
        **_rows("ys", y), eps=NormParams.of(node).eps))


def k_norm(node: Tensor) -> None:
    x = _dense_rows(values(node.src[0]))
    ne3, ne2, ne1, ne0 = x.shape
    _into_f32(node, lambda y: function("norm.cu", "norm_f32")(
        (ne1 * ne2 * ne3,), (_threads(ne0),), x=x, y=y, ne0=ne0, ne1=ne1, ne2=ne2, **_rows("xs", x),
        **_rows("ys", y), eps=NormParams.of(node).eps))


def k_sum_rows(node: Tensor) -> None:
    x = _dense_rows(values(node.src[0]))
    ne3, ne2, ne1, ne0 = x.shape
    _into_f32(node, lambda y: function("norm.cu", "sum_rows_f32")(
        (ne1 * ne2 * ne3,), (_threads(ne0),), x=x, y=y, ne0=ne0, ne1=ne1, ne2=ne2, **_rows("xs", x),
        **_rows("ys", y)))


def _argsort_rows(node: Tensor, k: int, descending: bool) -> None:
    """The first k indices of each row in ARGSORT's / TOP_K's order (kernels/sort.cu)."""
    x = _dense_rows(values(node.src[0]))
    y = tensor_view(node)
    ne3, ne2, ne1, ne0 = x.shape
    if y.size:
        function("sort.cu", "argsort_rows_f32")(
            (ne1 * ne2 * ne3,), (_threads(ne0),), x=x, out=y, ne0=ne0, k=k, ne1=ne1, ne2=ne2, **_rows("xs", x),
            **_rows("os", y), descending=int(descending))


def k_argsort(node: Tensor) -> None:
    _argsort_rows(node, node.ne[0], ArgsortParams.of(node).order == SortOrder.DESC)


def k_top_k(node: Tensor) -> None:
    _argsort_rows(node, node.ne[0], True)


_WRAPPERS: list[Callable[[str, Callable], Callable]] = []  # instrumented()'s, outermost last


@contextmanager
def instrumented(wrap: Callable[[str, Callable], Callable]):
    """While inside, every op kernel runs as ``wrap(name, kernel)`` - the op table's entries under
    their op's name, the fused pairs (fusions()) as "RMS_NORM+MUL" - to count or time them."""
    _WRAPPERS.append(wrap)
    try:
        yield
    finally:
        _WRAPPERS.remove(wrap)


def _wrapped(name: str, kernel: Callable) -> Callable:
    for wrap in _WRAPPERS:
        kernel = wrap(name, kernel)
    return kernel


def run_ops(graph, fused: dict[int, Tensor]) -> None:
    """A graph's ops through the op table, each RMS norm in ``fused`` with its MUL (replay.py
    may skip this after two runs)."""
    done: set[int] = set()  # MUL nodes already computed with their RMS norm
    begin_graph()
    for node in graph.nodes:
        if node.op in VIEW_OPS or id(node) in done:
            continue
        if id(node) in fused:
            _wrapped("RMS_NORM+MUL", k_rms_norm)(node, fused[id(node)])
            done.add(id(fused[id(node)]))
            continue
        kernel = OP_TABLE.get(node.op)
        if kernel is None:
            raise NotImplementedError(f"CUDA backend: op {node.op.name} is not implemented")
        _wrapped(node.op.name, kernel)(node)


def fusions(graph) -> dict[int, Tensor]:
    """{id(RMS_NORM node): the MUL node computed with it} for a graph: an RMS norm whose only
    reader is the next op, a MUL by an F32 weight vector (every norm with a weight, as
    models/blocks.py builds it), runs as one kernel.  Only for graphs whose scheduler said which
    tensors other splits read (Graph.read_across), and never for a tensor marked as an output."""
    if graph.read_across is None:
        return {}
    readers: dict[int, int] = {}
    for n in graph.nodes:
        for s in (*n.src, n.view_src):
            if s is not None:
                readers[id(s)] = readers.get(id(s), 0) + 1
    ops = [n for n in graph.nodes if n.op not in VIEW_OPS]
    plan = {}
    for norm, mul in zip(ops, ops[1:]):
        if norm.op != Op.RMS_NORM or mul.op != Op.MUL or mul.src[0] is not norm or readers.get(id(norm)) != 1:
            continue
        w = mul.src[1]
        if (w.type == Type.F32 and w.ne == (norm.ne[0], 1, 1, 1) and w.nb[0] == 4 and norm.type == Type.F32
                and not norm.flags & TensorFlag.OUTPUT and id(norm) not in graph.read_across):
            plan[id(norm)] = mul
    return plan


def k_soft_max(node: Tensor) -> None:
    a, mask = node.src[0], node.src[1]
    sinks = _optional_vector(node, 2)
    x = _dense_rows(values(a))
    ne3, ne2, ne1, ne0 = x.shape
    m = _dense_rows(values(mask)) if mask is not None else None
    mask_args = ({**_rows("ms", m), "m2": m.shape[1], "m3": m.shape[0]} if m is not None else
                 dict.fromkeys(("ms1", "ms2", "ms3", "m2", "m3"), 0))
    _into_f32(node, lambda y: function("softmax.cu", "soft_max_f32")(
        (ne1 * ne2 * ne3,), (_threads(ne0),), x=x, mask=m, sinks=sinks, y=y, ne0=ne0, ne1=ne1, ne2=ne2, **_rows("xs", x),
        **mask_args, **_rows("ys", y), scale=SoftMaxParams.of(node).scale))


def _yarn_corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def k_rope(node: Tensor) -> None:
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    p = RopeParams.of(node)
    n_dims, mode, n_ctx_orig = p.n_dims, p.mode, p.n_ctx_orig
    fb, fs, ef, af, bf, bs = p.freq_base, p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow
    low = high = 0.0
    if ef != 0.0:  # YaRN: the dimensions between which extrapolation turns into interpolation
        low = max(0.0, math.floor(_yarn_corr_dim(n_dims, n_ctx_orig, bf, fb)))
        high = min(n_dims - 1.0, math.ceil(_yarn_corr_dim(n_dims, n_ctx_orig, bs, fb)))
    x = _dense_rows(values(a))
    ne3, ne2, ne1, ne0 = x.shape
    positions = _flat(tensor_view(pos))
    factors = _flat(values(ff)) if ff is not None else None
    _into_f32(node, lambda y: function("rope.cu", "rope_f32")(
        _grid(ne1 * ne2 * ne3 * (ne0 // 2)), (256,), x=x, y=y, pos=positions, freq_factors=factors, ne0=ne0,
        ne1=ne1, ne2=ne2, nrows=ne1 * ne2 * ne3, **_rows("xs", x), **_rows("ys", y), n_dims=n_dims,
        neox=int(mode == RopeMode.NEOX), freq_base=fb, freq_scale=fs, ext_factor=ef, attn_factor=af,
        corr_low=low, corr_high=high))


def k_glu(node: Tensor) -> None:
    a = _dense_rows(values(node.src[0]))
    if node.src[1] is None:
        half = a.shape[-1] // 2
        a, b = a[..., :half], a[..., half:]
    else:
        b = _dense_rows(values(node.src[1]))
    p = GluParams.of(node)
    if p.swapped:
        a, b = b, a
    ne3, ne2, ne1, ne0 = a.shape
    shape = dict(ne0=ne0, ne1=ne1, ne2=ne2, nrows=ne1 * ne2 * ne3)
    if p.op == GluOp.SWIGLU_OAI:
        _into_f32(node, lambda y: function("glu.cu", "swiglu_oai_f32")(
            _grid(y.size), (256,), a=a, b=b, y=y, **shape, **_rows("as", a), **_rows("bs", b), **_rows("ys", y),
            alpha=np.float32(p.alpha), limit=np.float32(p.limit)))
        return
    _into_f32(node, lambda y: function("glu.cu", "glu_f32")(
        _grid(y.size), (256,), a=a, b=b, y=y, **shape, **_rows("as", a), **_rows("bs", b), **_rows("ys", y),
        op=int(p.op)))


ATTN_MAX_D = 512  # kernels/attention.cu
ATTN_SPLIT = 128  # keys per block of attn_split (kernels/attention.cu)


def k_flash_attn_ext(node: Tensor) -> None:
    cp = cupy_module()
    q, k, v, mask = node.src[:4]
    sinks = _optional_vector(node, 4)
    p = FlashAttnParams.of(node)
    scale, softcap = p.scale, p.logit_softcap
    if q.ne[0] > ATTN_MAX_D:
        raise NotImplementedError(f"CUDA backend: attention heads of {q.ne[0]} > {ATTN_MAX_D}")
    if k.type != Type.F16 or v.type != Type.F16:
        eager()
    f16 = [tensor_view(t) if t.type == Type.F16 else values(t).astype(cp.float16) for t in (k, v)]
    qv, kv, vv = _dense_rows(values(q)), _dense_rows(f16[0]), _dense_rows(f16[1])
    ne3, n_head, n_tokens, d = qv.shape
    n_kv, group, dv = kv.shape[2], n_head // kv.shape[1], vv.shape[3]
    m = _dense_rows(values(mask))[0, 0] if mask is not None else None
    rows = ne3 * n_head * n_tokens
    if rows == 0 or n_kv == 0:
        return
    n_split = -(-n_kv // ATTN_SPLIT)
    part = cp.empty((rows, n_split, 2 + dv), dtype=cp.float32)  # each chunk's {max, sum, output}
    (qt, qh, q3), (kj, kh, k3), (vj, vh, v3) = (_strides(a)[1:] for a in (qv, kv, vv))
    function("attention.cu", "attn_split")(
        (rows, n_split), (ATTN_SPLIT,), q=qv, k=kv, v=vv, mask=m, part=part, D=d, Dv=dv, n_kv=n_kv,
        n_tokens=n_tokens, n_head=n_head, group=group, qt=qt, qh=qh, q3=q3, kj=kj, kh=kh, k3=k3, vj=vj, vh=vh,
        v3=v3, ms=m.strides[0] // 4 if m is not None else 0, scale=scale, softcap=softcap)

    def combine(out):  # out: [ne3, n_tokens, n_head, dv]
        oh, ot, o3 = _strides(out)[1:]
        function("attention.cu", "attn_combine")((rows,), (_threads(dv),), part=part, sinks=sinks, out=out, Dv=dv,
                                                 n_split=n_split, n_tokens=n_tokens, n_head=n_head, oh=oh, ot=ot,
                                                 o3=o3)
    _into_f32(node, combine)


def _index_errors():
    """One int per device that rows.cu sets for an index out of range (read by check_errors)."""
    cp = cupy_module()
    dev = cp.cuda.Device().id
    if dev not in _ERROR_FLAGS:
        _ERROR_FLAGS[dev] = cp.zeros(1, dtype=cp.int32)
    return _ERROR_FLAGS[dev]


_ERROR_FLAGS: dict[int, object] = {}


INDEX_ERRORS = {1: "SET_ROWS: index out of range (those rows were not written)",  # kernels/common.cuh
                2: "GET_ROWS: index out of range (those rows were not read)",
                3: "MUL_MAT_ID: expert id out of range (those products were not computed)",
                4: "ADD_ID: id out of range (those rows were not written)"}


def check_errors() -> None:
    """Raise what the kernels flagged during the graph (one read per graph, not per op)."""
    flag = _ERROR_FLAGS.get(cupy_module().cuda.Device().id)
    if flag is not None:
        code = int(flag.get()[0])
        if code:
            flag.fill(0)
            raise IndexError(INDEX_ERRORS.get(code, f"a CUDA kernel reported error {code}"))


def _row_ids(idx: Tensor):
    """Row ids as int32 for the kernels: I64 ids converted, those past int32 made -1 (so the
    kernel flags them as out of range instead of wrapping them onto a valid row)."""
    ids = tensor_view(idx)
    if idx.type != Type.I64:
        return ids
    eager()  # CuPy expressions
    cp = cupy_module()
    return cp.where((ids >= 0) & (ids <= np.iinfo(np.int32).max), ids, -1).astype(cp.int32)


def k_set_rows(node: Tensor) -> None:
    src, idx, dst = node.src[0], node.src[1], node.src[2]
    x, ids, y = _dense_rows(values(src)), _row_ids(idx), tensor_view(node)
    ne3, ne2, ne1, ne0 = x.shape
    is1, is2, is3 = _strides(ids)[:3]
    kernel = "set_rows_f16" if node.type == Type.F16 else "set_rows_f32"
    if x.size:
        function("rows.cu", kernel)(
            _grid(x.size), (256,), x=x, ids=ids, y=y, error=_index_errors(), ne0=ne0, ne1=ne1, ne2=ne2,
            nrows=ne1 * ne2 * ne3, **_rows("xs", x), is1=is1, is2=is2, is3=is3, r2=src.ne[2] // idx.ne[1],
            r3=src.ne[3] // idx.ne[2], **_rows("ys", y), y_rows=dst.ne[1])


_Q8_1: dict[tuple, object] = {}  # activations quantized in the current graph, by (source tensor, slice)


def begin_graph() -> None:
    """Forget the last graph's quantized activations (CUDABackend.graph_compute calls this)."""
    _Q8_1.clear()


def quantize_q8_1(x, key: tuple | None = None):
    """x [N, K] float32 as q8_1 blocks, uint8 [N, K/32*36].  With a key, once per graph: the
    q, k and v products (gate and up) of a layer read the same activations.  A source's bytes
    cannot change while products that read it are still to run (the graph allocator reuses
    them only after its last reader), so the key is the source tensor and the slice."""
    if key is not None and key in _Q8_1:
        return _Q8_1[key]
    cp = cupy_module()
    n, k = x.shape
    if x.strides[1] != 4:
        eager()
        x = cp.ascontiguousarray(x)
    groups = k // 32
    xq = cp.empty((n, groups * 36), dtype=cp.uint8)
    function("quantize.cu", "quantize_q8_1")(((groups * n + 7) // 8,), (256,), x=x, y=xq, ncols=k,
                                             x_stride=x.strides[0] // 4, y_stride=groups * 36, nrows=n)
    if key is not None:
        _Q8_1[key] = xq
    return xq


def mmvq_shape(m: int) -> tuple[tuple[int], tuple[int, int]]:
    """Grid and block of the kernels/mmvq.cu kernels for m weight rows: four warps per row."""
    return (m,), (32, 4)


def mmvq_shape_pairs(m: int, pairs: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The same for MUL_MAT_ID's launches: a row of blocks per (token, slot) pair."""
    return (m, pairs), (32, 4)


def mul_mat_vec_q(w, qtype: Type, x, out, key: tuple | None = None) -> None:
    """out [N, M] = x [N, K] (float32) times weight rows w (uint8 [M, row_bytes]), N <= 8."""
    cp = cupy_module()
    n, k = x.shape
    m = w.shape[0]
    groups = k // 32
    xq = quantize_q8_1(x, key)
    dst = out if out.flags.c_contiguous else cp.empty((n, m), dtype=cp.float32)
    single = "_1" if n == 1 else ""  # one column: the variant with fewer registers (kernels/mmvq.cu)
    function("mmvq.cu", f"mul_mat_vec_{QUANT_KERNELS[qtype]}{single}")(
        *mmvq_shape(m), W=w, x=xq, dst=dst, groups=groups, nrows=m, row_bytes=w.strides[0], ncols=n,
        x_stride=groups * 36, dst_stride=m)
    if dst is not out:
        eager()
        out[...] = dst


def _product(a: Tensor, w, x, out, key: tuple | None = None) -> None:
    """out [N, M] = x [N, K] (float32) times one matrix of weight ``a``: w its rows, as bytes
    [M, row_bytes] (quantized) or as values [M, K] (F32, F16)."""
    if a.type in QUANT_KERNELS and x.shape[0] <= MMVQ_MAX_BATCH:
        for start in range(0, x.shape[0], MMVQ_MAX_COLS):
            part = None if key is None else (*key, start)
            mul_mat_vec_q(w, a.type, x[start:start + MMVQ_MAX_COLS], out[start:start + MMVQ_MAX_COLS], key=part)
    elif a.type in QUANT_KERNELS:  # a prompt: F16 weight tiles and tensor cores through cuBLAS, F32 result
        eager()  # (a prompt's graph seldom comes back, and its F16 tiles are large)
        xh, alpha = to_f16_scaled(x)
        for start in range(0, w.shape[0], GEMM_TILE_ROWS):
            wf = dequantize(w[start:start + GEMM_TILE_ROWS], a.type, a.ne[0], np.float16)
            gemm_f16_f32(xh, wf, out[:, start:start + GEMM_TILE_ROWS], alpha)
    elif x.shape[0] <= MMVQ_MAX_COLS and w.strides[1] == w.itemsize and x.strides[1] == 4:
        mul_mat_vec_plain(w, x, out)  # a decode step's plain matrix: a launch, not cuBLAS
    elif a.type == Type.F16:
        eager()
        xh, alpha = to_f16_scaled(x)
        gemm_f16_f32(xh, w, out, alpha)
    else:
        eager()
        out[...] = cupy_module().matmul(x, w.T)


def _matrices(a: Tensor):
    """Weight ``a``'s matrices, indexed [i3, i2]: rows as bytes (quantized) or values."""
    return tensor_rows(a) if a.type in QUANT_KERNELS else tensor_view(a)


def mul_mat_vec_plain(w, x, out) -> None:
    """out [N, M] = x [N, K] times F32 or F16 weight rows w [M, K] (contiguous rows), N <= 8
    (kernels/mmv.cu)."""
    cp = cupy_module()
    n, m = x.shape[0], w.shape[0]
    dst = out if out.flags.c_contiguous else cp.empty((n, m), dtype=cp.float32)
    kernel = "mul_mat_vec_f16" if w.dtype == np.float16 else "mul_mat_vec_f32"
    function("mmv.cu", kernel)(*mmvq_shape(m), W=w, x=x, dst=dst, ncols_w=w.shape[1], nrows=m,
                               row_stride=w.strides[0] // w.itemsize, ncols=n, x_stride=x.strides[0] // 4,
                               dst_stride=m)
    if dst is not out:
        eager()
        out[...] = dst


def _runs(node: Tensor, i: int, n: int) -> np.ndarray | None:
    """MUL_MAT's / MUL_MAT_ID's runs (ops.mul_mat) read on the host and checked, or None."""
    if len(node.src) <= i or node.src[i] is None:
        return None
    eager()
    r = cupy_module().asnumpy(tensor_view(node.src[i]).reshape(-1)).astype(np.int64)
    if r[0] != 0 or r[-1] != n or (np.diff(r) < 0).any():
        raise ValueError(f"{node.op.name}: runs must rise from 0 to {n}")
    return r


def k_mul_mat(node: Tensor) -> None:
    """Up to MMVQ_MAX_BATCH columns, each column's sums are its own whatever the batch (the
    matrix-vector kernels); past it, runs (ops.mul_mat) are multiplied one by one, so that a
    sequence's prompt beside others gets the products it gets alone."""
    a, b = node.src[0], node.src[1]
    out = tensor_view(node)  # [b3, b2, N, M]
    x = values(b)            # [b3, b2, N, K]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    w = _matrices(a)
    runs = _runs(node, 2, b.ne[1]) if b.ne[1] > MMVQ_MAX_BATCH else None
    if runs is not None:
        for r0, r1 in zip(runs[:-1], runs[1:]):
            if r1 > r0:
                _product(a, w[0, 0], x[0, 0, r0:r1], out[0, 0, r0:r1])
        return
    for i3 in range(b.ne[3]):
        for i2 in range(b.ne[2]):
            _product(a, w[i3 // r3, i2 // r2], x[i3, i2], out[i3, i2], key=(id(b), i3, i2))


def k_mul_mat_id(node: Tensor) -> None:
    """MUL_MAT_ID: a decode step's few (token, slot) pairs in one matrix-vector launch that reads
    each pair's expert id on the GPU (kernels/mmvq.cu, mmv.cu; a captured step replays it with
    new ids);
    more pairs (a prompt) are grouped by expert on the host, so that each expert's rows are
    read once for all of its tokens, as ggml's CUDA backend sorts them."""
    cp = cupy_module()
    a, b, ids = node.src[:3]
    n_expert, n_used, n_tokens, n_b = a.ne[2], ids.ne[0], ids.ne[1], b.ne[1]
    out = tensor_view(node)[0]    # [n_tokens, n_used, M]
    x = values(b)[0]              # [n_tokens, n_b, K]
    index = tensor_view(ids)[0, 0]  # [n_tokens, n_used]
    if out.size == 0:
        return
    pairs = n_tokens * n_used
    w = _matrices(a)[0]  # [n_expert, M, row bytes or K]
    if pairs <= MMVQ_ID_MAX_PAIRS and out.strides[2] == 4 and w.strides[2] == w.itemsize:
        columns = _flat(x).reshape(-1, x.shape[-1])  # [n_tokens * n_b, K], contiguous
        is0, is1 = _strides(index)[:2]
        common = dict(dst=out, ids=index, error=_index_errors(), nrows=a.ne[1], n_expert=n_expert, n_used=n_used,
                      n_b=n_b, is0=is0, is1=is1, ds1=out.strides[1] // 4, ds2=out.strides[0] // 4)
        if a.type in QUANT_KERNELS:
            groups = a.ne[0] // 32
            function("mmvq.cu", f"mul_mat_vec_id_{QUANT_KERNELS[a.type]}")(
                *mmvq_shape_pairs(a.ne[1], pairs), W=w, x=quantize_q8_1(columns, key=(id(b), "experts")),
                groups=groups, row_bytes=w.strides[1], expert_bytes=w.strides[0], x_stride=groups * 36, **common)
        else:
            kernel = "mul_mat_vec_id_f16" if a.type == Type.F16 else "mul_mat_vec_id_f32"
            function("mmv.cu", kernel)(
                *mmvq_shape_pairs(a.ne[1], pairs), W=w, x=columns, ncols_w=a.ne[0],
                row_stride=w.strides[1] // w.itemsize, expert_stride=w.strides[0] // w.itemsize,
                x_stride=columns.strides[0] // 4, **common)
        return
    eager()  # the ids are read on the host
    chosen = cp.asnumpy(index).astype(np.int64)
    if chosen.size and (chosen.min() < 0 or chosen.max() >= n_expert):
        raise IndexError(INDEX_ERRORS[3])
    runs = _runs(node, 3, n_tokens)  # a group: one expert's tokens of one run
    run_of = np.zeros(n_tokens, np.int64) if runs is None else np.searchsorted(runs, np.arange(n_tokens), "right") - 1
    key = chosen * (int(run_of.max()) + 1) + run_of[:, None]
    for group in np.unique(key):
        tok, slot = np.nonzero(key == group)
        t, s = cp.asarray(tok), cp.asarray(slot)
        res = cp.empty((len(tok), a.ne[1]), dtype=cp.float32)
        _product(a, w[int(chosen[tok[0], slot[0]])], cp.ascontiguousarray(x[t, s % n_b]), res)
        out[t, s] = res


def k_get_rows(node: Tensor) -> None:
    """out[i12, i11, i10] = row ids[i12, i11, i10] of src0[i12, i11], as F32 (quantized rows
    dequantized on the way); an index out of range is flagged for check_errors."""
    a, idx = node.src[0], node.src[1]
    ids = tensor_view(idx)  # I32 [1, n12, n11, n10]
    n10, n11, n12 = idx.ne[0], idx.ne[1], idx.ne[2]
    shape = dict(n10=n10, n11=n11, nrows=n10 * n11 * n12)
    id_strides = strides("is", ids, "012")
    if a.type in QUANT_KERNELS:
        w, groups = tensor_rows(a), a.ne[0] // 32
        _into_f32(node, lambda out: function("dequantize.cu", f"get_rows_{QUANT_KERNELS[a.type]}")(
            _grid(groups * n10 * n11 * n12 * 4), (256,), W=w, ids=ids, y=out, error=_index_errors(), groups=groups,
            **shape, wb1=a.nb[1], wb2=a.nb[2], wb3=a.nb[3], **id_strides, **_rows("ys", out), a_rows=a.ne[1]))
        return
    rows = _dense_rows(tensor_view(a) if a.type == Type.F16 else values(a))
    kernel = "get_rows_f16" if a.type == Type.F16 else "get_rows_f32"
    _into_f32(node, lambda out: function("rows.cu", kernel)(
        _grid(a.ne[0] * n10 * n11 * n12), (256,), a=rows, ids=ids, y=out, error=_index_errors(), ne0=a.ne[0],
        **shape, **_rows("as", rows), **id_strides, **_rows("ys", out), a_rows=a.ne[1]))


def k_cpy(node: Tensor) -> None:
    eager()  # CuPy expressions
    src = node.src[0]
    if node.type == Type.Q8_0:
        _quantize_q8_0(values(src).reshape(node.ne[::-1]), tensor_rows(node))
        return
    x = values(src) if src.type != node.type else tensor_view(src)
    out = tensor_view(node)
    out[...] = x.reshape(out.shape).astype(out.dtype) if x.shape != out.shape else x.astype(out.dtype)


def _quantize_q8_0(x, rows) -> None:
    """F32 values [ne3, ne2, ne1, ne0] into Q8_0 rows (uint8 [ne3, ne2, ne1, row_bytes]) with ggml's
    arithmetic (quants/legacy.quant_q8_0): d = amax / 127 per 32 values, q = roundf(x / d)."""
    cp = cupy_module()
    blocks = x.reshape(*x.shape[:3], -1, 32).astype(cp.float32)
    d = cp.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inv = cp.where(d == 0, np.float32(0), np.float32(1) / cp.where(d == 0, np.float32(1), d))
    scaled = blocks * inv
    a = cp.abs(scaled)
    rounded = cp.floor(a) + (a - cp.floor(a) >= 0.5)  # roundf: halves away from zero
    q = cp.where(scaled < 0, -rounded, rounded).astype(cp.int8)
    packed = cp.concatenate([d.astype(cp.float16).view(cp.uint8), q.view(cp.uint8)], axis=-1)
    rows[...] = packed.reshape(rows.shape)


def k_concat(node: Tensor) -> None:
    eager()  # CuPy expressions
    dim = ConcatParams.of(node).dim
    tensor_view(node)[...] = cupy_module().concatenate([values(node.src[0]), values(node.src[1])], axis=3 - dim)


def k_argmax(node: Tensor) -> None:
    eager()  # CuPy expressions
    tensor_view(node)[...] = values(node.src[0])[0, 0].argmax(axis=-1).astype(np.int32)


OP_TABLE: dict[Op, Kernel] = {
    Op.ADD: k_binary,
    Op.ADD_ID: k_add_id,
    Op.SUB: k_binary,
    Op.MUL: k_binary,
    Op.DIV: k_binary,
    Op.SCALE: k_scale,
    Op.CLAMP: k_clamp,
    Op.UNARY: k_unary,
    Op.GLU: k_glu,
    Op.RMS_NORM: k_rms_norm,
    Op.NORM: k_norm,
    Op.SOFT_MAX: k_soft_max,
    Op.ROPE: k_rope,
    Op.MUL_MAT: k_mul_mat,
    Op.GET_ROWS: k_get_rows,
    Op.SET_ROWS: k_set_rows,
    Op.CPY: k_cpy,
    Op.CONT: k_cpy,
    Op.DUP: k_cpy,
    Op.CONCAT: k_concat,
    Op.ARGMAX: k_argmax,
    Op.ARGSORT: k_argsort,
    Op.TOP_K: k_top_k,
    Op.SUM_ROWS: k_sum_rows,
    Op.MUL_MAT_ID: k_mul_mat_id,
    Op.FLASH_ATTN_EXT: k_flash_attn_ext,
}
