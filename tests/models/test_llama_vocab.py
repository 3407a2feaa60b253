"""Every tokenizer test vector of llama.cpp's source, for every vocabulary whose tokenizer
model pyggml supports: identical ids.  The byte-level BPE vocabularies exercise llama.cpp's
pre-tokenizers (models/pretokenizers.py, generated from llama-vocab.cpp)."""
from __future__ import annotations

import pytest

from pyggml.gguf import GGUFError, GGUFFile
from pyggml.models.pretokenizers import PRE_TYPES
from pyggml.models.tokenizer import Tokenizer

from tests.models.llama_vocab import vectors, vocab_dir

# vocabularies of the source with vectors, and those whose tokenizer model pyggml lacks
SUPPORTED = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm", "mpt",
             "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
UNSUPPORTED = {"bert-bge": "bert", "gemma-4": "gemma4"}


@pytest.fixture(scope="module")
def vocabs():
    return vocab_dir()


def test_every_vocabulary_with_vectors_is_covered(vocabs):
    have = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in vocabs.glob("ggml-vocab-*.gguf.inp")}
    assert have == set(SUPPORTED) | set(UNSUPPORTED)


@pytest.mark.parametrize("name", SUPPORTED)
def test_llama_cpps_vectors(vocabs, name):
    path = vocabs / f"ggml-vocab-{name}.gguf"
    tk = Tokenizer(GGUFFile(path))
    cases = vectors(path)
    assert len(cases) >= 40
    wrong = [(text, tk.tokenize(text, add_bos=False), want) for text, want in cases
             if tk.tokenize(text, add_bos=False) != want]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]}"


@pytest.mark.parametrize("name, model", UNSUPPORTED.items())
def test_unsupported_tokenizer_models_are_a_clear_error(vocabs, name, model):
    with pytest.raises(GGUFError, match=f"unsupported tokenizer model '{model}'"):
        Tokenizer(GGUFFile(vocabs / f"ggml-vocab-{name}.gguf"))


def test_an_unknown_pre_tokenizer_is_an_error_that_lists_the_known(vocabs, tmp_path, monkeypatch):
    f = GGUFFile(vocabs / "ggml-vocab-gpt-2.gguf")
    monkeypatch.setitem(f.metadata, "tokenizer.ggml.pre", "no-such-pre")
    with pytest.raises(GGUFError, match="'no-such-pre'.*known: .*deepseek-llm.*gpt-2"):
        Tokenizer(f)
    gpt2 = Tokenizer(f, pre_tokenizer="gpt-2")  # the explicit fallback
    text, want = vectors(vocabs / "ggml-vocab-gpt-2.gguf")[5]
    assert gpt2.tokenize(text, add_bos=False) == want


def test_the_table_has_the_names_the_issue_lists():
    for name in ("gpt-2", "deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "starcoder", "refact",
                 "command-r", "mpt", "qwen35", "gpt-4o", "tekken", "olmo", "dbrx", "stablelm2", "bloom", "chatglm-bpe"):
        assert name in PRE_TYPES, name
