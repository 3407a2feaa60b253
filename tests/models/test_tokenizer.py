"""Tokenizers built from the GGUF alone produce llama.cpp's ids on every reference string."""
from __future__ import annotations

import pytest

from pyggml.gguf import GGUFFile
from pyggml.models import Tokenizer

from tests.conftest import REFERENCES, reference


@pytest.fixture(scope="module", params=list(REFERENCES))
def case(request):
    """Each model's tokenizer, built from the GGUF."""
    from pyggml.models import hub
    return Tokenizer(GGUFFile(hub.fetch(request.param))), reference(request.param), request.param


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
