"""gpt-oss (openai/gpt-oss-20b, -120b): llama.cpp's llm_build_openai_moe.

Attention with q/k/v/output biases, NEOX RoPE with YaRN scaling on every layer, sliding-window
attention on every other layer (even ones), and attention sinks: a learned logit per head that
takes its share of each softmax.  Every layer's feed-forward is a mixture of experts whose router
has a bias: the top experts by raw router logit, their weights the softmax of those logits;
each expert's up and gate products have a bias per expert (ADD_ID), the clamped SwiGLU
(SWIGLU_OAI, alpha 1.702, limit 7), and a biased down product.  Norms: RMS before attention and
after it (``post_attention_norm``).  The experts are stored as MXFP4.
"""
from __future__ import annotations

from pyggml import Tensor, ops
from pyggml.opdefs import RopeMode

from .architecture import Architecture
from .blocks import GraphBuilder
from .hparams import HParams

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def adjust_hparams(hp: HParams) -> None:
    hp.swa_pattern = 2                           # layers 0, 2, 4 ... slide; 1, 3, 5 ... attend globally
    hp.rope_freq_base_swa = hp.rope_freq_base    # (the file may say otherwise: gguf's rope.freq_base_swa)
    hp.rope_freq_scale_swa = hp.rope_freq_scale  # YaRN on the sliding-window layers too


def build_moe_ffn(b: GraphBuilder, x: Tensor, il: int) -> Tensor:
    """llama.cpp's build_moe_ffn with gpt-oss's choices: biased router, softmax over the chosen
    experts' logits (SOFTMAX_WEIGHT), biased experts, SWIGLU_OAI, no renormalization."""
    hp, n = b.hp, b.n_tokens
    n_expert, n_used = hp.n_expert, hp.n_expert_used
    runs = b.inputs.token_runs
    logits = b.cb(ops.mul_mat(b.w("ffn_gate_inp.weight", il), x, runs), "ffn_moe_logits", il)    # [n_expert, n]
    logits = b.cb(ops.add(logits, b.w("ffn_gate_inp.bias", il)), "ffn_moe_logits_biased", il)
    selected = b.cb(ops.top_k(logits, n_used), "ffn_moe_topk", il)                              # I32 [n_used, n]
    weights = b.cb(ops.get_rows(ops.reshape(logits, 1, n_expert, n), selected), "ffn_moe_weights", il)
    weights = ops.soft_max(ops.reshape(weights, n_used, n))
    weights = b.cb(ops.reshape(weights, 1, n_used, n), "ffn_moe_weights_softmax", il)
    cur = ops.reshape(x, hp.n_embd, 1, n)
    up = ops.mul_mat_id(b.w("ffn_up_exps.weight", il), cur, selected, runs)
    up = b.cb(ops.add_id(up, b.w("ffn_up_exps.bias", il), selected), "ffn_moe_up_biased", il)
    gate = ops.mul_mat_id(b.w("ffn_gate_exps.weight", il), cur, selected, runs)
    gate = b.cb(ops.add_id(gate, b.w("ffn_gate_exps.bias", il), selected), "ffn_moe_gate_biased", il)
    act = b.cb(ops.swiglu_oai(gate, up, SWIGLU_ALPHA, SWIGLU_LIMIT), "ffn_moe_swiglu_oai", il)  # [n_ff, n_used, n]
    act = b.gathered(act, "ffn_moe_act", il)
    experts = ops.mul_mat_id(b.w("ffn_down_exps.weight", il), act, selected, runs)
    experts = b.cb(ops.add_id(experts, b.w("ffn_down_exps.bias", il), selected), "ffn_moe_down_biased", il)
    experts = b.cb(ops.mul(experts, weights), "ffn_moe_weighted", il)                         # [n_embd, n_used, n]
    return b.gathered(b.sum_experts(experts, il), "ffn_moe_out", il)


def build(b: GraphBuilder) -> Tensor:
    hp = b.hp
    inp = b.build_inp_embd()
    for il in range(hp.n_layer):
        cur = b.build_norm(inp, b.w("attn_norm.weight", il), "attn_norm", il)
        q, k, v = b.build_qkv(cur, il)
        cur = b.build_attn(q, k, v, il, hp.kq_scale(), sinks=b.w("attn_sinks.weight", il))
        ffn_inp = b.cb(ops.add(cur, inp), "ffn_inp", il)
        cur = b.build_norm(ffn_inp, b.w("post_attention_norm.weight", il), "attn_post_norm", il)
        cur = build_moe_ffn(b, cur, il)
        inp = b.cb(ops.add(cur, ffn_inp), "l_out", il)
    return b.build_output(inp)


ARCHITECTURE = Architecture("gpt-oss", build, RopeMode.NEOX, ops.swiglu_oai, adjust_hparams)
