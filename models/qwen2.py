"""qwen2: the llama graph with biases on q, k, v (read from the file) and NEOX RoPE."""
from __future__ import annotations

from pyggml import Tensor
from pyggml.opdefs import RopeMode

from .architecture import Architecture
from .blocks import GraphBuilder
from .llama import FFN_ACT, build_llama_layers


def build(b: GraphBuilder) -> Tensor:
    return build_llama_layers(b)


ARCHITECTURE = Architecture("qwen2", build, RopeMode.NEOX, FFN_ACT)
