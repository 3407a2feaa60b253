"""gemma3 (Gemma 3): scaled embedding, q/k RMS norms, norms after attention and FFN as well
as before, GELU-gated FFN, and sliding-window attention with its own RoPE base on five of
every six layers (layers 5, 11, 17 ... attend globally).
"""
from __future__ import annotations

import math

from pyggml import Tensor, ops
from pyggml.opdefs import RopeMode

from .architecture import Architecture
from .blocks import GraphBuilder
from .hparams import HParams

FFN_ACT = ops.geglu


def adjust_hparams(hp: HParams) -> None:
    hp.swa_pattern = 6                 # fixed by the architecture, not stored in the file
    hp.rope_freq_base_swa = 10000.0
    # queries are scaled by 1/sqrt(head size) before attention (27B: by 1/sqrt(n_embd/n_head))
    hp.attn_scale = 1.0 / math.sqrt(hp.n_embd / hp.n_head if hp.n_layer == 62 else hp.n_embd_head_k)


def build(b: GraphBuilder) -> Tensor:
    hp = b.hp
    inp = b.build_inp_embd(scale=math.sqrt(hp.n_embd))
    for il in range(hp.n_layer):
        cur = b.build_norm(inp, b.w("attn_norm.weight", il), "attn_norm", il)
        q, k, v = b.build_qkv(cur, il, qk_norm=True)
        # scaled before attention, as llama.cpp does: the F16 rounding of q sees the scaled values
        q = b.cb(ops.scale(q, hp.kq_scale()), "Qcur_scaled", il)
        cur = b.build_attn(q, k, v, il, 1.0)
        cur = b.build_norm(cur, b.w("post_attention_norm.weight", il), "attn_post_norm", il)
        sa_out = b.cb(ops.add(cur, inp), "sa_out", il)
        cur = b.build_norm(sa_out, b.w("ffn_norm.weight", il), "ffn_norm", il)
        cur = b.build_ffn(cur, il, FFN_ACT)
        cur = b.build_norm(cur, b.w("post_ffw_norm.weight", il), "ffn_post_norm", il)
        inp = b.cb(ops.add(cur, sa_out), "l_out", il)
    return b.build_output(inp)


ARCHITECTURE = Architecture("gemma3", build, RopeMode.NEOX, FFN_ACT, adjust_hparams)
