"""The KV cache: per layer, F16 keys and values for every context cell, in the buffer of
the device that runs the layer - llama.cpp's unified cache.

Every cell is tagged with the sequence and position of the token whose key and value it
holds (sequence -1: free), and the attention mask is built from the tags, so several
sequences share one cache and never see each other.  A batch takes the lowest free cells;
one sequence alone therefore fills cells 0, 1, 2 ... and cell i holds position i, exactly
as a single-sequence cache would.  New keys and values are written by SET_ROWS at the cells
given as a graph input, so one decode graph serves every position (llama.cpp does the same).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pyggml import Type, new_tensor
from pyggml.backend import Buffer, BufferType, BufferUsage, alloc_tensors

from .hparams import HParams

KV_PAD = 256  # attention reads the first multiple of KV_PAD cells, so the graph changes rarely
FREE = -1


class KVCache:
    def __init__(self, hp: HParams, n_ctx: int, layer_bufts: Sequence[BufferType], type: Type = Type.F16) -> None:
        self.n_ctx = n_ctx
        self.type = type
        self.n_swa = hp.n_swa
        self.k = [new_tensor(type, (hp.n_embd_k_gqa, n_ctx), f"cache_k_l{il}") for il in range(hp.n_layer)]
        self.v = [new_tensor(type, (hp.n_embd_v_gqa, n_ctx), f"cache_v_l{il}") for il in range(hp.n_layer)]
        groups: dict[int, tuple[BufferType, list]] = {}
        for il, buft in enumerate(layer_bufts):
            groups.setdefault(id(buft), (buft, []))[1].extend([self.k[il], self.v[il]])
        # zero-filled on allocation: masked cells are read too, and must not hold NaNs
        self.buffers: list[Buffer] = [alloc_tensors(ts, buft, BufferUsage.ANY) for buft, ts in groups.values()]
        self.cell_seq = np.full(n_ctx, FREE, dtype=np.int32)
        self.cell_pos = np.zeros(n_ctx, dtype=np.int32)

    # -- cells --------------------------------------------------------------------------------------
    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.cell_seq != FREE))

    @property
    def n_free(self) -> int:
        return self.n_ctx - self.n_used

    def find_cells(self, n: int) -> np.ndarray | None:
        """The lowest ``n`` free cells, or None when fewer are free."""
        free = np.flatnonzero(self.cell_seq == FREE)
        return free[:n].astype(np.int32) if free.size >= n else None

    def occupy(self, cells: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> None:
        self.cell_seq[cells] = seq
        self.cell_pos[cells] = pos

    def seq_rm(self, seq: int, p0: int = 0) -> None:
        """Free the cells of sequence ``seq`` at positions ``p0`` and later."""
        self.cell_seq[(self.cell_seq == seq) & (self.cell_pos >= p0)] = FREE

    def seq_len(self, seq: int) -> int:
        """Cells held by sequence ``seq``."""
        return int(np.count_nonzero(self.cell_seq == seq))

    def n_kv(self) -> int:
        """Cells the attention reads: every cell up to the last one in use, padded to KV_PAD."""
        used = np.flatnonzero(self.cell_seq != FREE)
        end = int(used[-1]) + 1 if used.size else 0
        return min(self.n_ctx, max(KV_PAD, (end + KV_PAD - 1) // KV_PAD * KV_PAD))

    def masks(self, seq: np.ndarray, pos: np.ndarray, n_kv: int, swa: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """float32 [n_tokens, n_kv] masks (0 visible, -inf hidden): a token sees the cells of
        its own sequence at its position and before; the sliding-window mask also hides cells
        ``n_swa`` or more positions back."""
        cseq, cpos = self.cell_seq[None, :n_kv], self.cell_pos[None, :n_kv]
        distance = pos[:, None] - cpos
        visible = (cseq == seq[:, None]) & (distance >= 0)
        causal = np.where(visible, np.float32(0.0), np.float32(-np.inf))
        if not swa:
            return causal, None
        return causal, np.where(visible & (distance < self.n_swa), np.float32(0.0), np.float32(-np.inf))

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.k + self.v)

    def clear(self) -> None:
        self.cell_seq[:] = FREE
