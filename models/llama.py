"""llama (SmolLM2, Llama 2/3 ...): pre-norm blocks, RoPE (normal mode), SwiGLU FFN.

qwen2 and qwen3 are this graph with small changes (see their files): q/k/v biases,
which ``GraphBuilder.linear`` picks up from the file by itself, and q/k RMS norms.  A layer
with a router (``ffn_gate_inp``) has a mixture of experts in place of its FFN: Mixtral-style
llama files and qwen3moe.
"""
from __future__ import annotations

from pyggml import Tensor, ops
from pyggml.opdefs import RopeMode

from .architecture import Architecture
from .blocks import GraphBuilder

FFN_ACT = ops.swiglu  # (experts use SwiGLU too)


def build_llama_layers(b: GraphBuilder, qk_norm: bool = False) -> Tensor:
    hp = b.hp
    inp = b.build_inp_embd()
    for il in range(hp.n_layer):
        cur = b.build_norm(inp, b.w("attn_norm.weight", il), "attn_norm", il)
        q, k, v = b.build_qkv(cur, il, qk_norm=qk_norm)
        cur = b.build_attn(q, k, v, il, hp.kq_scale())
        ffn_inp = b.cb(ops.add(cur, inp), "ffn_inp", il)
        cur = b.build_norm(ffn_inp, b.w("ffn_norm.weight", il), "ffn_norm", il)
        if b.w("ffn_gate_inp.weight", il) is not None:  # Mixtral-style experts (qwen3moe's too)
            cur = b.build_moe_ffn(cur, il)
        else:
            cur = b.build_ffn(cur, il, FFN_ACT)
        inp = b.cb(ops.add(cur, ffn_inp), "l_out", il)
    return b.build_output(inp)


def build(b: GraphBuilder) -> Tensor:
    return build_llama_layers(b)


ARCHITECTURE = Architecture("llama", build, RopeMode.NORMAL, FFN_ACT)
