"""What each model file (models/<name>.py) exports for the loader: one record, ``ARCHITECTURE``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyggml import Tensor
from pyggml.opdefs import RopeMode

from .blocks import GraphBuilder
from .hparams import HParams


def _as_stored(hp: HParams) -> None:
    pass


@dataclass(frozen=True)
class Architecture:
    name: str                                    # general.architecture in the file
    build: Callable[[GraphBuilder], Tensor]      # the forward graph (llama.cpp's llm_build_*)
    rope_mode: RopeMode
    ffn_act: Callable[[Tensor, Tensor], Tensor]  # the feed-forward's gate (ops.swiglu ...): the CPU compiles its kernel only
    adjust_hparams: Callable[[HParams], None] = _as_stored  # what the architecture fixes that the file does not say

    @property
    def gate_name(self) -> str:
        """The gate's op as named in pyggml.ops (``swiglu`` ...): devices prepare its kernel only."""
        return self.ffn_act.__name__
