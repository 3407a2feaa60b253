"""Tokenizers built from the GGUF alone produce llama.cpp's ids on every reference string."""
from __future__ import annotations

import pytest

from pyggml.gguf import GGUFFile
from pyggml.models import Tokenizer

from .conftest import REFERENCES, reference


# byte-level BPE tokenizers (``tokenizers`` objects) are cached on disk; SentencePiece ones are
# built from the pieces and scores each time (models/spm.py), with nothing to cache
CACHED = {"smollm2"}


@pytest.fixture(scope="module", params=[(alias, how) for alias in REFERENCES
                                        for how in (("built", "cached") if alias in CACHED else ("built",))],
                ids=lambda p: "-".join(p))
def case(request, tmp_path_factory):
    """Each model's tokenizer built from the GGUF, and loaded back from the tokenizer cache."""
    import os

    from pyggml import hub
    alias, how = request.param
    path = hub.fetch(alias)
    saved = os.environ.get("PYGGML_CACHE")
    os.environ["PYGGML_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        tk = Tokenizer(GGUFFile(path))
        cached = list((hub.cache_dir() / "tokenizers").glob("*.json"))
        assert len(cached) == (1 if alias in CACHED else 0)  # a build of a cached kind was stored
        if how == "cached":
            before = cached[0].stat()
            tk = Tokenizer(GGUFFile(path))
            after = cached[0].stat()  # read, not rebuilt and replaced
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    finally:
        if saved is None:
            del os.environ["PYGGML_CACHE"]
        else:
            os.environ["PYGGML_CACHE"] = saved
    return tk, reference(alias), alias


def test_reference_strings(case):
    tk, ref, _ = case
    assert len(ref["tokenize"]) >= 10
    for entry in ref["tokenize"]:
        assert tk.tokenize(entry["text"], add_bos=False) == entry["ids"], entry["text"]
        assert tk.tokenize(entry["text"], add_bos=False, special=True) == entry["ids_parse_special"], entry["text"]


def test_prompts_follow_the_models_bos_rule(case):
    tk, ref, alias = case
    for p in ref["prompts"]:
        assert tk.tokenize(p["prompt"]) == p["tokens"]
    assert tk.add_bos == (alias == "gemma3-270m")  # Gemma adds <bos>, SmolLM2 does not


def test_detokenize_round_trips(case):
    tk, ref, _ = case
    for entry in ref["tokenize"]:
        assert tk.detokenize(entry["ids_parse_special"], special=True) == entry["text"]
    for p in ref["prompts"]:
        assert tk.detokenize(p["greedy"]) == p["greedy_text"]


def test_control_tokens_only_with_special(case):
    tk, _, alias = case
    marker = "<|im_start|>" if alias == "smollm2" else "<start_of_turn>"
    control = tk.token_to_id(marker)
    assert control is not None
    assert tk.tokenize(marker, add_bos=False, special=True) == [control]
    assert control not in tk.tokenize(marker, add_bos=False)
    assert tk.detokenize([control]) == "" and tk.detokenize([control], special=True) == marker


def test_end_of_generation_tokens(case):
    tk, _, alias = case
    eot = "<|im_end|>" if alias == "smollm2" else "<end_of_turn>"
    assert tk.is_eog(tk.eos_id) and tk.is_eog(tk.token_to_id(eot))
    assert not tk.is_eog(tk.tokenize("Hello", add_bos=False)[0])


def test_out_of_range_ids_are_an_error(case):
    tk = case[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tk.detokenize([tk.n_vocab])
