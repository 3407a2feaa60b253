"""SentencePiece-style BPE over a GGUF vocabulary, as llama.cpp's ``llm_tokenizer_spm`` does it.

The text is split into characters; the adjacent pair whose concatenation is a vocabulary piece
with the highest score is merged, again and again (ties: the leftmost pair); a character that
no piece covers becomes its UTF-8 bytes as ``<0xXX>`` tokens.  (llama.cpp's ``resegment`` also
takes apart merged symbols that are not pieces, but a pair is only merged into a piece.)

Why not the ``tokenizers`` library here: its BPE model needs merges, and SentencePiece has
none; deriving them from Gemma's 262k pieces gives 513k merges, and the model built from them
held ~290 MB once loaded, more than the weights of Gemma 3 270M.  This needs the piece -> id
map and the scores only.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


class SentencePieceBPE:
    def __init__(self, pieces: Sequence[str], scores: np.ndarray, byte_ids: dict[int, int]) -> None:
        self.ids = {p: i for i, p in enumerate(pieces)}
        self.scores = np.asarray(scores, dtype=np.float32).tolist()
        self.byte_ids = byte_ids  # byte value -> id of its <0xXX> piece

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (already prefixed and with spaces as '▁', as the caller wants)."""
        if not text:
            return []
        sym = list(text)                      # each symbol's text; '' once merged away
        prev = list(range(-1, len(sym) - 1))
        nxt = list(range(1, len(sym) + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, str]] = []

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = sym[left] + sym[right]
            i = self.ids.get(piece)
            if i is not None:  # max-heap on score, then the leftmost pair (llm_bigram_spm's order)
                heapq.heappush(heap, (-self.scores[i], left, right, piece))

        for i in range(1, len(sym)):
            try_add(i - 1, i)
        while heap:
            _, left, right, piece = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != piece:
                continue  # one side has changed since this pair was queued
            sym[left], sym[right] = piece, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])
        out: list[int] = []
        i = 0
        while i != -1:
            piece_id = self.ids.get(sym[i])
            if piece_id is not None:
                out.append(piece_id)
            else:
                out.extend(self.byte_ids[b] for b in sym[i].encode("utf-8"))
            i = nxt[i]
        return out
