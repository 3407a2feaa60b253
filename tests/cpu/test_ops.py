"""What the CPU backend's ops do beyond their values (those are in tests/test_backend_ops.py, on
every device): GELU's table of halves, NaN and infinities, shape errors, attention's exactness
for every head size and the cells no query sees.

Arrays in these tests are numpy-ordered: shape (ne3, ne2, ne1, ne0).
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


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_comes_from_the_table_of_halves(shape):
    """Every value inside (-10, 10) is read from ggml's table of halves (its values are halves),
    within what two half roundings cost of the function (tests/test_backend_ops.py has the op
    against its reference on every device)."""
    a, av = inp(shape)
    out = run_graph(ops.unary(a, pg.UnaryOp.GELU), {a: av})
    assert nmse(out, UNARY_REF[pg.UnaryOp.GELU](av.astype(np.float64))) < UNARY_NMSE[pg.UnaryOp.GELU]
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


def test_rope_rejects_bad_positions():
    a, _ = inp((1, 5, 3, 64))
    with pytest.raises(ValueError, match="ROPE"):
        ops.rope_ext(a, pg.new_tensor(Type.I32, (4,)), None, 64, 0)


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


def test_gpt_oss_gate_rows_are_ggmls_float32_steps():
    """swiglu_oai as a row kernel of the table (gate and up apart, as gpt-oss's experts give
    them): x = min(a, limit), y = b clamped, x / (1 + expf(alpha * -x)) * (y + 1) - each step in
    float32 and expf correctly rounded, as ggml's code with glibc computes it (the numpy form
    for other layouts: _swiglu_oai)."""
    from pyggml.cpu.ops.elementwise import _swiglu_oai
    av = (rng.standard_normal((3, 96)) * 6).astype(np.float32)
    bv = (rng.standard_normal((3, 96)) * 6).astype(np.float32)
    av[0, :4] = [7.0, 7.5, -30.0, 0.0]
    a, b = (pg.new_tensor(Type.F32, (96, 3), n).set_input() for n in "ab")
    got = run_graph(ops.swiglu_oai(a, b, 1.702, 7.0), {a: av, b: bv})[0, 0]
    want = np.empty_like(av)
    _swiglu_oai(av, bv, want, 1.702, 7.0)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
