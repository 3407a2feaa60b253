"""Tokenizers built from a GGUF's vocabulary alone, on the ``tokenizers`` library.

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with the file's merges and the
  pre-tokenizer that ``tokenizer.ggml.pre`` names (the regexes are llama.cpp's).
- ``"llama"``: SentencePiece BPE (Gemma), by models/spm.py (llama.cpp's algorithm over the
  pieces and their scores; see there why not ``tokenizers``).  Pieces marked user-defined
  (``token_type`` 4: runs of spaces and newlines) are matched whole before any merging, as
  SentencePiece does.  Unknown characters fall back to ``<0xXX>`` byte tokens.

Control tokens (``token_type`` 3, e.g. ``<|im_start|>``, ``<bos>``) are recognised in the
text only with ``special=True``, like llama.cpp's ``parse_special``: we split the text at
them ourselves (llama.cpp's special-token partition) rather than registering them with
``tokenizers`` as added tokens.  Both kinds reproduce llama.cpp's ids on every reference
string (tests/models/test_tokenizer.py).
"""
from __future__ import annotations

import logging
import re

import numpy as np

from pyggml.gguf import GGUFError, GGUFFile

from .pretokenizers import PRE_TYPES, REGEXES
from .spm import SentencePieceBPE

log = logging.getLogger("pyggml.tokenizer")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# texts of end-of-generation tokens besides EOS (llama.cpp's list, trimmed to common ones)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|return|>", "<eos>", "</s>")


class Tokenizer:
    """``pre_tokenizer``: use this llama.cpp pre-tokenizer name instead of the file's
    ``tokenizer.ggml.pre`` (for a file whose name llama.cpp does not know: "gpt-2", say)."""

    def __init__(self, f: GGUFFile, pre_tokenizer: str | None = None) -> None:
        self.kind = str(f.get("tokenizer.ggml.model", ""))
        self.tokens = f.get("tokenizer.ggml.tokens", [])  # the file's compact array: decoded on access
        if not self.tokens:
            raise GGUFError(f.path, "no tokenizer vocabulary (tokenizer.ggml.tokens)")
        n = len(self.tokens)
        types = f.get("tokenizer.ggml.token_type")
        self.types = np.asarray(types, dtype=np.int32) if types is not None else np.full(n, NORMAL, np.int32)
        self.bos_id = self._id(f, "bos_token_id")
        self.eos_id = self._id(f, "eos_token_id")
        if self.kind not in ("gpt2", "llama"):
            raise GGUFError(f.path, f"unsupported tokenizer model {self.kind!r} (supported: gpt2, llama)")
        add_bos = f.get("tokenizer.ggml.add_bos_token")
        self.add_bos = bool(self.kind == "llama" if add_bos is None else add_bos) and self.bos_id is not None
        self.control = {self.tokens[i]: int(i) for i in np.nonzero(self.types == CONTROL)[0]}
        self.user_defined = {self.tokens[i]: int(i) for i in np.nonzero(self.types == USER_DEFINED)[0]}
        self._split_re: dict[bool, re.Pattern | None] = {}
        self.hf = self.spm = None
        if self.kind == "gpt2":
            from tokenizers import AddedToken
            self.hf = self._byte_level_bpe(f, pre_tokenizer)
            # user-defined pieces are matched whole; control tokens are split out in tokenize()
            self.hf.add_tokens([AddedToken(t, normalized=False) for t in self.user_defined])
        else:
            self.spm = self._sentencepiece(f)
            self.space_prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
        eog = {self.eos_id, self._id(f, "eot_token_id"), self._id(f, "eom_token_id")}
        eog.update(self.control[text] for text in EOG_TEXTS if text in self.control)
        self.eog_ids = frozenset(i for i in eog if i is not None)

    @staticmethod
    def _id(f: GGUFFile, key: str) -> int | None:
        value = f.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and int(value) >= 0 else None

    def _byte_level_bpe(self, f: GGUFFile, pre_tokenizer: str | None = None):
        """Byte-level BPE over the file's merges; the text is first cut by the regexes llama.cpp
        uses for the file's ``tokenizer.ggml.pre`` (models/pretokenizers.py), one after the
        other, each piece then byte-encoded as GPT-2 does."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        merges = [tuple(str(m).split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
        pre = pre_tokenizer or str(f.get("tokenizer.ggml.pre") or "default")
        if pre not in PRE_TYPES:
            raise GGUFError(f.path, f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one llama.cpp knows; "
                                    f"known: {', '.join(sorted(PRE_TYPES))} (pyggml.Model(..., pre_tokenizer="
                                    f"'gpt-2') splits as GPT-2 does)")
        kind, ignore_merges = PRE_TYPES[pre]
        exprs, byte_encode = REGEXES.get(kind, REGEXES["DEFAULT"])
        if not byte_encode:
            raise GGUFError(f.path, f"pre-tokenizer {pre!r} keeps raw UTF-8 pieces; only byte-level BPE is supported")
        vocab = {t: i for i, t in enumerate(self.tokens)}
        hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(e), "isolated") for e in exprs]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        return hf

    def _sentencepiece(self, f: GGUFFile) -> SentencePieceBPE:
        scores = f.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError(f.path, "SentencePiece vocabulary without scores (tokenizer.ggml.scores)")
        byte_ids = {}
        for i in np.nonzero(self.types == BYTE)[0]:
            piece = self.tokens[i]
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                byte_ids[int(piece[3:5], 16)] = int(i)
        if len(byte_ids) != 256:
            raise GGUFError(f.path, f"SentencePiece vocabulary with {len(byte_ids)} of the 256 byte pieces <0xXX>")
        return SentencePieceBPE(self.tokens, np.asarray(scores, dtype=np.float32), byte_ids)

    # -- public -------------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos=None`` follows the model's rule; ``special`` lets
        control tokens written in the text (``<|im_start|>``) become those tokens."""
        ids: list[int] = []
        after_token = True  # SentencePiece prefixes a space to text at the start or after a token
        for piece in self._partition(text, special):
            token = self.user_defined.get(piece)
            if token is None and special:
                token = self.control.get(piece)
            if token is not None:
                ids.append(token)
                after_token = True
            elif piece:
                if self.spm is not None:
                    piece = ((" " if self.space_prefix and after_token else "") + piece).replace(" ", "▁")
                    ids.extend(self.spm.encode(piece))
                else:
                    ids.extend(self.hf.encode(piece, add_special_tokens=False).ids)
                after_token = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not (ids and ids[0] == self.bos_id):
                ids = [self.bos_id] + ids
        return ids

    def _partition(self, text: str, special: bool) -> list[str]:
        """text cut at every user-defined piece (and control token, with ``special``), longest
        first where they overlap, those kept as parts of their own: llama.cpp's partition of
        special tokens.  (For gpt2 vocabularies ``tokenizers`` matches the user-defined ones.)"""
        if self.spm is None and not special:
            return [text]
        if special not in self._split_re:
            texts = list(self.control) if special else []
            texts += list(self.user_defined) if self.spm is not None else []
            texts.sort(key=len, reverse=True)
            self._split_re[special] = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        pattern = self._split_re[special]
        return pattern.split(text) if pattern is not None else [text]

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        """Text of ``ids``; control tokens are left out unless ``special``."""
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        if not special:
            ids = [i for i in ids if self.types[i] != CONTROL]
        if self.spm is None:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        out = bytearray()
        for i in ids:
            piece = self.tokens[i]
            if self.types[i] == BYTE:
                out.append(int(piece[3:5], 16))
            else:
                out += piece.replace("\u2581", " ").encode("utf-8", "surrogatepass")
        text = out.decode("utf-8", "replace")
        return text[1:] if self.space_prefix and text.startswith(" ") else text

    def token_to_id(self, text: str) -> int | None:
        """The id of the piece spelled exactly ``text``, if there is one."""
        return self.spm.ids.get(text) if self.spm is not None else self.hf.token_to_id(text)

    def token_text(self, i: int) -> str:
        return self.tokens[i]

    def is_eog(self, i: int) -> bool:
        return i in self.eog_ids
