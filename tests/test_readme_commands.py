"""The commands of the README and docs/ run as written, on their loopback ports: the RPC servers it starts are
started first (and stopped after), pyggml-server until it listens, every pyggml-chat and
pyggml-perplexity line to its end (an interactive one is told /exit).  Lines that need a GPU
are left out where there is none."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^    (pyggml-[\w-]+(?: .*?)?)(?:\s+#.*)?$")
TOOLS = {"pyggml-chat": "pyggml.cli.chat", "pyggml-perplexity": "pyggml.cli.perplexity",
         "pyggml-rpc-server": "pyggml.cli.rpc_server", "pyggml-server": "pyggml.cli.server"}


def readme_commands() -> list[list[str]]:
    out = []
    lines = [line for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
             for line in doc.read_text().splitlines()]
    for line in lines:
        m = LINE.match(line)
        if m:
            out.append(shlex.split(m.group(1), comments=True))
    return out


def has_cuda() -> bool:
    return any(d.get_type().name == "GPU" for d in __import__("pyggml.models.loader", fromlist=["x"]).default_devices())


def command(words: list[str]) -> list[str]:
    return [sys.executable, "-m", TOOLS[words[0]], *[str(Path(w).expanduser()) if w.startswith("~") else w
                                                     for w in words[1:]]]


def started(words: list[str], ready: str, log: Path, timeout: float = 180) -> subprocess.Popen:
    """A long-running command of the README, once it says ``ready`` (its log: ``log``)."""
    out = open(log, "w")
    p = subprocess.Popen(command(words), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while ready not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"{' '.join(words)} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return p


def stop(p: subprocess.Popen) -> int:
    import signal
    p.send_signal(signal.SIGINT)
    try:
        return p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def test_the_readme_commands_run_as_written(tmp_path):
    commands = readme_commands()
    assert sum(w[0] == "pyggml-rpc-server" for w in commands) >= 3 and len(commands) >= 15
    gpu = has_cuda()
    runnable = [w for w in commands if gpu or not any("CUDA" in x for x in w)]
    rpc_servers = []
    try:
        for i, words in enumerate(w for w in runnable if w[0] == "pyggml-rpc-server"):
            rpc_servers.append(started(words, "listening on", tmp_path / f"rpc{i}.log"))
        for i, words in enumerate(runnable):
            if words[0] == "pyggml-rpc-server":
                continue
            if words[0] == "pyggml-server":
                server = started(words, "listening on", tmp_path / f"server{i}.log")
                assert stop(server) == 0, (tmp_path / f"server{i}.log").read_text()[-2000:]
                continue
            r = subprocess.run(command(words), cwd=ROOT, input="/exit\n", capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, f"{' '.join(words)}: {r.stderr[-2000:]}"
            assert "Traceback" not in r.stderr, r.stderr
    finally:
        codes = [stop(p) for p in rpc_servers]
    assert codes == [0] * len(codes)
