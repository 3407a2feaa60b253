"""Serving benchmark: aggregate throughput and latency of pyggml-server under concurrent streams.

Starts ``pyggml-server`` (and, with ``--llama-server PATH``, llama.cpp's ``llama-server`` on
the same model, threads, context and slot count), then for 1, 2, 4 and 8 concurrent
clients streams chat completions and prints: aggregate generated tokens/s, time to first
token and inter-token latency (p50, p99), the speedup over one stream, and the ratio to
llama-server's aggregate.

    python bench/serve.py [--model smollm2 --model gemma3-270m] [--tokens 64] [--llama-server BIN]
    python bench/serve.py --model smollm2 --profile   # and where pyggml's steps spent their time
    python bench/serve.py --rounds 3 --llama-server BIN # each figure's median over 3 rounds

``--profile`` reads pyggml-server's /metrics before and after each level and prints, per step:
admission and batching, decoding (of which graphs of new batch shapes), sampling and text,
then the steps by wall time, the slowest one and the garbage collector's pauses.

Every request asks for exactly ``--tokens`` tokens (``ignore_eos`` is not in OpenAI's API,
so the prompts ask for long answers and the counts come from the usage the server reports).
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyggml.models import hub  # noqa: E402
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain in detail how bread is made.",
           "Describe a journey across the ocean.", "Tell me about the history of clocks.",
           "Write a long letter to a friend about autumn.", "Explain how rivers shape valleys.",
           "Describe a busy market in the morning.", "Tell a tale of a dragon and a baker."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd: list[str], url: str, log: Path) -> None:
        self.url, self.log = url, log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"{cmd[0]} did not become healthy: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_stream(url: str, prompt: str, n: int, out: list) -> None:
    times, tokens = [], 0
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    client = httpx.Client(timeout=600)  # made before the clock starts: a client's setup (~30 ms) is not the server's
    t0 = time.perf_counter()
    with client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    out.append((t0, times, tokens))


def measure(url: str, concurrency: int, n: int, tag: str = "") -> dict:
    """``concurrency`` streams of ``n`` tokens at once, the i-th asking PROMPTS[i] (+ ``tag``)."""
    results: list = []
    threads = [threading.Thread(target=one_stream, args=(url, PROMPTS[i % len(PROMPTS)] + tag, n, results))
               for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [ts[0] - start for start, ts, _ in results if ts]
    itl = [b - a for _, ts, _ in results for a, b in zip(ts, ts[1:])]
    total = sum(tok for _, _, tok in results)

    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))
    return {"tok_s": total / wall, "tokens": total, "ttft50": pct(ttft, 50), "ttft99": pct(ttft, 99),
            "itl50": pct(itl, 50), "itl99": pct(itl, 99)}


def scrape(url: str) -> dict[str, float]:
    """pyggml-server's /metrics as {"name{label=value}": value}."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def profile_line(before: dict[str, float], after: dict[str, float]) -> str:
    """Where the steps between two scrapes spent their time, per step."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)
    steps = d("pyggml_decode_steps_total") or float("nan")
    ms = {p: 1e3 * d(f"pyggml_step_phase_seconds_total{{phase={p}}}") / steps
          for p in ("schedule", "decode", "graph", "sample")}
    bounds = sorted({k.split("le=")[1].rstrip("}") for k in after if k.startswith("pyggml_step_seconds_bucket")},
                    key=float)
    counts = [d(f"pyggml_step_seconds_bucket{{le={b}}}") for b in bounds]
    hist = ", ".join(f"<={float(b) * 1e3:g}ms {n - p:.0f}" for b, n, p in zip(bounds, counts, [0.0] + counts[:-1])
                     if n - p and b != "+Inf")
    over = counts[-1] - counts[-2] if len(counts) > 1 else 0
    gc_ms = 1e3 * sum(d(f"pyggml_gc_pause_seconds_total{{generation={g}}}") for g in range(3))
    gc_n = sum(d(f"pyggml_gc_collections_total{{generation={g}}}") for g in range(3))
    return (f"  profile: {steps:.0f} steps, per step {ms['schedule']:.1f} ms batching, {ms['decode']:.1f} ms decoding "
            f"({d('pyggml_graph_builds_total'):.0f} new graphs, {d('pyggml_graph_builds_decoding_total'):.0f} of them "
            f"in steps with no prompt, {d('pyggml_graph_builds_streaming_total'):.0f} in steps of generating streams: "
            f"{ms['graph']:.1f} ms a step; {d('pyggml_graph_parts_beside_total'):.0f} graph parts prepared "
            f"between steps; {d('pyggml_mixed_steps_total'):.0f} steps read prompts beside streams, "
            f"{d('pyggml_prompts_answered_total'):.0f} prompts answered from a stored row), "
            f"{ms['sample']:.1f} ms sampling and text; steps by time: {hist}"
            f"{f', over the last bound {over:.0f}' if over else ''}; slowest so far "
            f"{1e3 * after.get('pyggml_slowest_step_seconds', 0):.0f} ms; gc {gc_ms:.0f} ms in {gc_n:.0f} collections")


def graphs_built(url: str, timeout: float = 120) -> None:
    """Wait until pyggml-server has built its decoding steps' graphs (it does while idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and scrape(url).get("pyggml_graphs_to_build_ahead", 0) > 0:
        time.sleep(0.2)


def run(name: str, url: str, levels: list[int], n: int, profile: bool = False, log: Path | None = None,
        pyggml: bool = False, rounds: int = 1) -> dict[int, dict]:
    """Each level measured ``rounds`` times in turn (1, 2, 4, 8, then again): per level, the
    median of each figure over the rounds.  Every round asks prompts of its own (a tag after
    each: a round after the first would find them all cached) after a warm-up of its own, so
    that each round sees what the first sees: the first prompt cached, the others new."""
    if pyggml:
        graphs_built(url)
    runs: dict[int, list[dict]] = {}
    for k in range(rounds):
        tag = f" (take {k + 1})" if k else ""
        measure(url, 1, 8, tag)  # warm-up: kernels compiled, graphs built, the first prompt read
        for c in levels:
            runs.setdefault(c, []).append(level(name, url, c, n, profile, log, tag))
    if rounds == 1:
        return {c: rs[0] for c, rs in runs.items()}
    rows = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    for c, r in rows.items():
        print_level(f"{name} median", c, r)
    return rows


def print_level(name: str, c: int, r: dict) -> None:
    print(f"{name:<13} {c:>3} streams: {r['tok_s']:7.1f} tok/s aggregate ({r['tokens']:.0f} tokens)  "
          f"TTFT p50 {r['ttft50'] * 1e3:6.0f} ms p99 {r['ttft99'] * 1e3:6.0f} ms  "
          f"ITL p50 {r['itl50'] * 1e3:6.1f} ms p99 {r['itl99'] * 1e3:6.1f} ms", flush=True)


def level(name: str, url: str, c: int, n: int, profile: bool, log: Path | None, tag: str = "") -> dict:
    """One level: ``c`` concurrent streams of ``n`` tokens; printed, with the profile if asked."""
    before = scrape(url) if profile else {}
    log_start = log.stat().st_size if profile and log else 0
    r = measure(url, c, n, tag)
    print_level(name, c, r)
    if profile:
        print(profile_line(before, scrape(url)), flush=True)
        if log is not None:  # the server's own account of its slow steps (--log-level debug)
            with open(log, errors="replace") as f:
                f.seek(log_start)
                slow = [line.split("slow step: ", 1)[1].rstrip() for line in f if "slow step: " in line]
            for line in slow[:8]:
                print(f"    {line}")
            if len(slow) > 8:
                print(f"    ... {len(slow) - 8} more slow steps")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="alias or GGUF path (repeatable; default: both test models)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--parallel", type=int, default=8, help="slots (-np)")
    ap.add_argument("--levels", default="1,2,4,8", help="concurrent streams to measure")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary")
    ap.add_argument("--profile", action="store_true", help="print where pyggml's steps spent their time")
    ap.add_argument("--prompt-chunk", type=int, default=None, help="pyggml-server's --prompt-chunk (default: its own)")
    ap.add_argument("--rounds", type=int, default=1, help="measure the levels in turn this many times and compare "
                                                          "each figure's median (this machine's speed drifts, and "
                                                          "both servers' latencies move between runs)")
    perfdoc.add_argument(ap)
    args = ap.parse_args()
    perfdoc.start(args)
    levels = [int(x) for x in args.levels.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    for alias in args.model or ["smollm2", "gemma3-270m"]:
        path = hub.resolve(alias)
        print(f"== {path.name}: {args.tokens} tokens per request, {args.parallel} slots, {args.threads} threads, "
              f"context {args.ctx}")
        port = free_port()
        ours = Server([sys.executable, "-m", "pyggml.cli.server", "-m", str(path), "--port", str(port),
                       "-c", str(args.ctx), "-np", str(args.parallel), "-t", str(args.threads),
                       *(["--prompt-chunk", str(args.prompt_chunk)] if args.prompt_chunk is not None else []),
                       *(["--log-level", "debug"] if args.profile else [])],
                      f"http://127.0.0.1:{port}", logs / f"pyggml-{path.stem}.log")
        try:
            mine = run("pyggml", ours.url, levels, args.tokens, args.profile, ours.log, pyggml=True,
                       rounds=args.rounds)
        finally:
            ours.stop()
        base = mine[levels[0]]["tok_s"]
        print("pyggml scaling: " + ", ".join(f"{c}: {mine[c]['tok_s'] / base:.2f}x" for c in levels))
        if args.llama_server:
            port = free_port()
            theirs = Server([args.llama_server, "-m", str(path), "--port", str(port), "-c", str(args.ctx),
                             "-np", str(args.parallel), "-t", str(args.threads), "--no-webui",
                             "--kv-unified"],
                            f"http://127.0.0.1:{port}", logs / f"llama-{path.stem}.log")
            try:
                ref = run("llama-server", theirs.url, levels, args.tokens, rounds=args.rounds)
            finally:
                theirs.stop()
            for label, key in (("aggregate", "tok_s"), ("ITL p99", "itl99"), ("TTFT p50", "ttft50")):
                print(f"pyggml / llama-server {label}: " +
                      ", ".join(f"{c}: {mine[c][key] / ref[c][key]:.2f}" for c in levels))
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
