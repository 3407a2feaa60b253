"""pyggml-chat and pyggml-perplexity as real processes."""
from __future__ import annotations

import subprocess
import sys

from .conftest import reference


def run(tool: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    code = f"import sys; from pyggml.cli.{tool} import main; sys.argv[0] = 'pyggml-{tool}'; main()"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_one_answer(smollm2_path):
    r = run("chat", "-m", str(smollm2_path), "-p", "Name the capital of France.", "--temp", "0", "-n", "16",
            "--timings")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "generation:" in r.stderr and "tokens/s" in r.stderr


def test_interactive_chat_until_exit(smollm2_path):
    r = run("chat", "-m", str(smollm2_path), "--temp", "0", "-n", "8", stdin="Hello!\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("> ") and r.stdout.count("> ") == 2


def test_errors_are_one_line(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    for args, needle in ((["-m", str(tmp_path / "missing.gguf")], "no such file"),
                         (["-m", str(junk)], "not a GGUF file"),
                         (["--rpc", "8080"], "not available"),
                         (["-ngl", "3:all"], "unknown device id 3")):
        r = run("chat", *args, "-p", "hi")
        assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1


def test_show_devices():
    r = run("chat", "--show-devices")
    assert r.returncode == 0 and "0: CPU" in r.stdout


def test_perplexity(tmp_path, smollm2_path):
    from pyggml.gguf import GGUFFile
    from pyggml.models import Tokenizer
    text = Tokenizer(GGUFFile(smollm2_path)).detokenize(reference("smollm2")["text"]["tokens"])
    f = tmp_path / "license.txt"
    f.write_text(text)
    r = run("perplexity", "-m", str(smollm2_path), "-f", str(f), "-c", "128")
    assert r.returncode == 0, r.stderr
    ppl = float(r.stdout.split("Final estimate: PPL = ")[1].split()[0])
    assert 5 < ppl < 40  # llama.cpp: 15.9 over all 384 tokens of this text
