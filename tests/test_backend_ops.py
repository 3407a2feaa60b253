"""One table of op cases, run on every device present, against float64 numpy references
(ggml's test-backend-ops): ``-k "ROPE and RPC"`` picks cases by op and device.

Each case builds one op from inputs of its own (types, shapes, non-contiguous views,
parameters).  On a device, the op's first input (a copy's destination) is placed on that device and the
others on the CPU, so the scheduler runs the op there and copies the rest in; the result is compared by
normalized mean squared error with the case's tolerance (ggml's: 1e-7 for float ops, 5e-4
where 8-bit activations or F16 probabilities are part of the op's definition; 0 for exact ops).
Where our CPU backend computes (the CPU devices, and the RPC server, which runs it) some cases
hold it to more: float32 arithmetic in float64's neighbourhood (``host_nmse``), as the op-by-op
tests it replaced did.

Devices: the CPU; a second CPU device (the scheduler's copies between devices); a loopback
``pyggml-rpc-server``; CUDA when CuPy finds a GPU.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.cpu import CPUDevice
from pyggml.opdefs import GluOp, RopeMode, SortOrder, UnaryOp

from tests.rpc.rpc_helpers import LlamaRpcServer, ServerProcess
from tests.test_quants import random_blocks

f64 = np.float64


@dataclass
class Case:
    name: str
    build: Callable  # rng -> (output tensor, [(input tensor, values)])
    reference: Callable  # input values (float64, numpy order) -> expected output
    nmse: float = 1e-7
    on_device: int = 0   # the input placed on the device under test (a copy's is its destination)
    host_nmse: float | None = None  # a tighter bound where our CPU backend computes (CPU, CPU_B, RPC)

    def __str__(self) -> str:
        return self.name


def leaf(type: Type, *ne: int, name: str = "x") -> pg.Tensor:
    return pg.new_tensor(type, ne, name)


def normal(rng, t: pg.Tensor, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(t.ne[::-1]) * scale).astype(np.float32)


# -- references ------------------------------------------------------------------------------------

def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1 + np.exp(-x))


UNARY = {UnaryOp.ABS: np.abs, UnaryOp.NEG: np.negative, UnaryOp.TANH: np.tanh, UnaryOp.RELU: lambda x: np.maximum(x, 0),
         UnaryOp.SIGMOID: lambda x: 1 / (1 + np.exp(-x)), UnaryOp.GELU: gelu, UnaryOp.SILU: silu, UnaryOp.EXP: np.exp,
         UnaryOp.GELU_QUICK: lambda x: x / (1 + np.exp(-1.702 * x)), UnaryOp.SGN: np.sign,
         UnaryOp.STEP: lambda x: (x > 0).astype(f64), UnaryOp.ELU: lambda x: np.where(x > 0, x, np.expm1(x)),
         UnaryOp.HARDSIGMOID: lambda x: np.clip((x + 3) / 6, 0, 1),
         UnaryOp.HARDSWISH: lambda x: x * np.clip((x + 3) / 6, 0, 1),
         UnaryOp.GELU_ERF: lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))}
GLU = {GluOp.REGLU: lambda x: np.maximum(x, 0), GluOp.GEGLU: gelu, GluOp.SWIGLU: silu}
# GELU comes from ggml's table of halves: two F16 roundings away from the function
UNARY_NMSE = {UnaryOp.GELU: 1e-6}


def rope_ref(x, pos, n_dims, neox, base=10000.0):
    """x [1, n_tokens, n_head, head_dim] (numpy order of ne [head_dim, n_head, n_tokens])."""
    x, pos = x[0], pos.reshape(-1)
    out = x.copy()
    half = n_dims // 2
    theta = pos[:, None] * base ** (-2 * np.arange(half) / n_dims)  # [tokens, half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0], out[..., i1] = x0 * c - x1 * s, x0 * s + x1 * c
    return out[None]


def attention_ref(q, k, v, mask, scale, softcap=0.0, sinks=None):
    """q [1, heads, tokens, d], k/v [1, kv_heads, cells, d] -> [1, tokens, heads, dv]; ``sinks``:
    a logit per head in each softmax, whose probability is dropped."""
    q16 = q[0].astype(np.float16).astype(f64)
    group = q.shape[1] // k.shape[1]
    out = np.empty((q.shape[2], q.shape[1], v.shape[3]))
    for h in range(q.shape[1]):
        s = q16[h] @ k[0, h // group].T * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = s + mask
        top = s.max(-1, keepdims=True) if sinks is None else np.maximum(s.max(-1, keepdims=True), sinks[h])
        p = np.exp(s - top)
        total = p.sum(-1, keepdims=True) + (0.0 if sinks is None else np.exp(sinks[h] - top))
        out[:, h] = (p / total) @ v[0, h // group]
    return out[None]


def quantized(type: Type):
    """A weight builder: normal values quantized to ``type`` (random blocks for a type we cannot
    quantize to), and their float values."""
    def make(rng, k: int, m: int):
        w = leaf(type, k, m, name=f"w_{type.name}")
        try:
            raw = pg.quants.quantize(rng.standard_normal((m, k)).astype(np.float32), type)
        except NotImplementedError:
            raw = random_blocks(type, n_rows=m, blocks_per_row=k // type.block_size, seed=int(rng.integers(1 << 30)))
        return w, raw, pg.quants.dequantize(np.asarray(raw).view(np.uint8).reshape(m, -1), type).astype(f64)
    return make


# -- the table -------------------------------------------------------------------------------------

def _binary_cases():
    fns = {"ADD": (ops.add, np.add), "SUB": (ops.sub, np.subtract), "MUL": (ops.mul, np.multiply),
           "DIV": (ops.div, np.divide)}
    for name, (op, ref) in fns.items():
        for a_ne, b_ne in (((32, 4, 3), (32, 1, 3)), ((16, 6), (16, 6)), ((8, 4, 2, 2), (8, 1, 1, 1))):
            def build(rng, op=op, a_ne=a_ne, b_ne=b_ne):
                a, b = leaf(Type.F32, *a_ne), leaf(Type.F32, *b_ne, name="b")
                bv = normal(rng, b) + (4 if op is ops.div else 0)
                return op(a, b), [(a, normal(rng, a)), (b, bv)]
            yield Case(f"{name}-{a_ne}-{b_ne}", build, lambda a, b, ref=ref: ref(a, b), host_nmse=1e-12)
        for a_ne in ((32, 3), (64, 4, 3, 2), (10, 5, 2)):  # b: the same, one row, one row per matrix
            for b_ne in (a_ne, (a_ne[0],), (a_ne[0], 1, *a_ne[2:3])):
                def build(rng, op=op, a_ne=a_ne, b_ne=b_ne):
                    a, b = leaf(Type.F32, *a_ne), leaf(Type.F32, *b_ne, name="b")
                    bv = np.abs(normal(rng, b)) + 0.5 if op is ops.div else normal(rng, b)
                    return op(a, b), [(a, normal(rng, a)), (b, bv)]
                yield Case(f"{name}-{a_ne}-by-{b_ne}", build, lambda a, b, ref=ref: ref(a, b), host_nmse=1e-12)

    def tiled(rng):  # ggml_can_repeat: b repeats whole over a, as numpy's tile
        a, b = leaf(Type.F32, 6, 4), leaf(Type.F32, 3, 2, name="b")
        return ops.add(a, b), [(a, normal(rng, a)), (b, normal(rng, b))]
    yield Case("ADD-tiled-like-ggml-repeat", tiled, lambda a, b: a + np.tile(b, (2, 2)), host_nmse=1e-12)

    def permuted(rng):
        a, b = leaf(Type.F32, 8, 6, 4), leaf(Type.F32, 6, 8, 4, name="b")
        return ops.add(a, ops.permute(b, 1, 0, 2, 3)), [(a, normal(rng, a)), (b, normal(rng, b))]
    yield Case("ADD-permuted-view", permuted, lambda a, b: a + b.swapaxes(-1, -2), host_nmse=1e-12)

    def mul_permuted(rng):
        a, b = leaf(Type.F32, 8, 4, 3, 2), leaf(Type.F32, 8, name="b")
        return ops.mul(ops.permute(a, 0, 2, 1, 3), b), [(a, normal(rng, a)), (b, normal(rng, b))]
    yield Case("MUL-of-a-permuted-view", mul_permuted, lambda a, b: a.transpose(0, 2, 1, 3) * b, host_nmse=1e-12,
               on_device=1)  # b decides where the product runs (a view's place is its source's)


def _cases():
    yield from _binary_cases()

    def scale(rng):
        a = leaf(Type.F32, 32, 5)
        return ops.scale(a, 0.75, -1.5), [(a, normal(rng, a))]
    yield Case("SCALE", scale, lambda a: a * 0.75 - 1.5, host_nmse=1e-12)

    for u, ref in UNARY.items():
        for ne in ((48, 3), (10, 5, 2), (64, 4, 3, 2)):
            def build(rng, u=u, ne=ne):
                a = leaf(Type.F32, *ne)
                return ops.unary(a, u), [(a, normal(rng, a, 3))]
            yield Case(f"UNARY-{u.name}-{ne}", build, ref, UNARY_NMSE.get(u, 1e-7), host_nmse=UNARY_NMSE.get(u, 1e-10))

    for g, act in GLU.items():
        for fused in (False, True):
            for swapped in (False, True):
                def build(rng, g=g, fused=fused, swapped=swapped):
                    if fused:
                        a = leaf(Type.F32, 64, 3)
                        return ops.glu(a, None, g, swapped), [(a, normal(rng, a))]
                    a, b = leaf(Type.F32, 32, 3), leaf(Type.F32, 32, 3, name="b")
                    return ops.glu(a, b, g, swapped), [(a, normal(rng, a)), (b, normal(rng, b))]

                def ref(a, b=None, act=act, swapped=swapped):
                    if b is None:
                        a, b = a[..., :a.shape[-1] // 2], a[..., a.shape[-1] // 2:]
                    if swapped:
                        a, b = b, a
                    return act(a) * b
                yield Case(f"GLU-{g.name}-{'fused' if fused else 'split'}{'-swapped' if swapped else ''}", build, ref,
                           1e-6 if g == GluOp.GEGLU else 1e-7, host_nmse=1e-6 if g == GluOp.GEGLU else 1e-10)

    def rms(a, eps=1e-5):
        return a / np.sqrt((a ** 2).mean(-1, keepdims=True) + eps)

    def norm(a, eps=1e-5):
        return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + eps)

    for name, op, ref in (("RMS_NORM", ops.rms_norm, rms), ("NORM", ops.norm, norm)):
        for ne in ((64, 5, 2), (32, 3), (10, 5, 2)):
            def build(rng, op=op, ne=ne):
                a = leaf(Type.F32, *ne)
                return op(a, 1e-5), [(a, normal(rng, a, 2) + 1)]
            yield Case(f"{name}-{ne}", build, ref, host_nmse=1e-12)

    def rms_permuted(rng):
        a = leaf(Type.F32, 16, 4, 3)
        return ops.rms_norm(ops.permute(a, 0, 2, 1, 3), 1e-6), [(a, normal(rng, a))]
    yield Case("RMS_NORM-of-a-permuted-view", rms_permuted, lambda a: rms(a.transpose(0, 2, 1, 3), 1e-6),
               host_nmse=1e-12)

    for mask_type in (None, Type.F32, Type.F16):
        def build(rng, mask_type=mask_type):
            a = leaf(Type.F32, 32, 4, 3)
            inputs = [(a, normal(rng, a, 2))]
            mask = None
            if mask_type is not None:
                mask = leaf(mask_type, 32, 4, name="mask")
                mv = np.where(np.arange(32)[None, :] <= 20 + np.arange(4)[:, None], 0, -np.inf)
                inputs.append((mask, mv.astype(mask_type.np_dtype)))
            return ops.soft_max_ext(a, mask, 0.5), inputs

        def ref(a, mask=None):
            s = a * 0.5 + (mask if mask is not None else 0)
            e = np.exp(s - s.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)
        yield Case(f"SOFT_MAX-mask-{mask_type.name if mask_type else 'none'}", build, ref, host_nmse=1e-10)

        def padded(rng, mask_type=mask_type):  # an odd row length; the mask has more rows than a, as llama.cpp pads them
            a = leaf(Type.F32, 33, 5, 2, 2)
            inputs = [(a, normal(rng, a))]
            mask = None
            if mask_type is not None:
                mask = leaf(mask_type, 33, 7, name="mask")
                mv = np.where(rng.random((7, 33)) < 0.3, -np.inf, 0)
                mv[:, 0] = 0  # a visible column in every row
                inputs.append((mask, mv.astype(mask_type.np_dtype)))
            return ops.soft_max_ext(a, mask, 0.7), inputs

        def padded_ref(a, mask=None):
            s = a * 0.7 + (mask.reshape(7, 33)[:5] if mask is not None else 0)
            e = np.exp(s - s.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)
        yield Case(f"SOFT_MAX-odd-rows-padded-mask-{mask_type.name if mask_type else 'none'}", padded, padded_ref,
                   host_nmse=1e-10)

    def sinks_build(rng):  # gpt-oss's attention sinks: one more logit per head in the softmax
        a, sinks = leaf(Type.F32, 32, 5, 4), leaf(Type.F32, 4, name="sinks")
        mask = leaf(Type.F32, 32, 5, name="mask")
        mv = np.where(np.arange(32)[None, :] <= 20 + np.arange(5)[:, None], 0, -np.inf).astype(np.float32)
        sv = np.array([-1.0, 0.5, 3.0, -np.inf], dtype=np.float32)  # (a head without a sink too)
        return ops.soft_max_ext(a, mask, 0.5, sinks=sinks), [(a, normal(rng, a, 2)), (mask, mv), (sinks, sv)]

    def sinks_ref(a, mask, sinks):
        s = a * 0.5 + mask
        sk = sinks.reshape(1, 4, 1, 1)
        m = np.maximum(s.max(-1, keepdims=True), sk)
        e = np.exp(s - m)
        return e / (e.sum(-1, keepdims=True) + np.exp(sk - m))
    yield Case("SOFT_MAX-sinks", sinks_build, sinks_ref, host_nmse=1e-10)

    def swiglu_oai_build(rng):
        a, b = leaf(Type.F32, 32, 3), leaf(Type.F32, 32, 3, name="b")
        return ops.swiglu_oai(a, b, 1.702, 7.0), [(a, normal(rng, a, 6)), (b, normal(rng, b, 6))]

    def swiglu_oai_ref(a, b):
        x, y = np.minimum(a, 7.0), np.clip(b, -7.0, 7.0)
        return x / (1 + np.exp(-1.702 * x)) * (y + 1)
    yield Case("GLU-SWIGLU_OAI-split", swiglu_oai_build, swiglu_oai_ref, host_nmse=1e-12)

    def add_id_build(rng):  # gpt-oss's expert biases: a bias per chosen expert
        a, b, ids = leaf(Type.F32, 16, 2, 3), leaf(Type.F32, 16, 5, name="b"), leaf(Type.I32, 2, 3, name="ids")
        iv = np.array([[4, 0], [1, 1], [3, 2]], dtype=np.int32)
        return ops.add_id(a, b, ids), [(a, normal(rng, a)), (b, normal(rng, b)), (ids, iv)]

    def add_id_ref(a, b, ids):  # one float32 addition each: exact
        f = np.float32
        return a.astype(f) + b.astype(f).reshape(5, 16)[ids.reshape(3, 2).astype(int)].reshape(a.shape)
    yield Case("ADD_ID", add_id_build, add_id_ref, 0.0)

    for mode in (RopeMode.NORMAL, RopeMode.NEOX):
        for n_dims in (32, 16):
            def build(rng, mode=mode, n_dims=n_dims):
                x, pos = leaf(Type.F32, 32, 4, 5), leaf(Type.I32, 5, name="pos")
                return (ops.rope_ext(x, pos, None, n_dims, mode),
                        [(x, normal(rng, x)), (pos, np.array([0, 3, 7, 100, 4095], np.int32))])
            yield Case(f"ROPE-{mode.name}-dims{n_dims}", build,
                       lambda x, pos, n_dims=n_dims, mode=mode: rope_ref(x, pos, n_dims, mode == RopeMode.NEOX), 1e-6)
        for n_dims in (64, 32):
            def scaled(rng, mode=mode, n_dims=n_dims):
                x, pos = leaf(Type.F32, 64, 3, 5), leaf(Type.I32, 5, name="pos")
                return (ops.rope_ext(x, pos, None, n_dims, mode, freq_base=10000.0, freq_scale=0.5),
                        [(x, normal(rng, x)), (pos, np.array([0, 1, 7, 100, 2047], np.int32))])
            yield Case(f"ROPE-{mode.name}-dims{n_dims}-freq-scale", scaled,
                       lambda x, pos, n_dims=n_dims, mode=mode: rope_ref(x, pos * 0.5, n_dims, mode == RopeMode.NEOX),
                       1e-6, host_nmse=1e-10)

    for wtype in (Type.F32, Type.F16, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q4_K, Type.Q5_K,
                  Type.Q6_K, Type.MXFP4):
        for n in (1, 5, 12, 40):  # 40: past what CUDA's matrix-vector kernel takes (its prompt path)
            def build(rng, wtype=wtype, n=n):
                k = 256
                if wtype.is_quantized:
                    w, raw, _ = quantized(wtype)(rng, k, 24)
                else:
                    w, raw = leaf(wtype, k, 24, name="w"), normal(rng, leaf(Type.F32, k, 24)).astype(wtype.np_dtype)
                x = leaf(Type.F32, k, n)
                return ops.mul_mat(w, x), [(w, raw), (x, normal(rng, x))]

            def ref(w, x, wtype=wtype):
                if wtype.is_quantized:
                    w = pg.quants.dequantize(np.asarray(w, np.uint8).reshape(24, -1), wtype).astype(f64)
                else:
                    w = w.reshape(24, 256)
                return (x.reshape(-1, 256) @ w.T).reshape(1, 1, -1, 24)
            yield Case(f"MUL_MAT-{wtype.name}-n{n}", build, ref, 1e-7 if wtype == Type.F32 else 5e-4)

    for wtype in (Type.F32, Type.Q4_K, Type.Q6_K):  # runs of columns (a batch of sequences: ops.mul_mat)
        def build(rng, wtype=wtype):
            k = 256
            if wtype.is_quantized:
                w, raw, _ = quantized(wtype)(rng, k, 24)
            else:
                w, raw = leaf(wtype, k, 24, name="w"), normal(rng, leaf(Type.F32, k, 24))
            x, runs = leaf(Type.F32, k, 40), leaf(Type.I32, 4, name="runs")
            return ops.mul_mat(w, x, runs), [(w, raw), (x, normal(rng, x)), (runs, np.array([0, 3, 20, 40], np.int32))]

        def ref(w, x, runs, wtype=wtype):
            if wtype.is_quantized:
                w = pg.quants.dequantize(np.asarray(w, np.uint8).reshape(24, -1), wtype).astype(f64)
            return (x.reshape(-1, 256) @ w.reshape(24, 256).T).reshape(1, 1, -1, 24)
        yield Case(f"MUL_MAT-{wtype.name}-runs", build, ref, 1e-7 if wtype == Type.F32 else 5e-4)

    for wtype, n_b in ((Type.F32, 2), (Type.Q4_0, 1), (Type.Q8_0, 2), (Type.Q4_K, 2), (Type.MXFP4, 2)):
        def build(rng, wtype=wtype, n_b=n_b):
            k, m, n_expert, n_used, n_tok = 256, 16, 6, 2, 5
            if wtype.is_quantized:
                _, raw, _ = quantized(wtype)(rng, k, m * n_expert)
                w = leaf(wtype, k, m, n_expert, name="experts")
            else:
                w = leaf(wtype, k, m, n_expert, name="experts")
                raw = normal(rng, w)
            x, ids = leaf(Type.F32, k, n_b, n_tok), leaf(Type.I32, n_used, n_tok, name="ids")
            chosen = np.stack([rng.choice(n_expert - 1, n_used, replace=False) for _ in range(n_tok)])  # expert 5 idle
            return ops.mul_mat_id(w, x, ids), [(w, raw), (x, normal(rng, x)), (ids, chosen.astype(np.int32))]

        def ref(w, x, ids, wtype=wtype):
            k, m, n_expert = 256, 16, 6
            if wtype.is_quantized:
                w = pg.quants.dequantize(np.asarray(w, np.uint8).reshape(m * n_expert, -1), wtype).astype(f64)
            w = w.reshape(n_expert, m, k)
            x, ids = x.reshape(x.shape[-3], x.shape[-2], k), ids.reshape(ids.shape[-2], ids.shape[-1]).astype(int)
            out = np.empty((1, ids.shape[0], ids.shape[1], m))
            for t in range(ids.shape[0]):
                for e in range(ids.shape[1]):
                    out[0, t, e] = w[ids[t, e]] @ x[t, e % x.shape[1]]
            return out
        yield Case(f"MUL_MAT_ID-{wtype.name}-b{n_b}", build, ref, 1e-7 if wtype == Type.F32 else 5e-4)

    def moe_runs(rng):  # 40 tokens in runs (past CUDA's one-launch pairs: grouped by expert and run)
        k, m, n_expert, n_used, n_tok = 256, 16, 6, 2, 40
        _, raw, _ = quantized(Type.Q4_K)(rng, k, m * n_expert)
        w = leaf(Type.Q4_K, k, m, n_expert, name="experts")
        x, ids, runs = leaf(Type.F32, k, 1, n_tok), leaf(Type.I32, n_used, n_tok, name="ids"), leaf(Type.I32, 3, name="runs")
        chosen = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
        return ops.mul_mat_id(w, x, ids, runs), [(w, raw), (x, normal(rng, x)), (ids, chosen),
                                                 (runs, np.array([0, 17, 40], np.int32))]

    def moe_runs_ref(w, x, ids, runs):
        w = pg.quants.dequantize(np.asarray(w, np.uint8).reshape(96, -1), Type.Q4_K).astype(f64).reshape(6, 16, 256)
        ids = ids.reshape(40, 2).astype(int)
        x = x.reshape(40, 256)
        return np.stack([[w[ids[t, e]] @ x[t] for e in range(2)] for t in range(40)])[None]
    yield Case("MUL_MAT_ID-Q4_K-runs", moe_runs, moe_runs_ref, 5e-4)

    def batched(rng):
        a, b = leaf(Type.F32, 32, 6, 2), leaf(Type.F32, 32, 3, 4, name="b")
        return ops.mul_mat(a, b), [(a, normal(rng, a)), (b, normal(rng, b))]
    yield Case("MUL_MAT-broadcast", batched, lambda a, b: b @ np.repeat(a, 2, axis=1).swapaxes(-1, -2))

    def transposed_b(rng):
        a, b = leaf(Type.F32, 16, 8), leaf(Type.F32, 5, 16, name="b")
        return ops.mul_mat(a, ops.cont(ops.transpose(b))), [(a, normal(rng, a)), (b, normal(rng, b))]
    yield Case("MUL_MAT-transposed-b", transposed_b, lambda a, b: b.swapaxes(-1, -2) @ a.swapaxes(-1, -2))

    def transposed_b_view(rng):  # the product reads the view as it is
        a, b = leaf(Type.F32, 16, 6), leaf(Type.F32, 4, 16, name="b")
        return ops.mul_mat(a, ops.transpose(b)), [(a, normal(rng, a)), (b, normal(rng, b))]
    yield Case("MUL_MAT-of-a-transposed-view", transposed_b_view, lambda a, b: b.swapaxes(-1, -2) @ a.swapaxes(-1, -2),
               host_nmse=1e-12)

    for a_ne, b_ne in (((32, 8), (32, 5)), ((16, 6, 2), (16, 3, 4)), ((8, 4, 1, 2), (8, 7, 3, 2))):
        def f16_broadcast(rng, a_ne=a_ne, b_ne=b_ne):
            a, b = leaf(Type.F16, *a_ne, name="a"), leaf(Type.F32, *b_ne, name="b")
            return ops.mul_mat(a, b), [(a, normal(rng, leaf(Type.F32, *a_ne)).astype(np.float16)), (b, normal(rng, b))]

        def f16_ref(a, b):
            a = a.reshape((1,) * (4 - a.ndim) + a.shape)
            b = b.reshape((1,) * (4 - b.ndim) + b.shape)
            a = np.repeat(np.repeat(a, b.shape[1] // a.shape[1], axis=1), b.shape[0] // a.shape[0], axis=0)
            return b.astype(np.float16).astype(f64) @ a.swapaxes(-1, -2)  # ggml rounds activations for F16 weights
        yield Case(f"MUL_MAT-F16-broadcast-{a_ne}-{b_ne}", f16_broadcast, f16_ref, host_nmse=1e-12)

    for ttype in (Type.F32, Type.F16, Type.Q4_0, Type.Q8_0, Type.Q4_K, Type.Q6_K):
        def build(rng, ttype=ttype, k=256 if ttype.block_size == 256 else 64):
            if ttype.is_quantized:
                t, raw, _ = quantized(ttype)(rng, k, 10)
            else:
                t, raw = leaf(ttype, k, 10, name="table"), normal(rng, leaf(Type.F32, k, 10)).astype(ttype.np_dtype)
            idx = leaf(Type.I32, 4, name="idx")
            return ops.get_rows(t, idx), [(t, raw), (idx, np.array([9, 0, 3, 3], np.int32))]

        def ref(t, idx, ttype=ttype):
            if ttype.is_quantized:
                t = pg.quants.dequantize(np.asarray(t, np.uint8).reshape(10, -1), ttype).astype(f64)
            return t.reshape(10, -1)[idx.reshape(-1).astype(int)]
        yield Case(f"GET_ROWS-{ttype.name}", build, ref, 0.0 if ttype == Type.F32 else 1e-7)

    for ttype in (Type.F32, Type.F16, Type.Q8_0):
        def per_matrix(rng, ttype=ttype):  # ids [4, 3]: four rows from each of three matrices
            values = normal(rng, leaf(Type.F32, 64, 5, 3))
            t = leaf(ttype, 64, 5, 3, name="table")
            raw = pg.quants.quantize(values.reshape(15, 64), ttype) if ttype.is_quantized else values.astype(ttype.np_dtype)
            idx = leaf(Type.I32, 4, 3, name="idx")
            return ops.get_rows(t, idx), [(t, raw), (idx, rng.integers(0, 5, (3, 4)).astype(np.int32))]

        def per_matrix_ref(t, idx, ttype=ttype):
            if ttype.is_quantized:
                t = pg.quants.dequantize(np.asarray(t, np.uint8).reshape(15, -1), ttype).astype(f64)
            t, idx = t.reshape(3, 5, 64), idx.reshape(3, 4).astype(int)
            return np.stack([t[i2][idx[i2]] for i2 in range(3)])[None]
        yield Case(f"GET_ROWS-{ttype.name}-per-matrix", per_matrix, per_matrix_ref, 1e-7, host_nmse=1e-14)

    for dtype in (Type.F32, Type.F16):
        def build(rng, dtype=dtype):
            dst, src, idx = leaf(dtype, 16, 8, name="dst"), leaf(Type.F32, 16, 3), leaf(Type.I32, 3, name="idx")
            base = np.zeros(dst.ne[::-1], dtype.np_dtype)
            return (ops.set_rows(dst, src, idx),
                    [(dst, base), (src, normal(rng, src)), (idx, np.array([6, 1, 2], np.int32))])

        def ref(dst, src, idx, dtype=dtype):
            out = dst.copy()
            out[0, 0, idx.reshape(-1).astype(int)] = src[0, 0].astype(dtype.np_dtype).astype(f64)
            return out
        yield Case(f"SET_ROWS-{dtype.name}", build, ref, 0.0)

        def i64_ids(rng, dtype=dtype):  # I64 row ids, into a destination that holds values already
            dst, src, idx = leaf(dtype, 16, 10, name="dst"), leaf(Type.F32, 16, 3), leaf(Type.I64, 3, name="idx")
            return (ops.set_rows(dst, src, idx), [(dst, normal(rng, dst).astype(dtype.np_dtype)),
                                                  (src, normal(rng, src)), (idx, np.array([7, 2, 9], np.int64))])
        yield Case(f"SET_ROWS-{dtype.name}-I64-ids", i64_ids, ref, 0.0)

    for src_t, dst_t in ((Type.F32, Type.F16), (Type.F16, Type.F32), (Type.F32, Type.F32)):
        def build(rng, src_t=src_t, dst_t=dst_t):
            a, b = leaf(src_t, 24, 5), leaf(dst_t, 24, 5, name="dst")
            return ops.cpy(a, b), [(a, normal(rng, leaf(Type.F32, 24, 5)).astype(src_t.np_dtype)),
                                   (b, np.zeros((5, 24), dst_t.np_dtype))]
        yield Case(f"CPY-{src_t.name}-{dst_t.name}", build,
                   lambda a, b, dst_t=dst_t: a.astype(dst_t.np_dtype).astype(f64), 0.0, on_device=1)

    for dst_t in (Type.F32, Type.F16, Type.Q8_0):
        def relayout(rng, dst_t=dst_t):  # a permuted view copied (and converted) into a dense tensor
            a, b = leaf(Type.F32, 32, 3, 2), leaf(dst_t, 32, 2, 3, name="dst")
            return ops.cpy(ops.permute(a, 0, 2, 1, 3), b), [
                (a, normal(rng, a)), (b, np.zeros(b.nbytes(), np.uint8) if dst_t.is_quantized else
                                      np.zeros(b.ne[::-1], dst_t.np_dtype))]

        def relayout_ref(a, b, dst_t=dst_t):
            seen = np.ascontiguousarray(a.transpose(0, 2, 1, 3)).astype(np.float32)
            if dst_t.is_quantized:
                return pg.quants.dequantize(pg.quants.quantize(seen.reshape(-1, 32), dst_t), dst_t).astype(f64)
            return seen.astype(dst_t.np_dtype).astype(f64)
        yield Case(f"CPY-permuted-view-into-{dst_t.name}", relayout, relayout_ref, 0.0, on_device=1)

    def cont(rng):
        a = leaf(Type.F32, 8, 6, 3)
        return ops.cont(ops.permute(a, 2, 0, 1, 3)), [(a, normal(rng, a))]
    yield Case("CONT-permuted", cont, lambda a: a.transpose(0, 3, 1, 2), 0.0)

    def cont_transposed(rng):
        a = leaf(Type.F32, 4, 3, 2)
        return ops.cont(ops.transpose(a)), [(a, normal(rng, a))]
    yield Case("CONT-transposed", cont_transposed, lambda a: a.swapaxes(-1, -2), 0.0)

    def cont_reshaped(rng):
        a = leaf(Type.F32, 4, 3, 2)
        return ops.cont(ops.reshape(a, 12, 2)), [(a, normal(rng, a))]
    yield Case("CONT-reshaped", cont_reshaped, lambda a: a.reshape(2, 12), 0.0)

    def cont_strided(rng):  # columns 2..3 of every row of the first matrix
        a = leaf(Type.F32, 4, 3, 2)
        return ops.cont(ops.view(a, (2, 3), (a.nb[1],), offset=2 * 4)), [(a, normal(rng, a))]
    yield Case("CONT-strided-view", cont_strided, lambda a: a.reshape(2, 3, 4)[0, :, 2:4], 0.0)

    for dim in (0, 1, 2):
        def build(rng, dim=dim):
            ne_b = [8, 4, 2]
            ne_b[dim] = 3
            a, b = leaf(Type.F32, 8, 4, 2), leaf(Type.F32, *ne_b, name="b")
            return ops.concat(a, b, dim), [(a, normal(rng, a)), (b, normal(rng, b))]
        yield Case(f"CONCAT-dim{dim}", build, lambda a, b, dim=dim: np.concatenate([a, b], axis=a.ndim - 1 - dim), 0.0)

    def argmax(rng):
        a = leaf(Type.F32, 100, 6)
        return ops.argmax(a), [(a, normal(rng, a))]
    yield Case("ARGMAX", argmax, lambda a: a.argmax(-1).astype(f64), 0.0)

    def sum_rows(rng):
        a = leaf(Type.F32, 37, 4, 3)
        return ops.sum_rows(a), [(a, normal(rng, a))]
    yield Case("SUM_ROWS", sum_rows, lambda a: a.sum(-1, keepdims=True))

    def clamp(rng):
        a = leaf(Type.F32, 40, 5)
        return ops.clamp(a, -0.5, 0.75), [(a, normal(rng, a))]
    yield Case("CLAMP", clamp, lambda a: np.clip(a, -0.5, 0.75), 0.0)

    def with_ties(rng, t):
        return np.round(normal(rng, t) * 2) / 2  # few distinct values: the order of equal ones counts

    for order in SortOrder:
        def build(rng, order=order):
            a = leaf(Type.F32, 50, 3, 2)
            return ops.argsort(a, order), [(a, with_ties(rng, a))]
        yield Case(f"ARGSORT-{order.name}", build,
                   lambda a, order=order: np.argsort(-a if order == SortOrder.DESC else a, axis=-1,
                                                     kind="stable").astype(f64), 0.0)

    for k, ne0 in ((1, 64), (40, 200), (7, 7)):
        def build(rng, k=k, ne0=ne0):
            a = leaf(Type.F32, ne0 + 3, 4)
            rows = ops.view(a, (ne0, 4), (a.nb[1],), 3 * 4)  # rows that start inside a wider tensor
            return ops.top_k(rows, k), [(a, with_ties(rng, a))]

        def ref(a, k=k, ne0=ne0):
            rows = a[..., 3:3 + ne0]
            idx = np.arange(ne0)
            return np.stack([np.lexsort((idx, -r))[:k] for r in rows.reshape(-1, ne0)]).reshape(
                rows.shape[:-1] + (k,)).astype(f64)
        yield Case(f"TOP_K-k{k}-of{ne0}", build, ref, 0.0)

    for d, softcap, with_mask, n_tok in ((64, 0.0, True, 1), (64, 0.0, True, 4), (40, 0.0, True, 3),
                                         (128, 30.0, False, 2)):
        def build(rng, d=d, softcap=softcap, with_mask=with_mask, n_tok=n_tok):
            q, k, v = leaf(Type.F32, d, n_tok, 4, name="q"), leaf(Type.F16, d, 64, 2, name="k"), \
                leaf(Type.F16, d, 64, 2, name="v")
            inputs = [(q, normal(rng, q)), (k, normal(rng, k).astype(np.float16)), (v, normal(rng, v).astype(np.float16))]
            mask = None
            if with_mask:
                mask = leaf(Type.F16, 64, n_tok, name="mask")
                mv = np.where(np.arange(64)[None, :] <= 40 + np.arange(n_tok)[:, None], 0, -np.inf)
                inputs.append((mask, mv.astype(np.float16)))
            return ops.flash_attn_ext(q, k, v, mask, d ** -0.5, logit_softcap=softcap), inputs

        def ref(q, k, v, mask=None, d=d, softcap=softcap):
            m = mask.reshape(mask.shape[-2:]) if mask is not None else 0.0
            return attention_ref(q, k, v, m, d ** -0.5, softcap)
        yield Case(f"FLASH_ATTN_EXT-d{d}-t{n_tok}{'-softcap' if softcap else ''}{'' if with_mask else '-nomask'}",
                   build, ref, 5e-4)


    for n_tok in (1, 3):  # gpt-oss's attention sinks (-inf: a head without one)
        def sinks_build(rng, n_tok=n_tok):
            d = 64
            q, k, v = leaf(Type.F32, d, n_tok, 4, name="q"), leaf(Type.F16, d, 64, 2, name="k"), \
                leaf(Type.F16, d, 64, 2, name="v")
            mask, sinks = leaf(Type.F16, 64, n_tok, name="mask"), leaf(Type.F32, 4, name="sinks")
            mv = np.where(np.arange(64)[None, :] <= 40 + np.arange(n_tok)[:, None], 0, -np.inf)
            inputs = [(q, normal(rng, q)), (k, normal(rng, k).astype(np.float16)), (v, normal(rng, v).astype(np.float16)),
                      (mask, mv.astype(np.float16)), (sinks, np.array([0.5, -2.0, 4.0, -np.inf], np.float32))]
            return ops.flash_attn_ext(q, k, v, mask, d ** -0.5, sinks=sinks), inputs

        def sinks_ref(q, k, v, mask, sinks):
            return attention_ref(q, k, v, mask.reshape(mask.shape[-2:]), 64 ** -0.5, sinks=sinks.reshape(-1))
        yield Case(f"FLASH_ATTN_EXT-sinks-t{n_tok}", sinks_build, sinks_ref, 5e-4)


CASES = list(_cases())


# -- devices ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rpc_server():
    server = ServerProcess("--mem", "256")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ggml_server():
    """pyggml-rpc-server speaking llama.cpp's protocol (--protocol ggml)."""
    server = ServerProcess("--mem", "256", "--protocol", "ggml")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llama_rpc_server():
    """llama.cpp's own ggml-rpc-server (skips where it is not built)."""
    server = LlamaRpcServer()
    yield server
    server.stop()


def _cuda_device():
    try:
        return next(d for d in pg.devices() if d.get_type() == pg.DeviceType.GPU)
    except StopIteration:
        return None


DEVICES = ["CPU", "CPU_B", "RPC", "GGML", "LLAMA_RPC", "CUDA"]
_open: dict = {}


@pytest.fixture(params=DEVICES)
def device(request):
    """(its name, the device the op's first input lives on, backends for the scheduler)."""
    return request.param, *_device(request)


HOSTS = {"CPU", "CPU_B", "RPC", "GGML"}  # where our CPU backend computes (the RPC servers run it)


def _device(request):
    cpu = pg.cpu_device()
    name = request.param
    if name == "CPU":
        return cpu, [cpu.init_backend()]
    if name == "CPU_B":
        dev = _open.setdefault("CPU_B", CPUDevice("CPU_B"))
        return dev, [dev.init_backend(), cpu.init_backend()]
    if name in ("RPC", "GGML", "LLAMA_RPC"):  # ours; ours over ggml-rpc; llama.cpp's over ggml-rpc
        from pyggml.rpc import connect
        server = request.getfixturevalue({"RPC": "rpc_server", "GGML": "ggml_server",
                                          "LLAMA_RPC": "llama_rpc_server"}[name])
        endpoint = server.endpoint if name == "RPC" else "ggml://" + server.endpoint.removeprefix("ggml://")
        if name not in _open or _open[name][0] is not server or _open[name][1].conn.closed_reason:
            # (a llama.cpp server closes the connection of a request it refuses: a new one)
            _open[name] = (server, connect(endpoint)[0])
        dev = _open[name][1]
        return dev, [dev.init_backend(), cpu.init_backend()]
    dev = _cuda_device()
    if dev is None:
        pytest.skip("no CUDA device here (CuPy or a GPU missing); tests/cuda/test_cuda.py runs on the emulator")
    return dev, [dev.init_backend(), cpu.init_backend()]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case: Case, device):
    name, dev, backends = device
    # the case's own inputs in every run: str hashes change from process to process
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    out, inputs = case.build(rng)
    first = inputs[case.on_device][0]
    rest = [t for t, _ in inputs if t is not first]
    buffers = [pg.alloc_tensors([first], dev.get_buffer_type())]
    if rest:
        buffers.append(pg.alloc_tensors(rest, pg.cpu_device().get_buffer_type()))
    for t, v in inputs:
        pg.tensor_set(t, np.ascontiguousarray(v))
    graph = pg.build_forward(out)
    sched = pg.Scheduler(backends)
    sched.alloc_graph(graph)
    # where the device lacks the op (CUDA's unary ops, say) the scheduler runs it on the CPU, and
    # the result must still be right
    runs_on = backends[0] if backends[0].get_device().supports_op(out) else backends[-1]
    assert sched.get_tensor_backend(out) is runs_on, f"the op ran on {sched.get_tensor_backend(out)}"
    sched.graph_compute(graph)
    got = pg.tensor_array(out).astype(f64)
    values = [np.asarray(v, dtype=f64) if np.asarray(v).dtype != np.uint8 else v for _, v in inputs]
    want = np.asarray(case.reference(*values), dtype=f64).reshape(got.shape)
    for b in buffers:
        b.free()
    if case.nmse == 0.0:
        assert np.array_equal(got, want, equal_nan=True), f"{case.name}: not exact"
        return
    limit = case.host_nmse if case.host_nmse is not None and name in HOSTS else case.nmse
    err = float(((got - want) ** 2).sum() / max((want ** 2).sum(), 1e-30))
    assert err < limit, f"{case.name}: nmse {err:.3g} > {limit:g}"
