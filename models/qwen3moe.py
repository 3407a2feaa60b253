"""qwen3moe (Qwen3-30B-A3B, 235B-A22B): qwen3's attention (per-head q/k RMS norms, NEOX
RoPE) and a mixture of experts in every layer's FFN (softmax router, top-k, weights
renormalized), llama.cpp's llm_build_qwen3moe."""
from __future__ import annotations

from pyggml import Tensor
from pyggml.opdefs import RopeMode

from .architecture import Architecture
from .blocks import GraphBuilder
from .llama import FFN_ACT, build_llama_layers


def build(b: GraphBuilder) -> Tensor:
    return build_llama_layers(b, qk_norm=True)


ARCHITECTURE = Architecture("qwen3moe", build, RopeMode.NEOX, FFN_ACT)
