"""Tokenizers built from a GGUF's vocabulary alone, on the ``tokenizers`` library.

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with the file's merges and the
  pre-tokenizer that ``tokenizer.ggml.pre`` names (the regexes are llama.cpp's).
- ``"llama"``: SentencePiece BPE (Gemma).  SentencePiece merges the adjacent pair whose
  merged piece scores highest; a BPE model whose merges are ordered by the merged piece's
  score does the same.  Pieces marked user-defined (``token_type`` 4: runs of spaces and
  newlines) are matched whole before any merging, as SentencePiece does - as added tokens.
  Unknown characters fall back to ``<0xXX>`` byte tokens.

Control tokens (``token_type`` 3, e.g. ``<|im_start|>``, ``<bos>``) are recognised in the
text only with ``special=True``, like llama.cpp's ``parse_special``: we split the text at
them ourselves rather than registering them with ``tokenizers`` as added tokens, whose
matcher for Gemma's 6249 control tokens took ~250 MB.  Both kinds reproduce llama.cpp's ids on
every reference string (tests/test_tokenizer.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from pyggml.gguf import GGUFError, GGUFFile

log = logging.getLogger("pyggml.tokenizer")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by tokenizer.ggml.pre
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_PRE = {
    "default": None,            # GPT-2's own regex (inside the ByteLevel pre-tokenizer)
    "gpt2": None,
    "smollm": r"\p{N}",         # digits split one by one, then GPT-2's regex
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "qwen2": _QWEN2,
}

# texts of end-of-generation tokens besides EOS (llama.cpp's list, trimmed to common ones)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|return|>", "<eos>", "</s>")


CACHE_VERSION = 2  # bump when the way a tokenizer is built from a GGUF changes


def _cache_path(f: GGUFFile, tokens: list[str], types: np.ndarray) -> Path:
    """Where the tokenizer built from this vocabulary is kept: named by a hash of everything
    it is built from (building Gemma's 262k-piece SentencePiece model takes 1.5 s, loading it 0.7 s)."""
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    h.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(types.astype("<i4").tobytes())
    for key in ("model", "pre", "scores", "merges", "add_space_prefix", "unknown_token_id"):
        value = f.get(f"tokenizer.ggml.{key}")
        if isinstance(value, list) and value and isinstance(value[0], float):
            h.update(np.asarray(value, dtype="<f4").tobytes())
        elif isinstance(value, list):
            h.update("\0".join(map(str, value)).encode("utf-8", "surrogatepass"))
        else:
            h.update(repr(value).encode())
    from pyggml import hub
    return hub.cache_dir() / "tokenizers" / f"{h.hexdigest()}.json"


def _load_cached(path: Path):
    from tokenizers import Tokenizer as HFTokenizer
    try:
        return HFTokenizer.from_file(str(path)) if path.exists() else None
    except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt, whatever the error
        log.warning("ignoring the cached tokenizer %s: %s", path, e)
        return None


def _store(path: Path, hf) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(hf.to_str())
        os.replace(tmp, path)  # whole or not at all
    except OSError as e:
        log.info("cannot cache the tokenizer in %s: %s", path.parent, e)


class Tokenizer:
    def __init__(self, f: GGUFFile) -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        self.kind = str(f.get("tokenizer.ggml.model", ""))
        self.tokens = [str(t) for t in f.get("tokenizer.ggml.tokens", [])]
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
        cache = _cache_path(f, self.tokens, self.types)
        self.hf: HFTokenizer | None = _load_cached(cache)
        if self.hf is None:
            self.hf = self._byte_level_bpe(f) if self.kind == "gpt2" else self._sentencepiece(f)
            # user-defined pieces are matched whole, as SentencePiece does; control tokens are
            # split out in tokenize() (only when asked to)
            self.hf.add_tokens([AddedToken(self.tokens[i], normalized=False)
                                for i in np.nonzero(self.types == USER_DEFINED)[0]])
            _store(cache, self.hf)
        self.control = {self.tokens[i]: int(i) for i in np.nonzero(self.types == CONTROL)[0]}
        self._control_re: re.Pattern | None = None
        eog = {self.eos_id, self._id(f, "eot_token_id"), self._id(f, "eom_token_id")}
        eog.update(self.control[text] for text in EOG_TEXTS if text in self.control)
        self.eog_ids = frozenset(i for i in eog if i is not None)

    @staticmethod
    def _id(f: GGUFFile, key: str) -> int | None:
        value = f.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and int(value) >= 0 else None

    def _byte_level_bpe(self, f: GGUFFile):
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        merges = [tuple(str(m).split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
        pre = str(f.get("tokenizer.ggml.pre", "default"))
        if pre not in BPE_PRE:
            log.warning("tokenizer pre-type %r is not known; using GPT-2's (supported: %s)", pre, ", ".join(BPE_PRE))
            pre = "default"
        vocab = {t: i for i, t in enumerate(self.tokens)}
        hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in ("llama-bpe", "llama3")))
        pattern = BPE_PRE[pre]
        if pattern is None:
            hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            # smollm keeps GPT-2's regex after splitting digits; llama-bpe and qwen2 replace it
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "smollm")])
        hf.decoder = decoders.ByteLevel()
        return hf

    def _sentencepiece(self, f: GGUFFile):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers

        scores = f.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError(f.path, "SentencePiece vocabulary without scores (tokenizer.ggml.scores)")
        scores = np.asarray(scores, dtype=np.float32)
        vocab = {t: i for i, t in enumerate(self.tokens)}
        rank = np.empty(len(scores), dtype=np.int64)
        rank[np.argsort(-scores, kind="stable")] = np.arange(len(scores))
        normal = self.types == NORMAL
        merges = []
        for piece, i in vocab.items():
            if not normal[i]:
                continue
            for cut in range(1, len(piece)):
                left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
                if left is not None and right is not None and normal[left] and normal[right]:
                    merges.append((rank[i], rank[left], rank[right], piece[:cut], piece[cut:]))
        merges.sort()
        unk = self._id(f, "unknown_token_id")
        hf = HFTokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], byte_fallback=True, fuse_unk=False,
                                    unk_token=self.tokens[unk] if unk is not None else None))
        prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
        steps = ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
        hf.normalizer = normalizers.Sequence(steps)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        hf.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        return hf

    # -- public -------------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos=None`` follows the model's rule; ``special`` lets
        control tokens written in the text (``<|im_start|>``) become those tokens."""
        ids: list[int] = []
        for piece in (self._split_control(text) if special and self.control else [text]):
            if piece in self.control and special:
                ids.append(self.control[piece])
            elif piece:
                ids.extend(self.hf.encode(piece, add_special_tokens=False).ids)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not (ids and ids[0] == self.bos_id):
                ids = [self.bos_id] + ids
        return ids

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        """Text of ``ids``; control tokens are left out unless ``special``."""
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        if not special:
            ids = [i for i in ids if self.types[i] != CONTROL]
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def _split_control(self, text: str) -> list[str]:
        """text cut at every control token it contains (longest first where they overlap),
        the control tokens kept as pieces of their own - llama.cpp's special-token partition."""
        if self._control_re is None:
            alternatives = sorted(self.control, key=len, reverse=True)
            self._control_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        return self._control_re.split(text)

    def token_text(self, i: int) -> str:
        return self.tokens[i]

    def is_eog(self, i: int) -> bool:
        return i in self.eog_ids
