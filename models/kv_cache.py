"""The KV cache: per layer, F16 keys and values for every context cell, in the buffer of
the device that runs the layer - llama.cpp's unified cache.

Every cell is tagged with the sequence and position of the token whose key and value it
holds (sequence -1: free), and the attention mask is built from the tags, so several
sequences share one cache and never see each other.  New keys and values are written by
SET_ROWS at the cells given as a graph input, so one decode graph serves every position
(llama.cpp does the same).

Cells are handed out in pages of ``page`` cells (pyggml.batch_rules: kv_page), each page
owned by one sequence: position p of a sequence lives at offset p % page of the sequence's
page for block p // page, pages taken lowest first.  So one sequence alone fills cells 0, 1, 2 ... (cell i holds position
i, as a single-sequence cache would), and in a shared cache every sequence's cells sit at
the same offsets modulo page as they would alone.  That matters for the bits: the
attention's sums run in lanes picked by cell index modulo 64 (ggml's vector width times
its unrolling), so a sequence decoded beside others gets exactly its solo logits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyggml import Tensor, Type, new_tensor
from pyggml.backend import Buffer, BufferType, BufferUsage, alloc_tensors
from pyggml.batch_rules import BATCH_RULES

from .hparams import HParams

# The attention reads the first n_kv cells (n_kv() below): the cells in use rounded up to a
# power of two from KV_PAD to KV_PAD_MAX, then to a multiple of KV_PAD_MAX.  n_kv is part of a
# graph's shape, and a new shape is a graph built and planned on the decoding thread (tens of
# ms, a stall every stream in the step sees): few sizes, so that the graphs of each are kept.
# The engine spreads its sequences over pages of the cache, so n_kv follows the tokens live in
# all of them.  Cells past the ones in use are masked, and the kernels skip them.
KV_PAD = 256
KV_PAD_MAX = 1024
FREE = -1
# Tokens that pad a batch to a shape built ahead (Context.padding) write their keys and values
# into one cell past the context's: the attention reads at most n_ctx cells, so no token ever
# sees it, and the cells of the sequences stay theirs.
SCRATCH_CELLS = 1


def kv_padded(end: int) -> int:
    """The cells read when the last one in use is ``end - 1`` (before the context's bound)."""
    if end <= KV_PAD_MAX:
        return max(KV_PAD, 1 << max(0, end - 1).bit_length())
    return -(-end // KV_PAD_MAX) * KV_PAD_MAX


@dataclass
class KVPart:
    """The keys and values of each layer, for the heads of ``hp`` (a device's, in a tensor split)."""
    k: list[Tensor]
    v: list[Tensor]

    @classmethod
    def of(cls, hp: HParams, n_ctx: int, type: Type, tag: str = "") -> KVPart:
        return cls([new_tensor(type, (hp.n_embd_k_gqa, n_ctx), f"cache_k_l{il}{tag}") for il in range(hp.n_layer)],
                   [new_tensor(type, (hp.n_embd_v_gqa, n_ctx), f"cache_v_l{il}{tag}") for il in range(hp.n_layer)])


class KVCache:
    def __init__(self, hp: HParams, n_ctx: int, layer_bufts: Sequence[BufferType], type: Type = Type.F16,
                 shards: Sequence[tuple[BufferType, HParams]] = (), page: int = BATCH_RULES.kv_page) -> None:
        """``shards`` (a tensor split): per device its buffer type and the head counts it holds;
        each then has the keys and values of its heads for every layer, in ``parts``, and the
        cells (one set of tags for all) are the same on every device.  ``page``: cells per
        page (BatchRules.kv_page of the devices)."""
        self.n_ctx = n_ctx
        self.page = page
        self.type = type
        self.n_swa = hp.n_swa
        groups: dict[int, tuple[BufferType, list]] = {}
        self.scratch = n_ctx  # the cell padding tokens write (SCRATCH_CELLS)
        self.parts = [KVPart.of(local, n_ctx + SCRATCH_CELLS, type, f"#{i}") for i, (_, local) in enumerate(shards)]
        for (buft, _), part in zip(shards, self.parts):
            groups.setdefault(id(buft), (buft, []))[1].extend(part.k + part.v)
        whole = KVPart.of(hp, n_ctx + SCRATCH_CELLS, type) if not shards else KVPart([], [])
        self.k, self.v = whole.k, whole.v
        for il, buft in enumerate(layer_bufts if not shards else ()):
            groups.setdefault(id(buft), (buft, []))[1].extend([self.k[il], self.v[il]])
        self.buffers: list[Buffer] = [alloc_tensors(ts, buft, BufferUsage.ANY) for buft, ts in groups.values()]
        for buf in self.buffers:  # masked cells are read too (0 * NaN is NaN); a new GPU buffer
            buf.clear(0)          # holds whatever was there, as in ggml, so llama.cpp clears it too
        self.cell_seq = np.full(n_ctx, FREE, dtype=np.int32)
        self.cell_pos = np.zeros(n_ctx, dtype=np.int32)
        # what the tags say, kept while only occupy() changes them (a decoding step asks for
        # both, and working them out scans every cell): owned()'s pages, and one past the
        # last cell in use; None: worked out again at the next question
        self._owner: dict[tuple[int, int], int] | None = None
        self._end: int | None = None

    # -- cells --------------------------------------------------------------------------------------
    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.cell_seq != FREE))

    @property
    def n_pages(self) -> int:
        return (self.n_ctx + self.page - 1) // self.page

    def _by_page(self, cells: np.ndarray, fill: int) -> np.ndarray:
        """A per-cell array as [n_pages, page] (the last page padded with ``fill``)."""
        pad = self.n_pages * self.page - self.n_ctx
        return (np.concatenate([cells, np.full(pad, fill, cells.dtype)]) if pad else cells).reshape(-1, self.page)

    def owned(self) -> dict[tuple[int, int], int]:
        """(sequence, block) -> page, for every page holding a cell (read it, do not change it).
        A page only ever holds one sequence's block, so its first used cell says whose it is."""
        if self._owner is None:
            used = self._by_page(self.cell_seq, FREE) != FREE
            pages = np.flatnonzero(used.any(axis=1))
            first = pages * self.page + used[pages].argmax(axis=1)
            self._owner = {(int(seq), int(pos) // self.page): int(page)
                           for seq, pos, page in zip(self.cell_seq[first], self.cell_pos[first], pages)}
        return self._owner

    def _changed(self) -> None:
        """Cells were freed: what was kept about them is worked out again when asked."""
        self._owner = self._end = None

    @property
    def free_pages(self) -> int:
        return self.n_pages - int((self._by_page(self.cell_seq, FREE) != FREE).any(axis=1).sum())

    def pages_for(self, seq: int, p0: int, p1: int, owned: dict | None = None) -> int:
        """Pages sequence ``seq`` must take to hold positions p0 .. p1 - 1."""
        owned = self.owned() if owned is None else owned
        return sum((seq, blk) not in owned for blk in range(p0 // self.page, (p1 - 1) // self.page + 1)) if p1 > p0 else 0

    def seq_pages(self, seq: int) -> int:
        return sum(s == seq for s, _ in self.owned())

    def find_cells(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
        """A cell for each (sequence, position), taking free pages lowest first; None when the
        pages run out or a position's offset lies past the cache's end (nothing is taken)."""
        owned = self.owned()
        taken = set(owned.values())
        free = (g for g in range(self.n_pages) if g not in taken)
        new: dict[tuple[int, int], int] = {}
        cells = np.empty(seq.size, dtype=np.int32)
        for i, (s, p) in enumerate(zip(seq.tolist(), pos.tolist())):
            key = (s, p // self.page)
            g = owned.get(key, new.get(key))
            if g is None:
                g = new[key] = next(free, None)
                if g is None:
                    return None
            c = g * self.page + p % self.page
            if c >= self.n_ctx:
                return None
            cells[i] = c
        return cells

    def occupy(self, cells: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> None:
        """Tag ``cells`` (find_cells') with their tokens' sequences and positions."""
        self.cell_seq[cells] = seq
        self.cell_pos[cells] = pos
        if len(cells) == 0:
            return
        if self._owner is not None:  # find_cells' cells: each in its (sequence, block)'s page
            pages = {(s, p // self.page): c // self.page for c, s, p in zip(np.asarray(cells).tolist(),
                                                                   np.broadcast_to(seq, len(cells)).tolist(),
                                                                   np.broadcast_to(pos, len(cells)).tolist())}
            if any(self._owner.get(key) != page for key, page in pages.items()):
                self._owner = {**self._owner, **pages}  # a new dict: what owned() gave out stays as it was
        if self._end is not None:
            self._end = max(self._end, int(np.max(cells)) + 1)

    def copy_cells(self, src: int, dst: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Cells for sequence ``dst``'s positions p0 .. p1 - 1, tagged as its own, beside the
        cells of sequence ``src`` that hold those positions: (source cells, new cells), each
        at the same offset of its page (a copy keeps the bits where they sit alone).  None,
        with nothing taken, when ``src`` lacks one of the positions or the pages run out."""
        pos = np.arange(p0, p1, dtype=np.int32)
        owned = self.owned()
        pages = [owned.get((src, int(p) // self.page)) for p in pos]
        if any(g is None for g in pages):
            return None
        source = np.array(pages, dtype=np.int32) * self.page + pos % self.page
        if not ((self.cell_seq[source] == src) & (self.cell_pos[source] == pos)).all():
            return None
        target = self.find_cells(np.full(pos.size, dst, np.int32), pos)
        if target is None:
            return None
        self.occupy(target, np.int32(dst), pos)
        return source, target

    def seq_rm(self, seq: int, p0: int = 0) -> None:
        """Free the cells of sequence ``seq`` at positions ``p0`` and later."""
        self.cell_seq[(self.cell_seq == seq) & (self.cell_pos >= p0)] = FREE
        self._changed()

    def n_kv(self, cells: np.ndarray | None = None) -> int:
        """Cells the attention reads: every cell up to the last one in use, padded (KV_PAD);
        with ``cells`` (find_cells'), what it will be once they are occupied too."""
        if self._end is None:
            used = np.flatnonzero(self.cell_seq != FREE)
            self._end = int(used[-1]) + 1 if used.size else 0
        end = self._end if cells is None or not len(cells) else max(self._end, int(np.max(cells)) + 1)
        return min(self.n_ctx, kv_padded(end))

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
        self._changed()
