"""The CUDA backend's op table: CuPy array code, and our kernels for quantized weights.

Matrix products with quantized weights run the kernels in ``kernels/``: for a few columns
(decoding), activations are quantized to q8_1 on the GPU and multiplied by the integer
matrix-vector kernel, which reads every weight byte once; for more columns (a prompt),
the weights are dequantized to F16 and cuBLAS multiplies on the tensor cores.  The other
ops are short CuPy expressions with the CPU backend's semantics (``pyggml/cpu/kernels.py``).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..ops import GluOp, Op, RopeMode, UnaryOp
from ..tensor import Tensor
from ..types import Type
from .device import tensor_rows, tensor_view
from .runtime import function

Kernel = Callable[[Tensor], None]
MMVQ_MAX_COLS = 8    # columns one matrix-vector launch handles (kernels/mmvq.cu)
MMVQ_MAX_BATCH = 32  # up to this many tokens the matrix-vector kernel beats dequantize + GEMM
GEMM_TILE_ROWS = 4096  # weight rows dequantized at a time for a prompt's GEMM (bounds the F16 copy)
QUANT_KERNELS = {Type.Q4_0: "q4_0", Type.Q4_1: "q4_1", Type.Q5_0: "q5_0", Type.Q5_1: "q5_1", Type.Q8_0: "q8_0",
                 Type.Q4_K: "q4_k", Type.Q5_K: "q5_k", Type.Q6_K: "q6_k"}
PLAIN = (Type.F32, Type.F16)


def _cp():
    import cupy
    return cupy


def supports(node: Tensor) -> bool:
    """Types the kernels handle: plain F32/F16 everywhere, quantized weights where listed."""
    readable = (*PLAIN, Type.I32, *QUANT_KERNELS)
    return all(s is None or s.type in readable for s in node.src) and node.type in (*PLAIN, Type.I32)


def values(t: Tensor):
    """float32 [ne3, ne2, ne1, ne0] on the GPU (a view when the tensor already is F32)."""
    if t.type == Type.F32:
        return tensor_view(t)
    if t.type in (Type.F16, Type.I32):
        return tensor_view(t).astype(np.float32)
    rows = tensor_rows(t)
    return dequantize(rows.reshape(-1, rows.shape[-1]), t.type, t.ne[0], np.float32).reshape(t.ne[::-1])


def dequantize(rows, qtype: Type, ncols: int, dtype):
    """Quantized rows (cupy uint8 [n, row_bytes], rows may be strided) -> [n, ncols] of dtype."""
    cp = _cp()
    n = rows.shape[0]
    out = cp.empty((n, ncols), dtype=dtype)
    groups = ncols // 32
    suffix = "f16" if dtype == np.float16 else "f32"
    fn = function("dequantize.cu", f"dequantize_{QUANT_KERNELS[qtype]}_{suffix}")
    threads = groups * n * 4  # one per part of a group (kernels/dequantize.cu)
    if threads == 0:
        return out
    fn(((threads + 255) // 256,), (256,), (rows, out, np.int64(groups), np.int64(n), np.int64(rows.strides[0]),
                                         np.int64(ncols)))
    return out


def _tile(b, shape):
    if b.shape == shape or all(x in (1, y) for x, y in zip(b.shape, shape)):
        return b
    return _cp().tile(b, tuple(y // x for x, y in zip(b.shape, shape)))


def _binary(fn_name: str) -> Kernel:
    def kernel(node: Tensor) -> None:
        cp = _cp()
        out = tensor_view(node)
        getattr(cp, fn_name)(values(node.src[0]), _tile(values(node.src[1]), out.shape), out=out)
    return kernel


def k_scale(node: Tensor) -> None:
    out = tensor_view(node)
    out[...] = values(node.src[0]) * np.float32(node.get_op_params_f32(0)) + np.float32(node.get_op_params_f32(1))


def _gelu_tanh(x):
    cp = _cp()
    return 0.5 * x * (1 + cp.tanh(np.float32(math.sqrt(2 / math.pi)) * x * (1 + np.float32(0.044715) * x * x)))


def _silu(x):
    return x / (1 + _cp().exp(-x))


UNARY: dict[int, Callable] = {
    UnaryOp.ABS: lambda x: _cp().abs(x),
    UnaryOp.NEG: lambda x: -x,
    UnaryOp.TANH: lambda x: _cp().tanh(x),
    UnaryOp.RELU: lambda x: _cp().maximum(x, 0),
    UnaryOp.SIGMOID: lambda x: 1 / (1 + _cp().exp(-x)),
    UnaryOp.GELU: _gelu_tanh,
    UnaryOp.SILU: _silu,
    UnaryOp.EXP: lambda x: _cp().exp(x),
}
GLU_ACT = {GluOp.REGLU: UNARY[UnaryOp.RELU], GluOp.GEGLU: _gelu_tanh, GluOp.SWIGLU: _silu}


def k_unary(node: Tensor) -> None:
    fn = UNARY.get(int(node.op_params[0]))
    if fn is None:
        raise NotImplementedError(f"CUDA backend: unary op {int(node.op_params[0])} is not implemented")
    tensor_view(node)[...] = fn(values(node.src[0]))


def k_glu(node: Tensor) -> None:
    a = values(node.src[0])
    if node.src[1] is None:
        half = a.shape[-1] // 2
        a, b = a[..., :half], a[..., half:]
    else:
        b = values(node.src[1])
    if node.op_params[1]:
        a, b = b, a
    tensor_view(node)[...] = GLU_ACT[GluOp(int(node.op_params[0]))](a) * b


def k_rms_norm(node: Tensor) -> None:
    cp = _cp()
    x = values(node.src[0])
    mean_sq = cp.mean(x * x, axis=-1, keepdims=True)
    tensor_view(node)[...] = x * cp.reciprocal(cp.sqrt(mean_sq + np.float32(node.get_op_params_f32(0))))


def k_norm(node: Tensor) -> None:
    cp = _cp()
    x = values(node.src[0])
    c = x - x.mean(axis=-1, keepdims=True)
    tensor_view(node)[...] = c / cp.sqrt((c * c).mean(axis=-1, keepdims=True) + np.float32(node.get_op_params_f32(0)))


def _yarn_corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_cache(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
               attn_factor: float, beta_fast: float, beta_slow: float, n_ctx_orig: int,
               freq_factors: np.ndarray | None, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every rotation angle, [n_tokens, n_dims/2] (ggml's rope_yarn), computed
    in float64 on the GPU (``xp`` = cupy).  The CPU
    backend reproduces ggml's float32 steps instead (pyggml/cpu/nn.py)."""
    i = xp.arange(n_dims // 2, dtype=xp.float64)
    theta_extrap = pos.astype(xp.float64)[:, None] * freq_base ** (-2.0 * i / n_dims)
    if freq_factors is not None:
        theta_extrap = theta_extrap / freq_factors[: n_dims // 2].astype(xp.float64)
    theta = freq_scale * theta_extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        low = max(0.0, math.floor(_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base)))
        high = min(n_dims - 1.0, math.ceil(_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base)))
        ramp = 1 - xp.clip((i - low) / max(0.001, high - low), 0, 1)
        mix = ramp * ext_factor
        theta = theta * (1 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return (xp.cos(theta) * mscale).astype(xp.float32), (xp.sin(theta) * mscale).astype(xp.float32)


def _softmax_rows(x):
    cp = _cp()
    x = cp.exp(x - x.max(axis=-1, keepdims=True))
    return x / x.sum(axis=-1, keepdims=True)


def k_soft_max(node: Tensor) -> None:
    a, mask = node.src[0], node.src[1]
    x = values(a) * np.float32(node.get_op_params_f32(0))
    if mask is not None:
        x = x + _tile(values(mask)[:, :, :a.ne[1], :], x.shape)
    tensor_view(node)[...] = _softmax_rows(x)


def k_rope(node: Tensor) -> None:
    cp = _cp()
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    p = node.op_params
    n_dims, mode, n_ctx_orig = int(p[1]), int(p[2]), int(p[4])
    fb, fs, ef, af, bf, bs = (node.get_op_params_f32(i) for i in range(5, 11))
    # the CPU's formula, on the GPU (no copy of the positions to the host)
    cos, sin = rope_cache(tensor_view(pos).reshape(-1), n_dims, fb, fs, ef, af, bf, bs, n_ctx_orig,
                          tensor_view(ff).reshape(-1) if ff is not None else None, xp=cp)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x = values(a)
    out = tensor_view(node)
    if mode == RopeMode.NEOX:
        x0, x1 = x[..., : n_dims // 2], x[..., n_dims // 2: n_dims]
        out[..., : n_dims // 2], out[..., n_dims // 2: n_dims] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    if n_dims < a.ne[0]:
        out[..., n_dims:] = x[..., n_dims:]


def mul_mat_vec_q(w, qtype: Type, x, out) -> None:
    """out [N, M] = x [N, K] (float32) times weight rows w (uint8 [M, row_bytes]), N <= 8."""
    cp = _cp()
    n, k = x.shape
    m = w.shape[0]
    groups = k // 32
    xq = cp.empty((n, groups * 36), dtype=cp.uint8)
    x = cp.ascontiguousarray(x)
    warps = groups * n
    function("quantize.cu", "quantize_q8_1")(((warps + 7) // 8,), (256,),
                                             (x, xq, np.int64(k), np.int64(k), np.int64(groups * 36), np.int64(n)))
    dst = out if out.flags.c_contiguous else cp.empty((n, m), dtype=cp.float32)
    function("mmvq.cu", f"mul_mat_vec_{QUANT_KERNELS[qtype]}")(
        ((m + 3) // 4,), (32, 4), (w, xq, dst, np.int32(groups), np.int32(m), np.int64(w.strides[0]), np.int32(n),
                                   np.int64(groups * 36), np.int64(m)))
    if dst is not out:
        out[...] = dst


def k_mul_mat(node: Tensor) -> None:
    cp = _cp()
    a, b = node.src[0], node.src[1]
    out = tensor_view(node)  # [b3, b2, N, M]
    x = values(b)            # [b3, b2, N, K]
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    quantized = a.type in QUANT_KERNELS
    rows = tensor_rows(a) if quantized else None
    for i3 in range(b.ne[3]):
        for i2 in range(b.ne[2]):
            xi, oi = x[i3, i2], out[i3, i2]
            if quantized and xi.shape[0] <= MMVQ_MAX_BATCH:
                w = rows[i3 // r3, i2 // r2]
                for start in range(0, xi.shape[0], MMVQ_MAX_COLS):
                    mul_mat_vec_q(w, a.type, xi[start:start + MMVQ_MAX_COLS], oi[start:start + MMVQ_MAX_COLS])
            elif quantized:  # a prompt: F16 weight tiles and tensor cores through cuBLAS
                w, xh = rows[i3 // r3, i2 // r2], xi.astype(cp.float16)
                for start in range(0, w.shape[0], GEMM_TILE_ROWS):
                    wf = dequantize(w[start:start + GEMM_TILE_ROWS], a.type, a.ne[0], np.float16)
                    oi[:, start:start + GEMM_TILE_ROWS] = cp.matmul(xh, wf.T).astype(cp.float32)
            else:
                wa = tensor_view(a)[i3 // r3, i2 // r2]
                if a.type == Type.F16:
                    oi[...] = cp.matmul(xi.astype(cp.float16), wa.T).astype(cp.float32)
                else:
                    oi[...] = cp.matmul(xi, wa.T)


def k_flash_attn_ext(node: Tensor) -> None:
    cp = _cp()
    q, k, v, mask = node.src[:4]
    scale, softcap = node.get_op_params_f32(0), node.get_op_params_f32(2)
    n_tokens, n_head, n_head_kv = q.ne[1], q.ne[2], k.ne[2]
    group = n_head // n_head_kv
    out = tensor_view(node)  # [ne3, n_tokens, n_head, dv]
    qv, kv, vv = values(q), values(k), values(v)
    for i3 in range(q.ne[3]):
        qs = qv[i3].reshape(n_head_kv, group * n_tokens, q.ne[0])
        s = cp.matmul(qs, kv[i3].swapaxes(-1, -2))
        s = cp.tanh(s * np.float32(scale / softcap)) * np.float32(softcap) if softcap else s * np.float32(scale)
        s = s.reshape(n_head_kv, group, n_tokens, -1)
        if mask is not None:
            s = s + values(mask)[0, 0, :n_tokens]
        prob = _softmax_rows(s).reshape(n_head_kv, group * n_tokens, -1)
        o = cp.matmul(prob, vv[i3])
        out[i3] = o.reshape(n_head, n_tokens, -1).swapaxes(0, 1)


def _check_indices(ids, limit: int, op: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise IndexError(f"{op}: index out of range [0, {limit})")


def k_get_rows(node: Tensor) -> None:
    a, idx = node.src[0], node.src[1]
    ids = tensor_view(idx).astype(np.int64)  # [1, i2, i1, n]
    _check_indices(ids, a.ne[1], "GET_ROWS")
    out = tensor_view(node)
    for i2 in range(idx.ne[2]):
        for i1 in range(idx.ne[1]):
            sel = ids[0, i2, i1]
            if a.type in QUANT_KERNELS:
                picked = tensor_rows(a)[i2, i1][sel]
                out[i2, i1] = dequantize(picked, a.type, a.ne[0], np.float32)
            else:
                out[i2, i1] = values(a)[i2, i1][sel]


def k_set_rows(node: Tensor) -> None:
    src, idx, dst = node.src[0], node.src[1], node.src[2]
    ids = tensor_view(idx).astype(np.int64)
    _check_indices(ids, dst.ne[1], "SET_ROWS")
    x = values(src)
    r2, r3 = src.ne[2] // idx.ne[1], src.ne[3] // idx.ne[2]
    out = tensor_view(node)
    for i3 in range(src.ne[3]):
        for i2 in range(src.ne[2]):
            out[i3, i2][ids[0, i3 // r3, i2 // r2]] = x[i3, i2].astype(out.dtype)


def k_cpy(node: Tensor) -> None:
    src = node.src[0]
    x = values(src) if src.type != node.type else tensor_view(src)
    out = tensor_view(node)
    out[...] = x.reshape(out.shape).astype(out.dtype) if x.shape != out.shape else x.astype(out.dtype)


def k_concat(node: Tensor) -> None:
    dim = int(node.op_params[0])
    tensor_view(node)[...] = _cp().concatenate([values(node.src[0]), values(node.src[1])], axis=3 - dim)


def k_argmax(node: Tensor) -> None:
    tensor_view(node)[...] = values(node.src[0])[0, 0].argmax(axis=-1).astype(np.int32)


OP_TABLE: dict[Op, Kernel] = {
    Op.ADD: _binary("add"),
    Op.SUB: _binary("subtract"),
    Op.MUL: _binary("multiply"),
    Op.DIV: _binary("divide"),
    Op.SCALE: k_scale,
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
    Op.FLASH_ATTN_EXT: k_flash_attn_ext,
}
