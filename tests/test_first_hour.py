"""What a new user met in the first hour (issue 46), each fixed and held here: the server
names any model, logs a line per request and stops cleanly on Ctrl-C, a port in use is one
clear line, and the one-line errors say what is wrong."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.server.test_server import CHAT, HTTPServer


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_the_server_logs_each_request_and_stops_cleanly_on_ctrl_c(tmp_path):
    s = HTTPServer("-m", "smollm2", "-c", "512", "-np", "1", log_path=tmp_path / "server.log")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                       json={"messages": CHAT, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": "Once upon", "max_tokens": 2, "stream": True}) as streamed:
            assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
        assert httpx.post(s.url + "/v1/completions", json={"prompt": 5}, timeout=30).status_code == 400
    finally:
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(30)
        s.stop()
    log = (tmp_path / "server.log").read_text()
    assert code == 0 and "Aborted" not in log and "pyggml-server: stopped" in log, log[-2000:]
    lines = [x for x in log.splitlines() if "pyggml.server.access" in x]
    assert any("POST /v1/chat/completions 200" in x and "prompt + 3 generated tokens" in x for x in lines), lines
    assert any("POST /v1/completions 200" in x and "+ 2 generated tokens" in x for x in lines), lines
    assert any("POST /v1/completions 400" in x for x in lines), lines
    assert not any("/health" in x for x in lines), lines  # polled by monitors (and by HTTPServer): not logged


def test_a_port_in_use_is_one_clear_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli("pyggml.cli.server", "-m", "smollm2", "--port", str(port), timeout=60)
    assert r.returncode != 0 and f"port {port} is in use on 127.0.0.1; choose another with --port" in r.stderr
    assert "Errno" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_rpc_server_on_a_port_in_use_says_so_before_compiling():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli("pyggml.cli.rpc_server", "--port", str(port), timeout=60)
    assert r.returncode != 0 and f"port {port} is in use on 127.0.0.1; choose another with --port" in r.stderr
    assert "compil" not in (r.stdout + r.stderr).lower() and "Errno" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, says", [
    (["pyggml.cli.chat", "--show-devices", "--rpc", "localhost:99999"], "port 99999 is out of range (1..65535)"),
    (["pyggml.cli.chat", "-m", "smollm", "-p", "hi"], "nor a known model alias (smollm2, gemma3-270m)"),
    (["pyggml.cli.chat", "--list-devices", "--rpc", "127.0.0.1:9"], "127.0.0.1:9"),
])
def test_one_line_errors_say_what_is_wrong(args, says):
    r = run_cli(*args)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "devices:" not in r.stdout  # (nothing half-listed before the error)


@pytest.mark.parametrize("module", ["pyggml.cli.chat", "pyggml.cli.perplexity", "pyggml.cli.rpc_server",
                                    "pyggml.cli.server"])
def test_every_command_has_version_and_help(module):
    r = run_cli(module, "--version")
    assert r.returncode == 0 and "(pyggml) 0." in r.stdout, r.stdout + r.stderr
    r = run_cli(module, "--help")
    assert r.returncode == 0 and "Example" in r.stdout


def test_chat_flags_a_new_user_reaches_for():
    r = run_cli("pyggml.cli.chat", "--help")
    assert "--system-prompt" in r.stdout and "--list-devices" in r.stdout and "[default: 2048" in r.stdout
    r = run_cli("pyggml.cli.chat", "--list-devices")
    assert r.returncode == 0 and r.stdout.startswith("devices:") and "CPU" in r.stdout
    for module in ("pyggml.cli.rpc_server", "pyggml.cli.perplexity", "pyggml.cli.server"):  # both names, everywhere
        for flag in ("--show-devices", "--list-devices"):
            r = run_cli(module, flag)
            assert r.returncode == 0 and r.stdout.startswith("devices:"), (module, flag, r.stderr)
    r = run_cli("pyggml.cli.perplexity", "-m", "smollm2")
    assert r.returncode != 0 and "-f/--file" in r.stderr
    # -ngl 99 with no GPU and no --rpc: said once; the plan's sizes carry their unit
    r = run_cli("pyggml.cli.chat", "-m", "smollm2", "-ngl", "99", "--dry-run", "--system-prompt", "Be brief.")
    assert r.returncode == 0 and r.stderr.count("every layer runs on the CPU") == 1, r.stderr
    assert " MiB" in r.stdout and "weights" in r.stdout, r.stdout


def test_the_chat_banner_names_the_file_its_name_size_and_type():
    from tests.conftest import shared_model
    text = shared_model("smollm2").describe()
    assert text.startswith("SmolLM2-135M-Instruct.Q4_1.gguf (") and '"Smollm2 135M' in text
    assert "135M" in text and "Q4_1" in text and text.endswith("MiB)")


def test_a_model_without_a_chat_template_is_a_base_model():
    """Gemma 3 270M's file carries no chat template: -p continues the text as given (the
    README's example), interactive chat says so once, --chat-template picks a turn format."""
    from tests.conftest import shared_model
    text = "The three primary colours are"
    m = shared_model("gemma3-270m")
    m.context.clear()
    want = m.create_completion(text, max_tokens=8, temperature=0)["choices"][0]["text"]
    r = run_cli("pyggml.cli.chat", "-m", "gemma3-270m", "-p", text, "-n", "8", "--temp", "0")
    assert r.returncode == 0 and r.stdout == want + "\n", (r.stdout, want)
    r = subprocess.run([sys.executable, "-m", "pyggml.cli.chat", "-m", "gemma3-270m"], input="/exit\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.count("has no chat template") == 1, r.stderr
    r = run_cli("pyggml.cli.chat", "-m", "gemma3-270m", "-p", "Name three colours.", "-n", "4", "--temp", "0",
                "--chat-template", "gemma")
    assert r.returncode == 0 and "has no chat template" not in r.stderr
