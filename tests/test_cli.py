"""pyggml-chat and pyggml-perplexity as real processes."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import reference


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


def test_the_weights_memory_map_on_and_off_give_one_answer(smollm2_path):
    """--mmap keeps the weights in the file's map, --no-mmap reads them in the layers' order."""
    answers = [run("chat", "-m", str(smollm2_path), flag, "-p", "Name the capital of France.", "--temp", "0", "-n", "12")
               for flag in ("--mmap", "--no-mmap")]
    for r in answers:
        assert r.returncode == 0, r.stderr
    assert "Paris" in answers[0].stdout and answers[0].stdout == answers[1].stdout


def test_interactive_chat_until_exit(smollm2_path):
    r = run("chat", "-m", str(smollm2_path), "--temp", "0", "-n", "8", stdin="Hello!\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("> ") and r.stdout.count("> ") == 2


def test_errors_are_one_line(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    for args, needle in ((["-m", str(tmp_path / "missing.gguf")], "no such file"),
                         (["-m", str(junk)], "not a GGUF file"),
                         (["--rpc", "127.0.0.1:1"], "RPC[127.0.0.1:1]"),
                         (["--rpc", "localhost:http"], "bad RPC endpoint"),
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


def test_chat_through_rpc_servers(rpc_pair, smollm2_path):
    endpoints = ";".join(s.endpoint for s in rpc_pair)
    r = run("chat", "--rpc", endpoints, "--show-devices")
    assert r.returncode == 0, r.stderr
    for i, s in enumerate(rpc_pair):
        assert f"{i}: RPC[{s.endpoint}]" in r.stdout
    assert "2: CPU" in r.stdout
    args = ["-m", str(smollm2_path), "-p", "Name the capital of France.", "--temp", "0", "-n", "16"]
    local = run("chat", *args)
    remote = run("chat", *args, "--rpc", endpoints, "-ngl", "0:prolog,epilog;1:all")
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and "Paris" in remote.stdout


def test_rpc_server_command_line(start_server, tmp_path):
    r = run("rpc_server", "--list-devices")
    assert r.returncode == 0 and "device 0: CPU" in r.stdout
    r = run("rpc_server", "--device", "GPU7", "-p", "0")
    assert r.returncode == 1 and "unknown device 'GPU7'" in r.stderr and "Traceback" not in r.stderr
    r = run("rpc_server", "--help")
    assert r.returncode == 0 and "--gen-key" in r.stdout and "--key" in r.stdout and "--mem" in r.stdout
    s = start_server("--mem", "100", "--threads", "1")
    assert "protocol version" in s.banner[0] and "100 MiB" in s.banner[1]
    s = start_server("0@0")  # chatllm.cpp's PORT@DEVICE form
    assert "device 0: CPU" in s.banner[1]


def test_rpc_server_warns_when_reachable_from_the_network():
    import subprocess as sp
    p = sp.Popen([sys.executable, "-m", "pyggml.cli.rpc_server", "--host", "0.0.0.0", "-p", "0"],
                 stdout=sp.PIPE, stderr=sp.PIPE, text=True)
    try:
        line = p.stderr.readline()
        assert "WARNING" in line and "reachable from the network" in line
    finally:
        p.terminate()
        p.wait(10)


def test_chat_reports_a_server_killed_mid_answer(start_server, smollm2_path):
    import os
    import select
    import signal
    import time
    server = start_server()
    code = "import sys; from pyggml.cli.chat import main; sys.argv[0] = 'pyggml-chat'; main()"
    p = subprocess.Popen([sys.executable, "-c", code, "-m", str(smollm2_path), "--rpc", server.endpoint, "-ngl", "all",
                          "-p", "Tell me a very long story about a dragon.", "-n", "1000", "--temp", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert select.select([p.stdout], [], [], 120)[0], "no answer started"
        os.read(p.stdout.fileno(), 1)  # the answer is streaming
        server.kill(signal.SIGKILL)
        t0 = time.monotonic()
        p.wait(30)
        assert time.monotonic() - t0 < 5
    finally:
        p.kill()
    err = p.stderr.read().decode()
    assert p.returncode == 1 and f"RPC[{server.endpoint}]" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_rpc_server_listen_forms():
    from pyggml.cli.rpc_server import parse_listen, parse_size
    assert parse_listen("8080") == (None, 8080, None)
    assert parse_listen("8080@1") == (None, 8080, 1)
    assert parse_listen("127.0.0.1:9000@1") == ("127.0.0.1", 9000, 1)
    assert parse_size("512") == 512 << 20 and parse_size("2G") == 2 << 30 and parse_size("1.5GiB") == 3 << 29


def test_poll_sets_how_long_idle_threads_spin(monkeypatch):
    """--poll (pyggml-server's, pyggml-rpc-server's) becomes libgomp's spin count, set before
    numba starts its threads (libgomp reads it once); a GOMP_SPINCOUNT of the user's own wins."""
    from pyggml.cli.common import SPINS_PER_POLL, set_poll
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    set_poll(500)
    assert os.environ["GOMP_SPINCOUNT"] == str(500 * SPINS_PER_POLL)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    set_poll(0)
    assert os.environ["GOMP_SPINCOUNT"] == "7"
    helptext = subprocess.run([sys.executable, "-m", "pyggml.cli.server", "--help"], capture_output=True, text=True).stdout
    assert "--poll" in helptext and "[default:" in helptext and "500;" in " ".join(helptext.split())
