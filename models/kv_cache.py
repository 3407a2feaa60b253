"""The KV cache: per layer, F16 keys and values for every context cell, in the buffer of
the device that runs the layer.

Cells are used in position order for one sequence (cell i holds position i), so the
cache needs no cell bookkeeping; ``n_past`` says how many are filled.  New keys and
values are written by SET_ROWS at indices given as a graph input, so that one decode
graph serves every position (llama.cpp does the same).
"""
from __future__ import annotations

from collections.abc import Sequence

from pyggml import Type, new_tensor
from pyggml.backend import Buffer, BufferType, BufferUsage, alloc_tensors

from .hparams import HParams

KV_PAD = 256  # attention reads the first multiple of KV_PAD cells, so the graph changes rarely


class KVCache:
    def __init__(self, hp: HParams, n_ctx: int, layer_bufts: Sequence[BufferType], type: Type = Type.F16) -> None:
        self.n_ctx = n_ctx
        self.type = type
        self.k = [new_tensor(type, (hp.n_embd_k_gqa, n_ctx), f"cache_k_l{il}") for il in range(hp.n_layer)]
        self.v = [new_tensor(type, (hp.n_embd_v_gqa, n_ctx), f"cache_v_l{il}") for il in range(hp.n_layer)]
        groups: dict[int, tuple[BufferType, list]] = {}
        for il, buft in enumerate(layer_bufts):
            groups.setdefault(id(buft), (buft, []))[1].extend([self.k[il], self.v[il]])
        # zero-filled on allocation: cells past n_past are masked, but must not hold NaNs
        self.buffers: list[Buffer] = [alloc_tensors(ts, buft, BufferUsage.ANY) for buft, ts in groups.values()]
        self.n_past = 0

    def n_kv(self, n_tokens: int) -> int:
        """Cells the attention reads for a batch of ``n_tokens`` after ``n_past``."""
        used = self.n_past + n_tokens
        return min(self.n_ctx, (used + KV_PAD - 1) // KV_PAD * KV_PAD)

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.k + self.v)

    def clear(self) -> None:
        self.n_past = 0
