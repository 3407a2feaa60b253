"""The benchmark scripts still run (they print figures; here only that they work end to end).

bench/gpu.py and bench/gpu_check.sh run on a lent GPU machine, where minutes are scarce:
their model writer and loader are exercised here on the CPU, and the shell script is parsed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_gpu_bench_model_writer_and_loader_on_the_cpu():
    r = run(sys.executable, "bench/gpu.py", "--device", "CPU", "--sizes", "tiny", "--prompt", "16", "--gen", "4")
    assert r.returncode == 0, r.stderr
    assert "llama tiny" in r.stdout and "generation" in r.stdout and "tokens/s" in r.stdout


def test_gpu_check_script_parses():
    for script in ("bench/gpu_check.sh", "bench/gpu_deps.sh"):
        r = run("bash", "-n", script)
        assert r.returncode == 0, r.stderr


def test_rpc_bench_runs():
    r = run(sys.executable, "bench/rpc.py", "--tokens", "4", "--rounds", "1", "--ctx", "64")
    assert r.returncode == 0, r.stderr
    assert "1 server, all layers" in r.stdout and "cached second load" in r.stdout
