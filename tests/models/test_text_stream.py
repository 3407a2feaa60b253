"""The text stream of completions: pieces that join to exactly the tokens' text (both
tokenizer kinds, characters split across tokens, control tokens inside), stop strings never
in the output and cut where they begin."""
from __future__ import annotations

import pytest

from pyggml.gguf import GGUFFile
from pyggml.models.completion import TextStream
from pyggml.models.tokenizer import Tokenizer

from tests.conftest import shared_model
from tests.models.llama_vocab import vocab_dir

# byte-level BPE, SentencePiece without and with the prefixed space (which detokenizing drops
# at the start of a text: a stream that decoded only the newest ids would lose spaces)
TOKENIZERS = ["smollm2", "gemma3-270m", "llama-spm"]


def tokenizer(name: str) -> Tokenizer:
    if name == "llama-spm":
        return Tokenizer(GGUFFile(vocab_dir() / "ggml-vocab-llama-spm.gguf"))
    return shared_model(name).tokenizer

TEXT = ("Once upon a time 🦙 in Köln, naïve café, 東京 and  two  spaces\n\ttab, "
        "then a dragon baked bread. ") * 12


@pytest.mark.parametrize("alias", TOKENIZERS)
def test_pieces_join_to_the_whole_text(alias):
    tk = tokenizer(alias)
    ids = tk.tokenize(TEXT, add_bos=False)
    for cut in (1, 2, 7, len(ids)):
        stream = TextStream(tk, [])
        pieces = [stream.push(t) for t in ids[:cut]]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + stream.flush() == tk.detokenize(ids[:cut])


@pytest.mark.parametrize("alias", TOKENIZERS)
def test_control_tokens_inside_leave_the_text_as_detokenize_gives_it(alias):
    tk = tokenizer(alias)
    control = next(iter(tk.control.values()))
    ids = tk.tokenize("Hello there", add_bos=False) + [control] + tk.tokenize(" world again", add_bos=False)
    stream = TextStream(tk, [])
    assert "".join(stream.push(t) for t in ids) + stream.flush() == tk.detokenize(ids)


@pytest.mark.parametrize("alias", TOKENIZERS)
def test_stop_strings_cut_the_text_where_they_begin(alias):
    tk = tokenizer(alias)
    ids = tk.tokenize(TEXT, add_bos=False)
    whole = tk.detokenize(ids)
    for stop in ("dragon", "café,", "東京", "bread. Once"):
        stream = TextStream(tk, ["never-there", stop])
        out = ""
        for t in ids:
            out += stream.push(t)
            if stream.stopped:
                break
        assert stream.stopped and out == whole[:whole.index(stop)], stop
