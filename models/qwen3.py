"""qwen3: the llama graph with per-head RMS norms of q and k before RoPE, NEOX RoPE."""
from __future__ import annotations

from pyggml import Tensor
from pyggml.opdefs import RopeMode

from .architecture import Architecture
from .blocks import GraphBuilder
from .llama import FFN_ACT, build_llama_layers


def build(b: GraphBuilder) -> Tensor:
    return build_llama_layers(b, qk_norm=True)


ARCHITECTURE = Architecture("qwen3", build, RopeMode.NEOX, FFN_ACT)
