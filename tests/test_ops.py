"""Every op on the CPU backend against an independent float64 numpy reference.

Arrays in these tests are numpy-ordered: shape (ne3, ne2, ne1, ne0).  Each op is run on
several shapes, and on non-contiguous inputs (a permuted or strided view) where the op
accepts them, and checked by normalized mean squared error like ggml's test-backend-ops.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from tests.conftest import run_graph

rng = np.random.default_rng(42)


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(((a - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-30))


def inp(shape, type=Type.F32, name="x"):
    """An input tensor for numpy shape (ne3, ne2, ne1, ne0) and data to feed it."""
    data = rng.standard_normal(shape).astype(type.np_dtype)
    t = pg.new_tensor(type, tuple(reversed(shape)), name).set_input()
    return t, data


SHAPES = [(1, 1, 3, 32), (2, 3, 4, 64), (1, 2, 5, 10)]


def permuted(shape):
    """A permuted view (swap dims 1 and 2) of a fresh input, and its values as numpy sees them."""
    t, data = inp(shape)
    return ops.permute(t, 0, 2, 1, 3), t, data, data.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,fn", [("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("div", np.divide)])
def test_binary_broadcast(shape, name, fn):
    a, av = inp(shape, name="a")
    for bshape in [shape, (1, 1, 1, shape[3]), (1, shape[1], 1, shape[3])]:
        b, bv = inp(bshape, name="b")
        if name == "div":
            bv = np.abs(bv) + 0.5
        out = run_graph(getattr(ops, name)(a, b), {a: av, b: bv})
        assert nmse(out, fn(av.astype(np.float64), bv.astype(np.float64))) < 1e-12


def test_binary_tiles_like_ggml_repeat():
    a, av = inp((1, 1, 4, 6), name="a")
    b, bv = inp((1, 1, 2, 3), name="b")
    out = run_graph(ops.add(a, b), {a: av, b: bv})
    assert nmse(out, av + np.tile(bv, (1, 1, 2, 2))) < 1e-12


def test_binary_on_permuted_view():
    v, t, data, seen = permuted((2, 3, 4, 8))
    b, bv = inp((1, 1, 1, 8), name="b")
    out = run_graph(ops.mul(v, b), {t: data, b: bv})
    assert nmse(out, seen * bv) < 1e-12


def test_scale_and_bias():
    a, av = inp((1, 2, 3, 16))
    assert nmse(run_graph(ops.scale(a, 0.25, 1.5), {a: av}), av.astype(np.float64) * 0.25 + 1.5) < 1e-12


UNARY_REF = {
    pg.UnaryOp.SILU: lambda x: x / (1 + np.exp(-x)),
    pg.UnaryOp.GELU: lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    pg.UnaryOp.GELU_ERF: lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    pg.UnaryOp.TANH: np.tanh,
    pg.UnaryOp.RELU: lambda x: np.maximum(x, 0),
    pg.UnaryOp.NEG: np.negative,
    pg.UnaryOp.EXP: np.exp,
}


# ggml's CPU backend reads GELU from a table of halves (GGML_GELU_FP16), and so do we: the
# value at F16(x), rounded to F16 - within what two half roundings cost of the exact function
UNARY_NMSE = {pg.UnaryOp.GELU: 1e-6}


@pytest.mark.parametrize("op", list(UNARY_REF), ids=lambda o: o.name)
@pytest.mark.parametrize("shape", SHAPES)
def test_unary(op, shape):
    a, av = inp(shape)
    out = run_graph(ops.unary(a, op), {a: av})
    assert nmse(out, UNARY_REF[op](av.astype(np.float64))) < UNARY_NMSE.get(op, 1e-10)
    if op == pg.UnaryOp.GELU:  # every value inside (-10, 10) comes from the half table
        inside = np.abs(av) < 10
        assert np.array_equal(out[inside], out[inside].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("op", [pg.UnaryOp.GELU, pg.GluOp.GEGLU], ids=lambda o: o.name)
def test_gelu_of_nan_and_infinities_is_ggmls(op):
    """NaN passes neither of GELU's bounds (-10, 10); ggml reads its table at the half NaN and
    gets NaN.  An out-of-range index into the table instead read memory past its end."""
    av = np.array([np.nan, np.inf, -np.inf, -np.nan, 3.0, -3.0, 10.0, -10.0] * 4, dtype=np.float32)
    a = pg.new_tensor(Type.F32, (av.size, 1, 1, 1), "a").set_input()
    if op == pg.GluOp.GEGLU:
        b = pg.new_tensor(Type.F32, (av.size, 1, 1, 1), "b").set_input()
        out = run_graph(ops.glu(a, b, op), {a: av, b: np.full(av.size, 2, np.float32)}).reshape(-1) / 2
    else:
        out = run_graph(ops.unary(a, op), {a: av}).reshape(-1)
    want = np.where(av <= -10, 0, np.where(av >= 10, av, np.nan)).astype(np.float32)
    nan = np.isnan(av)
    assert np.isnan(out[nan]).all()
    assert np.array_equal(out[~nan & (np.abs(av) >= 10)], want[~nan & (np.abs(av) >= 10)])
    assert np.allclose(out[np.abs(av) == 3], np.tile([2.9964, -0.0036], 4), atol=2e-3)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("op", [pg.GluOp.SWIGLU, pg.GluOp.GEGLU], ids=lambda o: o.name)
def test_glu(op, fused):
    act = UNARY_REF[pg.UnaryOp.SILU if op == pg.GluOp.SWIGLU else pg.UnaryOp.GELU]
    if fused:
        a, av = inp((1, 2, 3, 32))
        out = run_graph(ops.glu(a, None, op), {a: av})
        x = av.astype(np.float64)
        ref = act(x[..., :16]) * x[..., 16:]
    else:
        a, av = inp((1, 2, 3, 16), name="gate")
        b, bv = inp((1, 2, 3, 16), name="up")
        out = run_graph(ops.glu(a, b, op), {a: av, b: bv})
        ref = act(av.astype(np.float64)) * bv
    assert nmse(out, ref) < (1e-6 if op == pg.GluOp.GEGLU else 1e-10)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_and_norm(shape):
    a, av = inp(shape)
    x = av.astype(np.float64)
    ref = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)
    assert nmse(run_graph(ops.rms_norm(a, 1e-6), {a: av}), ref) < 1e-12
    c = x - x.mean(-1, keepdims=True)
    ref = c / np.sqrt((c ** 2).mean(-1, keepdims=True) + 1e-5)
    assert nmse(run_graph(ops.norm(a, 1e-5), {a: av}), ref) < 1e-12


def test_rms_norm_on_permuted_view():
    v, t, data, seen = permuted((1, 3, 4, 16))
    x = seen.astype(np.float64)
    ref = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)
    assert nmse(run_graph(ops.rms_norm(v, 1e-6), {t: data}), ref) < 1e-12


@pytest.mark.parametrize("mask_type", [None, Type.F32, Type.F16])
@pytest.mark.parametrize("shape", [(1, 4, 3, 8), (2, 2, 5, 33)])
def test_soft_max_ext(shape, mask_type):
    a, av = inp(shape)
    x = av.astype(np.float64) * 0.7
    inputs = {a: av}
    mask = None
    if mask_type is not None:
        mv = np.where(rng.random((1, 1, shape[2] + 2, shape[3])) < 0.3, -np.inf, 0).astype(mask_type.np_dtype)
        mv[..., 0] = 0  # keep at least one visible column per row
        mask = pg.new_tensor(mask_type, (shape[3], shape[2] + 2), "mask").set_input()  # padded rows, like llama.cpp
        inputs[mask] = mv
        x = x + mv[:, :, : shape[2], :].astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    assert nmse(run_graph(ops.soft_max_ext(a, mask, 0.7), inputs), ref) < 1e-10


def rope_ref(x, pos, n_dims, mode, base, freq_scale=1.0):
    """x: (ne3, n_tokens, n_head, head_dim) float64."""
    out = x.copy()
    half = n_dims // 2
    theta = pos[:, None] * freq_scale * base ** (-2.0 * np.arange(half) / n_dims)  # (tokens, half)
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    if mode == pg.RopeMode.NEOX:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = np.arange(0, n_dims, 2), np.arange(1, n_dims, 2)
    out[..., i0] = x[..., i0] * c - x[..., i1] * s
    out[..., i1] = x[..., i0] * s + x[..., i1] * c
    return out


@pytest.mark.parametrize("mode", [pg.RopeMode.NORMAL, pg.RopeMode.NEOX], ids=lambda m: m.name)
@pytest.mark.parametrize("n_dims", [64, 32])
def test_rope(mode, n_dims):
    a, av = inp((1, 5, 3, 64))  # [head_dim 64, 3 heads, 5 tokens]
    pos = pg.new_tensor(Type.I32, (5,), "pos").set_input()
    pv = np.array([0, 1, 7, 100, 2047], dtype=np.int32)
    out = run_graph(ops.rope_ext(a, pos, None, n_dims, mode, freq_base=10000.0, freq_scale=0.5),
                    {a: av, pos: pv})
    assert nmse(out, rope_ref(av.astype(np.float64), pv.astype(np.float64), n_dims, mode, 10000.0, 0.5)) < 1e-10


def test_rope_rejects_bad_positions():
    a, _ = inp((1, 5, 3, 64))
    with pytest.raises(ValueError, match="ROPE"):
        ops.rope_ext(a, pg.new_tensor(Type.I32, (4,)), None, 64, 0)


@pytest.mark.parametrize("shape", [(1, 1, 5, 32), (1, 2, 3, 64)])
@pytest.mark.parametrize("src_type", [Type.F32, Type.F16, Type.Q8_0])
def test_get_rows(shape, src_type):
    data = rng.standard_normal(shape).astype(np.float32)
    src = pg.new_tensor(src_type, tuple(reversed(shape)), "table").set_input()
    stored = pg.quants.quantize(data, src_type)
    idx = pg.new_tensor(Type.I32, (4, shape[1]), "idx").set_input()
    iv = rng.integers(0, shape[2], (1, 1, shape[1], 4)).astype(np.int32)
    out = run_graph(ops.get_rows(src, idx), {src: stored, idx: iv})
    table = pg.quants.dequantize(stored, src_type).reshape(shape).astype(np.float64)
    ref = np.stack([table[0, i2][iv[0, 0, i2]] for i2 in range(shape[1])])[None]
    assert nmse(out, ref) < 1e-14


@pytest.mark.parametrize("dst_type", [Type.F32, Type.F16])
def test_set_rows_writes_into_destination(dst_type):
    dst = pg.new_tensor(dst_type, (16, 10), "cache")
    pg.alloc_tensors([dst], pg.cpu_device().get_buffer_type())
    before = rng.standard_normal((10, 16)).astype(dst_type.np_dtype)
    pg.tensor_set(dst, before)
    src, sv = inp((1, 1, 3, 16), name="new")
    idx = pg.new_tensor(Type.I64, (3,), "rows").set_input()
    iv = np.array([7, 2, 9], dtype=np.int64)
    run_graph(ops.set_rows(dst, src, idx), {src: sv, idx: iv})
    expected = before.astype(np.float64)
    expected[iv] = sv[0, 0].astype(dst_type.np_dtype)
    assert np.array_equal(pg.tensor_array(dst)[0, 0].astype(np.float64), expected)


@pytest.mark.parametrize("dst_type", [Type.F32, Type.F16, Type.Q8_0])
def test_cpy_converts_and_relayouts(dst_type):
    v, t, data, seen = permuted((1, 2, 3, 32))
    dst = pg.new_tensor(dst_type, (32, 3, 2), "dst")
    pg.alloc_tensors([dst], pg.cpu_device().get_buffer_type())
    run_graph(ops.cpy(v, dst), {t: data})
    got = pg.quants.dequantize(pg.tensor_get(dst).reshape(-1, dst.row_size()), dst_type).reshape(seen.shape)
    ref = pg.quants.dequantize(pg.quants.quantize(np.ascontiguousarray(seen), dst_type), dst_type)
    assert np.array_equal(got, ref.reshape(seen.shape))


def test_cont_reshape_transpose_view_concat():
    a, av = inp((1, 2, 3, 4))
    out = run_graph(ops.cont(ops.transpose(a)), {a: av})
    assert np.array_equal(out, av.transpose(0, 1, 3, 2))
    out = run_graph(ops.cont(ops.reshape(a, 12, 2)), {a: av})
    assert np.array_equal(out.reshape(-1), av.reshape(-1))
    view = ops.view(a, (2, 3), (a.nb[1],), offset=2 * 4)  # columns 2..3 of every row of the first matrix
    out = run_graph(ops.cont(view), {a: av})
    assert np.array_equal(out[0, 0], av[0, 0, :, 2:4])
    b, bv = inp((1, 2, 5, 4), name="b")
    out = run_graph(ops.concat(a, b, 1), {a: av, b: bv})
    assert np.array_equal(out, np.concatenate([av, bv], axis=2))


def test_argmax():
    a, av = inp((1, 1, 4, 50))
    assert np.array_equal(run_graph(ops.argmax(a), {a: av}).reshape(-1), av[0, 0].argmax(-1))


@pytest.mark.parametrize("a_shape,b_shape", [((1, 1, 8, 32), (1, 1, 5, 32)), ((1, 2, 6, 16), (1, 4, 3, 16)),
                                             ((2, 1, 4, 8), (2, 3, 7, 8))])
def test_mul_mat_float_with_broadcast(a_shape, b_shape):
    a, av = inp(a_shape, Type.F16, "a")
    b, bv = inp(b_shape, name="b")
    out = run_graph(ops.mul_mat(a, b), {a: av, b: bv})
    r2, r3 = b_shape[1] // a_shape[1], b_shape[0] // a_shape[0]
    aa = np.repeat(np.repeat(av.astype(np.float64), r2, axis=1), r3, axis=0)
    b16 = bv.astype(np.float16).astype(np.float64)  # ggml rounds activations to F16 for F16 weights
    assert nmse(out, b16 @ aa.swapaxes(-1, -2)) < 1e-12


def test_mul_mat_with_transposed_b_view():
    a, av = inp((1, 1, 6, 16), name="a")
    bt, btv = inp((1, 1, 16, 4), name="bt")
    out = run_graph(ops.mul_mat(a, ops.transpose(bt)), {a: av, bt: btv})
    assert nmse(out, btv[0, 0].T.astype(np.float64) @ av[0, 0].T.astype(np.float64)) < 1e-12


def test_shape_errors_name_the_op():
    a, _ = inp((1, 1, 4, 8))
    b, _ = inp((1, 1, 4, 16))
    for build, op in [(lambda: ops.mul_mat(a, b), "MUL_MAT"), (lambda: ops.add(a, b), "ADD"),
                      (lambda: ops.reshape(a, 5, 5), "RESHAPE"), (lambda: ops.concat(a, b, 1), "CONCAT"),
                      (lambda: ops.view(a, (8, 8)), "VIEW")]:
        with pytest.raises(ValueError, match=op):
            build()
    with pytest.raises(ValueError, match="block size"):
        pg.new_tensor(Type.Q4_0, (40, 2))


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_flash_attention_leaves_cells_no_query_sees_out_exactly(n_tokens):
    """Over an F16 cache of 256 cells of which the mask shows the first 125, the op (which
    converts only the cells up to the last one seen, in whole 64s) gives the bits that
    nn.attention gives over the whole cache - whatever the hidden cells hold."""
    from pyggml.cpu import nn
    n_kv, d, heads, kv_heads = 256, 64, 4, 2
    q, qv = inp((1, heads, n_tokens, d), name="q")
    k, kv = inp((1, kv_heads, n_kv, d), Type.F16, name="k")
    v, vv = inp((1, kv_heads, n_kv, d), Type.F16, name="v")
    qv *= 3  # scores of a few units: softmax's exponentials differ in their last bits by method
    kv[:, :, 125:], vv[:, :, 125:] = np.float16(np.inf), np.float16(6e4)  # hidden: must not matter
    visible = np.arange(n_kv)[None, :] <= 125 - n_tokens + np.arange(n_tokens)[:, None]
    mv = np.where(visible, 0, -np.inf).astype(np.float32)[None, None]
    m = pg.new_tensor(Type.F32, (n_kv, n_tokens, 1, 1), "m").set_input()
    out = run_graph(ops.flash_attn_ext(q, k, v, m, d ** -0.5), {q: qv, k: kv, v: vv, m: mv})
    want = np.empty((n_tokens, heads, d), dtype=np.float32)
    nn.attention(np.ascontiguousarray(qv[0]), kv[0].astype(np.float32), vv[0].astype(np.float32),
                 np.ascontiguousarray(mv[0, 0]), np.float32(d ** -0.5), np.float32(0), want)
    assert np.isfinite(want).all()
    assert np.array_equal(out.reshape(want.shape), want)


def attention_reference(q, k, v, mask, scale):
    """Attention in float64 over Q rounded to F16 (as ggml's products take it) and the F16
    cache: softmax(Q K^T * scale + mask) V, per head, with grouped K/V heads."""
    q16 = q.astype(np.float16).astype(np.float64)       # [heads, tokens, d]
    kk, vv = k.astype(np.float64), v.astype(np.float64)  # [kv_heads, cells, d]
    group = q.shape[0] // k.shape[0]
    out = np.empty((q.shape[1], q.shape[0], v.shape[2]))
    for h in range(q.shape[0]):
        s = q16[h] @ kk[h // group].T * scale + mask
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h] = (p / p.sum(axis=-1, keepdims=True)) @ vv[h // group]
    return out


@pytest.mark.parametrize("n_tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 80, 96, 112, 128, 256])
def test_flash_attention_every_head_size(head_dim, n_tokens):
    """Head sizes that are not whole 16s (Phi-3's 80 and 96 are; 8 and 40 are not) go through
    ggml_vec_dot_f16 as ggml's tinyBLAS declines them; a 16-lane walk over them read past the
    ends of q and k."""
    n_kv, heads, kv_heads = 64, 4, 2
    q, qv = inp((1, heads, n_tokens, head_dim), name="q")
    k, kv = inp((1, kv_heads, n_kv, head_dim), Type.F16, name="k")
    v, vv = inp((1, kv_heads, n_kv, head_dim), Type.F16, name="v")
    causal = np.arange(n_kv)[None, :] <= 40 + np.arange(n_tokens)[:, None]
    mv = np.where(causal, 0, -np.inf).astype(np.float32)[None, None]
    m = pg.new_tensor(Type.F32, (n_kv, n_tokens, 1, 1), "m").set_input()
    scale = head_dim ** -0.5
    out = run_graph(ops.flash_attn_ext(q, k, v, m, scale), {q: qv, k: kv, v: vv, m: mv})
    want = attention_reference(qv[0], kv[0], vv[0], mv[0, 0], scale)
    # probabilities rounded to F16 (as ggml does): a few parts in 10^4 of the values
    assert np.abs(out.reshape(want.shape) - want).max() < 2e-3
