"""SentencePiece BPE (models/spm.py) on small vocabularies whose answer is known by hand."""
from __future__ import annotations

import numpy as np

from pyggml.models.spm import SentencePieceBPE

BYTES = [f"<0x{b:02X}>" for b in range(256)]


def tokenizer(pieces: dict[str, float]) -> tuple[SentencePieceBPE, list[str]]:
    vocab = BYTES + list(pieces)
    scores = np.array([0.0] * 256 + list(pieces.values()), dtype=np.float32)
    return SentencePieceBPE(vocab, scores, {b: b for b in range(256)}), vocab


def pieces(spm: SentencePieceBPE, vocab: list[str], text: str) -> list[str]:
    return [vocab[i] for i in spm.encode(text)]


def test_highest_scoring_pair_merges_first():
    spm, vocab = tokenizer({"a": -1, "b": -1, "c": -1, "ab": -5, "bc": -2, "abc": -3})
    # "bc" outscores "ab", then "a"+"bc" is a piece
    assert pieces(spm, vocab, "abc") == ["abc"]
    spm, vocab = tokenizer({"a": -1, "b": -1, "c": -1, "ab": -2, "bc": -5})
    assert pieces(spm, vocab, "abc") == ["ab", "c"]


def test_ties_go_to_the_leftmost_pair():
    spm, vocab = tokenizer({"a": -1, "aa": -2})
    assert pieces(spm, vocab, "aaa") == ["aa", "a"]


def test_characters_without_a_piece_fall_back_to_utf8_bytes():
    spm, vocab = tokenizer({"a": -1})
    assert pieces(spm, vocab, "aé") == ["a", "<0xC3>", "<0xA9>"]
    assert spm.encode("") == []
