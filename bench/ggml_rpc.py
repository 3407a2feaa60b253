"""ggml-rpc benchmark: llama.cpp's RPC protocol both ways, beside llama.cpp's own server.

Prints, for SmolLM2 with every layer on one server (each server pinned to a core of its own
with one thread, the client to another):

- llama.cpp's ``llama-bench --rpc`` against ``pyggml-rpc-server --protocol ggml`` and against
  llama.cpp's ``ggml-rpc-server``: prompt and generation tokens/s, and the ratio;
- pyggml (``--rpc ggml://``) against llama.cpp's ``ggml-rpc-server``, beside pyggml against
  ``pyggml-rpc-server`` (our protocol): generation tokens/s, and the ratio.

    python bench/ggml_rpc.py [--llama-cpp BIN_DIR] [--tokens 32] [--prompt 64] [--rounds 3]

``BIN_DIR`` holds llama.cpp's ``llama-bench`` and ``ggml-rpc-server`` (``../shared/bin/build-llamacpp``
builds them; reference tools, never dependencies).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyggml as pg  # noqa: E402
from tests.rpc.rpc_helpers import ServerProcess, free_port  # noqa: E402
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

CORES = os.cpu_count() or 1


def pinned(core: int) -> tuple[str, ...]:
    return ("taskset", "-c", str(core % CORES))


def llama_server(bin_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*pinned(1), str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc, f"127.0.0.1:{port}"


def llama_bench(bin_dir: Path, model: str, endpoint: str, prompt: int, tokens: int, rounds: int) -> tuple[float, float]:
    r = subprocess.run([*pinned(0), str(bin_dir / "llama-bench"), "-m", model, "--rpc", endpoint, "-ngl", "99",
                        "-t", "1", "-p", str(prompt), "-n", str(tokens), "-r", str(rounds), "-o", "json"],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr[-1000:]}")
    rows = json.loads(r.stdout)
    pp = next(x["avg_ts"] for x in rows if x["n_prompt"] > 0)
    tg = next(x["avg_ts"] for x in rows if x["n_gen"] > 0)
    return pp, tg


def pyggml_decode(endpoint: str, tokens: int, rounds: int) -> float:
    """Generation tokens/s of SmolLM2 with every layer on the server at ``endpoint`` (medians)."""
    os.sched_setaffinity(0, {0})
    with pg.Model("smollm2", n_ctx=512, rpc=endpoint, progress=False) as m:
        ids = m.tokenize("Write a short story about a lighthouse keeper.")
        ctx = m.context
        rates = []
        for r in range(rounds + 1):  # (the first round warms: graphs built, kernels compiled)
            ctx.clear()
            ctx.decode(ids)
            t0 = time.perf_counter()
            for i in range(tokens):  # one token a step, its logits read back, as generation does
                ctx.decode([ids[i % len(ids)]])
            if r:
                rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("~/.cache/llama.cpp-ref/build/bin").expanduser())
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    perfdoc.add_argument(ap)
    a = ap.parse_args()
    perfdoc.start(a)
    from pyggml.models import hub
    model = str(hub.fetch("smollm2"))
    ours = ServerProcess("--protocol", "ggml", "-t", "1", prefix=pinned(1))
    try:
        pp_ours, tg_ours = llama_bench(a.llama_cpp, model, ours.endpoint, a.prompt, a.tokens, a.rounds)
    finally:
        ours.stop()
    proc, theirs = llama_server(a.llama_cpp)
    try:
        pp_theirs, tg_theirs = llama_bench(a.llama_cpp, model, theirs, a.prompt, a.tokens, a.rounds)
        over_llama = pyggml_decode("ggml://" + theirs, a.tokens, a.rounds)
    finally:
        proc.kill()
    ours = ServerProcess("-t", "1", prefix=pinned(1))
    try:
        over_ours = pyggml_decode(ours.endpoint, a.tokens, a.rounds)
    finally:
        ours.stop()
    print(f"SmolLM2, every layer on one server (-t 1, pinned), {a.prompt}-token prompt, {a.tokens} generated\n")
    print(f"{'client':<12} {'server':<34} {'prompt t/s':>11} {'gen t/s':>8}")
    print(f"{'llama-bench':<12} {'pyggml-rpc-server --protocol ggml':<34} {pp_ours:>11.1f} {tg_ours:>8.1f}")
    print(f"{'llama-bench':<12} {'llama.cpp ggml-rpc-server':<34} {pp_theirs:>11.1f} {tg_theirs:>8.1f}")
    print(f"{'':<12} {'ratio ours / llama.cpp':<34} {pp_ours / pp_theirs:>11.2f} {tg_ours / tg_theirs:>8.2f}\n")
    print(f"{'pyggml':<12} {'llama.cpp ggml-rpc-server (ggml://)':<34} {'':>11} {over_llama:>8.1f}")
    print(f"{'pyggml':<12} {'pyggml-rpc-server (our protocol)':<34} {'':>11} {over_ours:>8.1f}")
    print(f"{'':<12} {'ratio llama.cpp server / ours':<34} {'':>11} {over_llama / over_ours:>8.2f}")


if __name__ == "__main__":
    main()
