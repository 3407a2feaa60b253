"""The benchmark scripts still run (they print figures; here only that they work end to end).

bench/gpu.py and bench/gpu_check.sh run on a lent GPU machine, where minutes are scarce:
their model writer and loader are exercised here on the CPU, and the whole of gpu_check.sh is
rehearsed on the CUDA emulator (tests/cuda/; small shapes, figures meaningless).
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda import emulator

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def test_gpu_bench_model_writer_and_loader_on_the_cpu():
    r = run(sys.executable, "bench/gpu.py", "--device", "CPU", "--sizes", "tiny", "--prompt", "16", "--gen", "4")
    assert r.returncode == 0, r.stderr
    assert "llama tiny" in r.stdout and "generation" in r.stdout and "tokens/s" in r.stdout


def test_gpu_check_script_parses():
    for script in ("bench/gpu_check.sh", "bench/gpu_deps.sh"):
        r = run("bash", "-n", script)
        assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not emulator.available, reason="no C++ compiler for the CUDA emulator")
def test_gpu_check_rehearsed_on_the_emulated_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYGGML_NO_CUDA"}
    env.update(PYGGML_PYTHON=sys.executable, OUT=str(tmp_path), TMPDIR=str(tmp_path), SIZES="tiny",
               TEST_SELECT="not real_model", OPS_SELECT="CUDA and (MUL_MAT-Q4_0 or sinks)", BENCH_ARGS="--kernel-shapes 64x512 --iters 2 --copy-mib 8 --prompt 40 --gen 4",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "cuda" / "fake"), env.get("PYTHONPATH")])))
    r = run("bash", "bench/gpu_check.sh", timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    summary = r.stdout[r.stdout.index("== summary"):]
    assert "passed" in summary and "failed" not in summary, summary
    assert "backend ops: " in summary, summary
    assert "device copy bandwidth" in summary and "(pyggml CUDA emulator)" in summary
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        assert f"{name} " in summary and "of copy bandwidth" in summary, summary
    assert "llama tiny" in summary and "on CUDA0" in summary and "tests exit 0, bench exit 0" in summary
    assert "decode profile" in summary and "MUL_MAT" in summary


@pytest.mark.skipif(not emulator.available, reason="no C++ compiler for the CUDA emulator")
def test_gpu_launch_count_bench_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "cuda" / "fake"),
                                                                      os.environ.get("PYTHONPATH")])))
    r = run(sys.executable, "bench/gpu_launches.py", "--host-time", env=env)
    assert r.returncode == 0, r.stderr
    assert "device operations per decoded token" in r.stdout and "MUL_MAT" in r.stdout
    # the three ways a step runs, the last one a single launch (the captured CUDA graph)
    assert "op table:" in r.stdout and "launches:" in r.stdout and "CUDA graph:" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("1 device operations launched"), r.stdout


def test_rpc_bench_runs():
    r = run(sys.executable, "bench/rpc.py", "--tokens", "4", "--rounds", "1", "--ctx", "64")
    assert r.returncode == 0, r.stderr
    assert "1 server, all layers" in r.stdout and "cached second load" in r.stdout


def test_ggml_rpc_bench_runs():
    from tests.rpc.rpc_helpers import llamacpp_tool
    llamacpp_tool("llama-bench"), llamacpp_tool("ggml-rpc-server")
    r = run(sys.executable, "bench/ggml_rpc.py", "--tokens", "4", "--prompt", "8", "--rounds", "1")
    assert r.returncode == 0, r.stderr
    assert "ratio ours / llama.cpp" in r.stdout and "ratio llama.cpp server / ours" in r.stdout


def test_rpc_bench_pipeline_runs():
    r = run(sys.executable, "bench/rpc.py", "--pipeline", "--rounds", "1", "--prompt-tokens", "80",
            "--sequences", "8", "--decode-steps", "2")
    assert r.returncode == 0, r.stderr
    assert "micro-batches of 64" in r.stdout and r.stdout.count("pipelining:") == 2, r.stdout
    assert "decode steps of 8 sequences" in r.stdout and "groups of sequences" in r.stdout, r.stdout


def test_rpc_bench_runs_a_mixture_of_experts_without_a_tokenizer(tmp_path):
    """--synthetic-moe's path (token ids into a context, three placements), on a tiny qwen3moe
    in place of the ~1B one that the benchmark writes."""
    from tests.models.synthetic import Shape, random_weights, write_model
    s = Shape()
    path = write_model(tmp_path / "moe.gguf", "qwen3moe", s, random_weights("qwen3moe", s, seed=3))
    r = run(sys.executable, "bench/rpc.py", "--synthetic-moe", str(path), "--tokens", "4", "--rounds", "1",
            "--ctx", "64")
    assert r.returncode == 0, r.stderr
    rows = {line.split("  ")[0]: line.split() for line in r.stdout.splitlines()}
    assert float(rows["2 servers, split"][3]) > 0 and float(rows["1 server, all layers"][-1]) > 0, r.stdout


def test_generate_bench_runs_with_rounds_and_profile():
    r = run(sys.executable, "bench/generate.py", "--models", "smollm2", "-n", "4", "--prompt-tokens", "16",
            "--rounds", "2", "--profile", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "smollm2" in r.stdout and "the spread of 2 rounds" in r.stdout
    assert "smollm2 profile" in r.stdout and "MUL_MAT" in r.stdout and "outside them" in r.stdout


def test_scale_bench_runs_and_its_layouts_agree():
    """bench/scale.py end to end on SmolLM2: three layouts, and the logits of each are one
    server's (it prints DIFFER otherwise)."""
    r = run(sys.executable, "bench/scale.py", "--model", "smollm2", "--tokens", "2", "--prompt", "16",
            "--streams", "2", "--stream-tokens", "2", "--rounds", "2", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "two servers, tensor split" in r.stdout and "DIFFER" not in r.stdout, r.stdout
    assert r.stdout.count("bit-identical") == 3, r.stdout
    assert "2 concurrent streams through pyggml-server" in r.stdout, r.stdout
    assert "medians of 2 rounds" in r.stdout and "largest over smallest round" in r.stdout, r.stdout


def test_write_docs_puts_a_dated_section_under_its_command_and_replaces_it(tmp_path):
    """--write-docs: what the run printed goes into the page under the command (without the
    flag), dated; the same command again replaces its section, another command adds one."""
    page = tmp_path / "performance.md"
    page.write_text("# Performance figures\n\nBy hand.\n")
    env = {**os.environ, "PYGGML_PERF_DOC": str(page)}
    for types in ("Q4_0", "Q4_0", "Q8_0"):
        r = run(sys.executable, "bench/matmul.py", "--types", types, "--min-time", "0.01", "--write-docs", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"written into {page}" in r.stderr
    text = page.read_text()
    assert text.startswith("# Performance figures\n\nBy hand.\n")  # what was there stays
    assert text.count("<!-- bench: python bench/matmul.py --types Q4_0 --min-time 0.01 -->") == 1
    assert text.count("<!-- bench: python bench/matmul.py --types Q8_0 --min-time 0.01 -->") == 1
    assert text.count("## Written by the benchmarks") == 1
    section = text.split("--types Q4_0 --min-time 0.01 -->", 1)[1].split("<!-- end bench -->", 1)[0]
    assert f"{datetime.date.today().isoformat()}, at " in section and "Q4_0" in section and "GB/s" in section
