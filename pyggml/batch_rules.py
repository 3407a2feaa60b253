"""The batch widths that decide which kernel computes an element, and with it the bits.

pyggml gives a sequence the same logits whatever shares its batch, its cache, or however its
prompt is cut into pieces.  That holds because every width that picks a kernel or the order
of a sum is kept the same for a sequence in every case, and these are all of them:

- ``kv_page``: the KV cache hands out cells in pages of this many, each owned by one
  sequence, so a sequence's position p sits at cell offset p % kv_page in a shared cache as
  it does alone.  Attention sums in lanes picked by cell index modulo 64 (ggml's vector
  width times its unrolling): a page is a multiple of 64.
- ``piece_align``: a prompt read in pieces starts and ends them on multiples of this within
  the ubatch grid: repacked Q4_K multiplies columns in fours from its ubatch's start.
- ``tiled_min_cols``: from this many columns in a ubatch, products and the attention compute
  as a batch (K-quant products tiled from 8, as llama.cpp's are; the attention of a sequence
  takes its single-token path for one column only): a piece never leaves fewer than this of
  its ubatch to read after it.

The widths depend on the weights as well as the device: where every product's weights compute
each column alike however many columns it has (the CPU's Q4_0, Q4_1, Q5_0, Q8_0, MXFP4 ...:
pyggml.cpu.kinds.COLUMNWISE), only the attention's single token is left, and a prompt may be
cut anywhere but one token from its ubatch's end (COLUMNWISE_RULES): a prompt that shares all
but a few tokens with a cached one reads those few, as llama-server does.  A device says its
rules for a model's weights (Device.batch_rules); the CPU's kernels, the KV cache, the context's
prompt cuts and the engine's page bookkeeping all read them from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRules:
    kv_page: int = 64
    piece_align: int = 8
    tiled_min_cols: int = 8

    def prompt_cut(self, done: int, total: int, budget: int, ubatch: int) -> int:
        """How many of a prompt's tokens to read now, from position ``done`` of ``total``, at
        most ``budget``, so that every token meets the kernels it meets when the prompt is read
        whole in ubatches of ``ubatch``: 0 when no such piece fits (never with a budget of
        min_budget or more)."""
        end = min(total, (done // ubatch + 1) * ubatch)  # the end of the ubatch that holds `done`
        if end - done <= budget:
            return max(0, end - done)
        n = (done + budget) // self.piece_align * self.piece_align - done
        if end - (done + n) < self.tiled_min_cols:
            n -= self.piece_align
        return n if n >= self.tiled_min_cols else 0  # (a piece of fewer computes as fewer do)

    @property
    def min_budget(self) -> int:
        """The least budget with which every prompt_cut reads something."""
        return 2 * max(self.piece_align, self.tiled_min_cols)

    def reusable_prefix(self, cached: int, total: int, ubatch: int) -> int:
        """The part of a cached prefix of ``cached`` tokens that the rest of a ``total``-token
        prompt can be read after as if the prompt were read whole (prompt_cut's rule): never
        the last token, which is always evaluated, for its logits."""
        cached = min(cached, total - 1)
        start = cached // ubatch * ubatch
        end = min(total, start + ubatch)
        c = cached // self.piece_align * self.piece_align
        while c > start and end - c < self.tiled_min_cols:
            c -= self.piece_align
        return c

    def joined(self, other: BatchRules) -> BatchRules:
        """The rules whose cuts keep both ``self``'s and ``other``'s (a model over devices of
        each): pieces aligned to both, leaving at least what either needs."""
        if self.kv_page != other.kv_page:
            raise ValueError(f"KV pages of {self.kv_page} and {other.kv_page} cells: a sequence's cells would "
                             "sit at other offsets on each device")
        return BatchRules(self.kv_page, math.lcm(self.piece_align, other.piece_align),
                          max(self.tiled_min_cols, other.tiled_min_cols))


BATCH_RULES = BatchRules()  # every device's for any weights (the CPU's K-quants, CUDA's kernels)
COLUMNWISE_RULES = BatchRules(piece_align=1, tiled_min_cols=2)  # the CPU's for COLUMNWISE weights
