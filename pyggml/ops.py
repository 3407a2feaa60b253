"""Graph-building ops, named and numbered like ggml's.

Each function returns a new :class:`Tensor` that records its op, parameters and sources;
nothing is computed.  Shapes are checked here, when the op is built, and a mismatch is a
``ValueError`` naming the op and the shapes involved.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .opdefs import (VIEW_OPS, ArgsortParams, ClampParams, ConcatParams, FlashAttnParams, GluOp, GluParams,  # noqa: F401
                     NormParams, Op, PermuteParams, RopeMode, RopeParams, ScaleParams, SoftMaxParams, SortOrder,
                     UnaryOp, UnaryParams)
from .tensor import MAX_DIMS, Tensor, can_repeat, contiguous_strides
from .types import ACTIVATION_BLOCKS, Type


def _shapes(*ts: Tensor) -> str:
    return ", ".join(f"{t.name or '?'}{list(t.ne)}:{t.type.name}" for t in ts)


def _check(cond: bool, op: str, msg: str, *ts: Tensor) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg} ({_shapes(*ts)})")


def _result(op: Op, type: Type, ne: Sequence[int], src: Sequence[Tensor | None], name: str = "") -> Tensor:
    return Tensor(type, ne, op=op, src=src, name=name)


def _is_float(t: Tensor) -> bool:
    return t.type in (Type.F32, Type.F16, Type.BF16)


# -- element-wise ---------------------------------------------------------------------------

def _binary(op: Op, a: Tensor, b: Tensor) -> Tensor:
    _check(can_repeat(b, a), op.name, "second operand must broadcast to the first", a, b)
    _check(_is_float(a) and _is_float(b), op.name, "operands must be float tensors", a, b)
    return _result(op, Type.F32, a.ne, [a, b])


def add(a: Tensor, b: Tensor) -> Tensor:
    return _binary(Op.ADD, a, b)


def sub(a: Tensor, b: Tensor) -> Tensor:
    return _binary(Op.SUB, a, b)


def mul(a: Tensor, b: Tensor) -> Tensor:
    return _binary(Op.MUL, a, b)


def div(a: Tensor, b: Tensor) -> Tensor:
    return _binary(Op.DIV, a, b)


def scale(a: Tensor, s: float, bias: float = 0.0) -> Tensor:
    """a * s + bias."""
    _check(_is_float(a), "SCALE", "operand must be a float tensor", a)
    t = _result(Op.SCALE, Type.F32, a.ne, [a])
    ScaleParams(s, bias).pack(t.op_params)
    return t


def unary(a: Tensor, op: UnaryOp) -> Tensor:
    _check(_is_float(a), "UNARY", "operand must be a float tensor", a)
    t = _result(Op.UNARY, Type.F32, a.ne, [a])
    UnaryParams(UnaryOp(op)).pack(t.op_params)
    return t


def silu(a: Tensor) -> Tensor:
    return unary(a, UnaryOp.SILU)


def gelu(a: Tensor) -> Tensor:
    return unary(a, UnaryOp.GELU)


def tanh(a: Tensor) -> Tensor:
    return unary(a, UnaryOp.TANH)


def glu(a: Tensor, b: Tensor | None, op: GluOp, swapped: bool = False, alpha: float = 0.0,
        limit: float = 0.0) -> Tensor:
    """act(a) * b; with ``b`` None, ``a``'s first half of ne[0] is gated by the second half.
    ``alpha`` and ``limit``: SWIGLU_OAI's (0 for the others)."""
    if b is None:
        _check(a.ne[0] % 2 == 0, "GLU", "ne[0] must be even when the gate is fused", a)
        ne = (a.ne[0] // 2, *a.ne[1:])
    else:
        _check(a.ne == b.ne, "GLU", "gate and value must have the same shape", a, b)
        ne = a.ne
    if GluOp(op) != GluOp.SWIGLU_OAI:
        _check(alpha == 0.0 and limit == 0.0, "GLU", "alpha and limit are SWIGLU_OAI's", a)
    t = _result(Op.GLU, Type.F32, ne, [a, b])
    GluParams(GluOp(op), bool(swapped), alpha, limit).pack(t.op_params)
    return t


def swiglu_oai(a: Tensor, b: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): x = min(a, limit), y = clamp(b, -limit,
    limit), x * sigmoid(alpha * x) * (y + 1)."""
    return glu(a, b, GluOp.SWIGLU_OAI, False, alpha, limit)


def swiglu(a: Tensor, b: Tensor | None = None) -> Tensor:
    return glu(a, b, GluOp.SWIGLU)


def geglu(a: Tensor, b: Tensor | None = None) -> Tensor:
    return glu(a, b, GluOp.GEGLU)


# -- normalization, softmax, rope -------------------------------------------------------------

def _norm(op: Op, a: Tensor, eps: float) -> Tensor:
    _check(_is_float(a), op.name, "operand must be a float tensor", a)
    t = _result(op, Type.F32, a.ne, [a])
    NormParams(eps).pack(t.op_params)
    return t


def rms_norm(a: Tensor, eps: float) -> Tensor:
    return _norm(Op.RMS_NORM, a, eps)


def norm(a: Tensor, eps: float) -> Tensor:
    return _norm(Op.NORM, a, eps)


def soft_max_ext(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0,
                 sinks: Tensor | None = None) -> Tensor:
    """softmax(a * scale + mask) over ne[0]; the mask broadcasts over heads (ne[2], ne[3]).
    ``sinks`` (F32 [n_head], gpt-oss's attention sinks; ggml_soft_max_add_sinks): one more
    logit per head (ne[2]) in each row's softmax, whose probability is dropped."""
    _check(_is_float(a), "SOFT_MAX", "operand must be a float tensor", a)
    if max_bias != 0.0:
        raise ValueError("SOFT_MAX: ALiBi (max_bias != 0) is not supported")
    if mask is not None:
        _check(mask.type in (Type.F32, Type.F16), "SOFT_MAX", "mask must be F32 or F16", a, mask)
        _check(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], "SOFT_MAX",
               "mask must be [n_kv, >= n_rows]", a, mask)
        _check(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, "SOFT_MAX",
               "mask must broadcast over ne[2] and ne[3]", a, mask)
    if sinks is not None:
        _check(sinks.type == Type.F32 and sinks.n_dims == 1 and sinks.ne[0] == a.ne[2] and sinks.nb[0] == 4,
               "SOFT_MAX", "sinks must be F32 [n_head], one per ne[2]", a, sinks)
    t = _result(Op.SOFT_MAX, Type.F32, a.ne, [a, mask] + ([sinks] if sinks is not None else []))
    SoftMaxParams(scale, max_bias).pack(t.op_params)
    return t


def add_id(a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """a[:, i, j] + b[:, ids[i, j]]: a bias per chosen expert (ggml_add_id; gpt-oss's expert
    biases).  a: F32 [n, n_used, n_tokens], b: F32 [n, n_expert], ids: I32 [n_used, n_tokens]
    (each id checked against n_expert when the op runs)."""
    _check(a.type == Type.F32 and b.type == Type.F32 and ids.type == Type.I32, "ADD_ID",
           "a and b must be F32, ids I32", a, b, ids)
    _check(a.ne[0] == b.ne[0] and a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1] and a.ne[3] == 1
           and b.ne[2] == 1 and b.ne[3] == 1 and ids.ne[2] == 1 and ids.ne[3] == 1, "ADD_ID",
           "a [n, n_used, n_tokens], b [n, n_expert], ids [n_used, n_tokens]", a, b, ids)
    _check(a.nb[0] == 4 and b.nb[0] == 4, "ADD_ID", "rows of a and b must be contiguous", a, b)
    return _result(Op.ADD_ID, Type.F32, a.ne, [a, b, ids])


def soft_max(a: Tensor) -> Tensor:
    return soft_max_ext(a)


def rope_ext(a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, mode: int,
             n_ctx_orig: int = 0, freq_base: float = 10000.0, freq_scale: float = 1.0,
             ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
             beta_slow: float = 1.0) -> Tensor:
    """Rotary position embedding of a [head_dim, n_head, n_tokens] tensor at positions ``pos``."""
    _check(_is_float(a), "ROPE", "operand must be a float tensor", a)
    _check(pos.type == Type.I32 and pos.n_dims == 1 and pos.ne[0] == a.ne[2], "ROPE",
           "positions must be an I32 vector with one entry per token (ne[2])", a, pos)
    _check(0 < n_dims <= a.ne[0] and n_dims % 2 == 0, "ROPE", f"n_dims={n_dims} must be even and <= ne[0]", a)
    _check(mode in (RopeMode.NORMAL, RopeMode.NEOX), "ROPE", f"unsupported mode {mode}", a)
    if freq_factors is not None:
        _check(freq_factors.type == Type.F32 and freq_factors.ne[0] >= n_dims // 2, "ROPE",
               "freq_factors must be F32 with n_dims/2 entries", a, freq_factors)
    t = _result(Op.ROPE, Type.F32, a.ne, [a, pos, freq_factors])
    RopeParams(n_dims, int(mode), n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast,
               beta_slow).pack(t.op_params)
    return t


# -- matrix products and row gathers -----------------------------------------------------------

def mul_mat(a: Tensor, b: Tensor, runs: Tensor | None = None) -> Tensor:
    """a: [K, M, ...] (weights, any type), b: [K, N, ...] -> [M, N, ...] F32; b broadcasts a.

    b may also be in the weights' ``vec_dot_type`` already, as ggml allows: the product then
    takes its blocks as they are instead of converting b's rows.  Q8_0, Q8_1 or Q8_K (of the
    quantized weight types): what a tensor split sends between devices (models/tensor_split.py),
    rows a device quantized giving the bytes the whole would have.

    ``runs`` (pyggml's, not ggml's): I32 [n_runs + 1], the first column of each run of b's
    columns and N last.  Each run is multiplied as a product of its columns alone would be:
    ggml's kernels for a batch depend on its number of columns (their roundings too), so a
    batch that holds several sequences gives each the bits it gets alone.  b must be 2-D;
    the values are data, checked when the product runs."""
    _check(a.ne[0] == b.ne[0], "MUL_MAT", "inner dimensions (ne[0]) differ", a, b)
    _check(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, "MUL_MAT",
           "a's batch dims must divide b's", a, b)
    _check(not (a.nb[0] > a.nb[1]), "MUL_MAT", "first operand must not be transposed", a, b)
    _check(_is_float(b) or (b.type == a.type.vec_dot_type in ACTIVATION_BLOCKS
                            and b.nb[0] == b.type.type_size), "MUL_MAT",
           "second operand must be a float tensor, or in the blocks the weights' products take", a, b)
    if runs is None:
        return _result(Op.MUL_MAT, Type.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), [a, b])
    _check(runs.type == Type.I32 and runs.ne[0] >= 2 and runs.ne[1:] == (1, 1, 1) and runs.nb[0] == 4, "MUL_MAT",
           "runs must be I32 [n_runs + 1], contiguous", a, b, runs)
    _check(b.ne[2] == 1 and b.ne[3] == 1, "MUL_MAT", "runs need a 2-D second operand", a, b, runs)
    return _result(Op.MUL_MAT, Type.F32, (a.ne[1], b.ne[1], 1, 1), [a, b, runs])


def get_rows(a: Tensor, idx: Tensor) -> Tensor:
    """Rows of a [ne0, n_rows, ne2, ne3] picked by I32 idx [n, ne2, ne3] -> F32 [ne0, n, ne2, ne3]."""
    _check(idx.type in (Type.I32, Type.I64), "GET_ROWS", "indices must be I32 or I64", a, idx)
    _check(a.ne[2] == idx.ne[1] and a.ne[3] == idx.ne[2] and idx.ne[3] == 1, "GET_ROWS",
           "index batch dims must match the source's ne[2], ne[3]", a, idx)
    return _result(Op.GET_ROWS, Type.F32, (a.ne[0], idx.ne[0], idx.ne[1], idx.ne[2]), [a, idx])


def set_rows(dst: Tensor, src: Tensor, idx: Tensor) -> Tensor:
    """Write src's rows into dst at rows idx (converting to dst's type); returns a view of dst."""
    _check(idx.type in (Type.I32, Type.I64), "SET_ROWS", "indices must be I32 or I64", dst, idx)
    _check(src.ne[0] == dst.ne[0], "SET_ROWS", "row lengths differ", dst, src)
    _check(src.ne[1] == idx.ne[0], "SET_ROWS", "one index per source row is needed", src, idx)
    _check(src.ne[2] % idx.ne[1] == 0 and src.ne[3] % idx.ne[2] == 0, "SET_ROWS",
           "index batch dims must divide the source's", src, idx)
    _check(dst.ne[2] == src.ne[2] and dst.ne[3] == src.ne[3], "SET_ROWS", "batch dims differ", dst, src)
    _check(_is_float(src), "SET_ROWS", "source must be a float tensor", src)
    t = Tensor(dst.type, dst.ne, dst.nb, op=Op.SET_ROWS, src=[src, idx, dst], view_src=dst.data_root(),
               view_offs=_offs(dst))
    return t


# -- copies and views -------------------------------------------------------------------------------

def _offs(t: Tensor) -> int:
    return t.view_offs if t.view_src is not None else 0


def cpy(a: Tensor, b: Tensor) -> Tensor:
    """Copy a's values into b (converting type); the result is b, as a view, to be computed."""
    _check(a.nelements() == b.nelements(), "CPY", "element counts differ", a, b)
    t = Tensor(b.type, b.ne, b.nb, op=Op.CPY, src=[a, b], view_src=b.data_root(), view_offs=_offs(b))
    t.name = f"{b.name} (copy of {a.name})" if b.name else ""
    return t


def cast(a: Tensor, type: Type) -> Tensor:
    """a's values converted to ``type`` in a new tensor (ggml_cast: a CPY, whose destination
    ggml makes the result itself, src[1]; here the CPY has that one source).  F32 to Q8_0, Q8_1
    or Q8_K is ggml's CPU ``from_float``, the quantization its products give their activations."""
    _check(a.ne[0] % type.block_size == 0, "CPY", f"rows of {a.ne[0]} cannot be cut into {type.name} blocks", a)
    t = _result(Op.CPY, type, a.ne, [a])
    t.name = f"{a.name} ({type.name})" if a.name else ""
    return t


CONVERTING = frozenset({Op.CPY, Op.DUP, Op.CONT, Op.SET_ROWS})  # the ops that may write another type


def converts(t: Tensor) -> bool:
    """Whether ``t`` writes its first source's values in another type than theirs: a copy that
    quantizes or decodes (whose device needs a quantizer for the one, a decoder for the other)."""
    return t.op in CONVERTING and bool(t.src) and t.src[0] is not None and t.type != t.src[0].type


def cont(a: Tensor, *ne: int) -> Tensor:
    """A contiguous copy of a, optionally with a new shape of the same size (ggml_cont_Nd)."""
    shape = tuple(ne) if ne else a.ne
    _check(math.prod(shape) == a.nelements(), "CONT", f"new shape {shape} has another size", a)
    return _result(Op.CONT, a.type, shape, [a])


def _view(op: Op, a: Tensor, ne: Sequence[int], nb: Sequence[int], offset: int) -> Tensor:
    return Tensor(a.type, ne, nb, op=op, src=[a], view_src=a.data_root(), view_offs=_offs(a) + offset,
                  name=f"{a.name} ({op.name.lower()})" if a.name else "")


def view(a: Tensor, ne: Sequence[int], nb: Sequence[int] = (), offset: int = 0) -> Tensor:
    """ggml_view_Nd: ``nb`` gives the strides of dims 1.. (contiguous where not given)."""
    full = tuple(ne) + (1,) * (MAX_DIMS - len(ne))
    strides = list(contiguous_strides(a.type, full))
    for i, stride in enumerate(nb):
        strides[i + 1] = stride
    t = _view(Op.VIEW, a, full, strides, offset)
    root = a.data_root()
    _check(offset >= 0 and t.view_offs + t.nbytes() <= root.nbytes(), "VIEW",
           f"view of {list(full)} at offset {offset} leaves the source", a)
    return t


def reshape(a: Tensor, *ne: int) -> Tensor:
    _check(a.is_contiguous(), "RESHAPE", "source must be contiguous", a)
    _check(math.prod(ne) == a.nelements(), "RESHAPE", f"new shape {list(ne)} has another size", a)
    full = tuple(ne) + (1,) * (MAX_DIMS - len(ne))
    return _view(Op.RESHAPE, a, full, contiguous_strides(a.type, full), 0)


def permute(a: Tensor, ax0: int, ax1: int, ax2: int, ax3: int) -> Tensor:
    """ggml_permute: source dim i becomes result dim ax_i."""
    axes = (ax0, ax1, ax2, ax3)
    _check(sorted(axes) == [0, 1, 2, 3], "PERMUTE", f"axes {axes} are not a permutation", a)
    ne, nb = [0] * 4, [0] * 4
    for i, ax in enumerate(axes):
        ne[ax], nb[ax] = a.ne[i], a.nb[i]
    t = _view(Op.PERMUTE, a, ne, nb, 0)
    PermuteParams(*axes).pack(t.op_params)
    return t


def transpose(a: Tensor) -> Tensor:
    return permute(a, 1, 0, 2, 3)


def concat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """a and b joined along ``dim``.  Of any type: rows of a quantized type are whole blocks, so
    joining them along dim 0 joins their bytes (ggml's CPU concat takes plain types only)."""
    _check(0 <= dim < MAX_DIMS, "CONCAT", f"dim {dim} out of range", a, b)
    _check(a.type == b.type, "CONCAT", "types differ", a, b)
    _check(all(a.ne[i] == b.ne[i] for i in range(MAX_DIMS) if i != dim), "CONCAT",
           f"shapes differ outside dim {dim}", a, b)
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    t = _result(Op.CONCAT, a.type, ne, [a, b])
    ConcatParams(dim).pack(t.op_params)
    return t


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                   max_bias: float = 0.0, logit_softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """Fused attention softmax(q k^T * scale + mask) v, as ggml_flash_attn_ext.

    q: [head_dim, n_tokens, n_head], k: [head_dim, n_kv, n_head_kv], v: [head_dim_v, n_kv,
    n_head_kv] (n_head a multiple of n_head_kv: grouped-query attention), mask: [n_kv,
    >= n_tokens].  The result is [head_dim_v, n_head, n_tokens] - already in the layout of
    the attention output projection's input.  ``logit_softcap`` != 0 applies
    ``cap * tanh(s / cap)`` to the scores (Gemma 2).  ``sinks`` (F32 [n_head], gpt-oss; ggml's
    flash_attn_ext_add_sinks, the fifth source): one more logit per head in each softmax.
    """
    _check(_is_float(q) and _is_float(k) and _is_float(v), "FLASH_ATTN_EXT", "q, k, v must be float", q, k, v)
    _check(q.ne[0] == k.ne[0], "FLASH_ATTN_EXT", "q and k head sizes differ", q, k)
    _check(k.ne[1] == v.ne[1] and k.ne[2] == v.ne[2], "FLASH_ATTN_EXT", "k and v must have the same cells and heads", k, v)
    _check(k.ne[2] > 0 and q.ne[2] % k.ne[2] == 0 and q.ne[3] == k.ne[3] == v.ne[3], "FLASH_ATTN_EXT",
           "query heads must be a multiple of key/value heads", q, k)
    if mask is not None:
        _check(mask.type in (Type.F32, Type.F16), "FLASH_ATTN_EXT", "mask must be F32 or F16", mask)
        _check(mask.ne[0] == k.ne[1] and mask.ne[1] >= q.ne[1] and mask.ne[2] == 1 and mask.ne[3] == 1,
               "FLASH_ATTN_EXT", "mask must be [n_kv, >= n_tokens]", q, k, mask)
    if max_bias != 0.0:
        raise ValueError("FLASH_ATTN_EXT: ALiBi (max_bias != 0) is not supported")
    if sinks is not None:
        _check(sinks.type == Type.F32 and sinks.n_dims == 1 and sinks.ne[0] == q.ne[2] and sinks.nb[0] == 4,
               "FLASH_ATTN_EXT", "sinks must be F32 [n_head]", q, sinks)
    t = _result(Op.FLASH_ATTN_EXT, Type.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]),
                [q, k, v, mask] + ([sinks] if sinks is not None else []))
    FlashAttnParams(scale, max_bias, logit_softcap).pack(t.op_params)
    return t


def sum_rows(a: Tensor) -> Tensor:
    """The sum of each row of F32 ``a``: [1, ne1, ne2, ne3] (ggml_sum_rows)."""
    _check(a.type == Type.F32, "SUM_ROWS", "needs F32", a)
    return _result(Op.SUM_ROWS, Type.F32, (1, a.ne[1], a.ne[2], a.ne[3]), [a])


def clamp(a: Tensor, lo: float, hi: float) -> Tensor:
    """Values of F32 ``a`` limited to [lo, hi] (ggml_clamp)."""
    _check(a.type == Type.F32, "CLAMP", "needs F32", a)
    t = _result(Op.CLAMP, Type.F32, a.ne, [a])
    ClampParams(lo, hi).pack(t.op_params)
    return t


def mul_mat_id(as_: Tensor, b: Tensor, ids: Tensor, runs: Tensor | None = None) -> Tensor:
    """ggml_mul_mat_id, the mixture-of-experts product: for token t and slot e, the matrix of
    expert ids[e, t] times b's row e (or its only row) of token t.

    as_: [K, M, n_expert] (any weight type), b: F32 [K, n_used or 1, n_tokens], ids: I32
    [n_used, n_tokens] -> F32 [M, n_used, n_tokens].  The ids are data: the kernels check each
    one against n_expert before reading a weight.  ``runs``: runs of tokens, as mul_mat's of
    columns (each expert's tokens of one run multiplied as if that run were the batch)."""
    _check(ids.type == Type.I32 and ids.ne[2] == 1 and ids.ne[3] == 1, "MUL_MAT_ID", "ids must be I32 [n_used, n_tokens]",
           as_, b, ids)
    _check(b.type == Type.F32 and b.ne[3] == 1 and as_.ne[3] == 1, "MUL_MAT_ID",
           "needs F32 activations and 3-D expert weights", as_, b, ids)
    _check(as_.ne[0] == b.ne[0], "MUL_MAT_ID", "inner sizes differ", as_, b)
    _check(ids.ne[1] == b.ne[2], "MUL_MAT_ID", "one row of ids per token", b, ids)
    _check(b.ne[1] in (1, ids.ne[0]), "MUL_MAT_ID", "b holds one row per used expert, or one for all", b, ids)
    if runs is None:
        return _result(Op.MUL_MAT_ID, Type.F32, (as_.ne[1], ids.ne[0], b.ne[2]), [as_, b, ids])
    _check(runs.type == Type.I32 and runs.ne[0] >= 2 and runs.ne[1:] == (1, 1, 1) and runs.nb[0] == 4,
           "MUL_MAT_ID", "runs must be I32 [n_runs + 1], contiguous", as_, b, runs)
    return _result(Op.MUL_MAT_ID, Type.F32, (as_.ne[1], ids.ne[0], b.ne[2]), [as_, b, ids, runs])


def argsort(a: Tensor, order: SortOrder = SortOrder.ASC) -> Tensor:
    """Indices that sort each row of F32 ``a`` (I32, the shape of ``a``), as ggml_argsort;
    equal values keep their order (ggml leaves that open)."""
    _check(a.type == Type.F32 and a.nb[0] == 4, "ARGSORT", "needs F32 rows of contiguous elements", a)
    t = _result(Op.ARGSORT, Type.I32, a.ne, [a])
    ArgsortParams(SortOrder(order)).pack(t.op_params)
    return t


def top_k(a: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` largest values of each row of F32 ``a`` (I32 [k, ne1, ne2,
    ne3]), as ggml_top_k.  ggml leaves their order open; here they come largest first, equal
    values lowest index first (``pyggml.ranking``: what the sampler uses)."""
    _check(a.type == Type.F32 and a.nb[0] == 4, "TOP_K", "needs F32 rows of contiguous elements", a)
    _check(0 < k <= a.ne[0], "TOP_K", f"k = {k} must be in 1..{a.ne[0]} (the row length)", a)
    return _result(Op.TOP_K, Type.I32, (k, a.ne[1], a.ne[2], a.ne[3]), [a])


def argmax(a: Tensor) -> Tensor:
    """Index of the largest value of each row, I32 [ne1]."""
    _check(a.type == Type.F32 and a.ne[2] == 1 and a.ne[3] == 1, "ARGMAX", "needs a 2-D F32 tensor", a)
    return _result(Op.ARGMAX, Type.I32, (a.ne[1],), [a])

