"""Prompt and generation speed of real models, and peak memory (prints figures; asserts nothing).

For each model: prompt processing tokens/s (a 128-token prompt: the mean of 3 passes after a
first one, as llama-bench measures; the first pass, in which pyggml builds the graph and plan of a
new prompt length, in the last column), generation tokens/s
(greedy, 64 tokens), peak resident memory, and the part of it the model accounts for against
the GGUF size plus the KV cache: the peak less what the engine's process holds before it loads
a model (the interpreter, numpy, numba, its JIT and our kernels, tokenizers, jinja2;
llama-cpp-python and its libraries).  When
llama-cpp-python happens to be installed (it is not a dependency), the same figures for
llama.cpp on the same machine and thread count, and the ratio.  Each engine runs in its
own process so that peak memory is its own.

    python bench/generate.py [--models smollm2,gemma3-270m] [--threads 2] [-n 64]
    python bench/generate.py --synthetic-moe --llama-bench ~/.cache/llama.cpp-ref/build/bin/llama-bench
    python bench/generate.py --models "" --synthetic-moe gpt-oss --llama-bench ~/.cache/llama.cpp-ref/build/bin/llama-bench
    python bench/generate.py --models smollm2 --profile   # + time per op kind, and outside the kernels
    python bench/generate.py --rounds 3                   # medians of 3 runs, and their spread

``--synthetic-moe`` adds a ~1B-parameter qwen3moe of random weights (24 layers, 32 experts of
which 4 run per token, Q4_0; written once into ~/.cache/pyggml/bench) - a mixture of experts
at the size people run on CPUs; ``--synthetic-moe gpt-oss`` a gpt-oss of that size instead
(MXFP4 experts with biases, attention sinks, YaRN, sliding windows on every other layer).  ``--llama-bench PATH`` (llama.cpp's own benchmark, e.g. from
``../shared/bin/build-llamacpp``; never a dependency) puts its prompt and generation figures
for the same files beside ours.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
MOE_FILE = Path("~/.cache/pyggml/bench/qwen3moe-1b-q4_0.gguf").expanduser()

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden press adapted from those used for wine. ") * 6


def resident() -> int:
    """Bytes resident now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


PROMPT_REPS = 3  # timed prompt passes after the first (llama-bench: a warm-up run, then the mean of its repetitions)


def timed_prompt(clear, decode) -> tuple[float, float]:
    """Seconds of a prompt's first pass (for pyggml, a new length builds its graph and plan
    then) and the mean of PROMPT_REPS passes after it, each from an empty cache (``clear``):
    llama-bench's measure, which leaves its warm-up run out."""
    times = []
    for _ in range(1 + PROMPT_REPS):
        clear()
        t0 = time.perf_counter()
        decode()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.fmean(times[1:])


def run_pyggml(alias: str, threads: int, n_gen: int, n_prompt: int, profile: bool = False) -> dict:
    import jinja2.sandbox  # noqa: F401 - the libraries tokenizers and chat templates use belong to the runtime
    import tokenizers  # noqa: F401

    import pyggml
    from pyggml.cpu import warm_up
    from pyggml.cpu.warmup import parts_for_file
    from pyggml.models.hub import resolve
    # numba's JIT, its threads and the model's CPU kernels loaded: the runtime, before any model
    warm_up(parts_for_file(resolve(alias)))
    runtime = resident()
    if Path(alias) == MOE_FILE or Path(alias) == synthetic_path("gpt-oss"):  # random vocabularies: no tokenizer
        return run_pyggml_untokenized(alias, threads, n_gen, n_prompt, runtime, profile)
    t0 = time.perf_counter()
    m = pyggml.Model(alias, n_ctx=1024, n_threads=threads, progress=False)
    load_s = time.perf_counter() - t0
    ids = (m.tokenize(PROMPT) + list(range(3, 3 + n_prompt)))[:n_prompt]  # (a synthetic vocabulary has few words)
    list(m.generate(ids[:8], max_tokens=4, temperature=0))  # compile the kernels of both paths first
    first, warm = timed_prompt(m.context.clear, lambda: m.context.decode(ids))
    m.context.clear()
    m.timings.reset()
    out = list(m.generate(ids, max_tokens=n_gen, temperature=0))
    t = m.timings
    tg = t.gen_tokens / t.gen_seconds if t.gen_seconds else float("nan")
    result = {"engine": "pyggml", "load_s": load_s, "prompt_tps": len(ids) / warm, "first_prompt_tps": len(ids) / first,
              "gen_tps": tg, "n_gen": len(out),
              "gguf_bytes": os.path.getsize(m.path), "kv_bytes": m.context.kv.nbytes(), "runtime_rss": runtime,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if profile:
        ctx = m.context

        def generation() -> None:
            top = ctx.decode(ids[-1:], n_top=1)
            for _ in range(n_gen - 1):
                top = ctx.decode([int(top.ids[0, 0])], n_top=1)
        result["profile"] = profiled(ctx, ids, generation, n_gen)
    return result


def profiled(ctx, ids: list[int], generation, n_gen: int) -> dict:
    """Per op kind, the seconds the CPU backends spent in each phase (the prompt; the generated
    tokens, ``generation``), beside the phase's wall time: what is not in a kernel is the
    per-step overhead (graph inputs, scheduling, reading results back)."""
    from pyggml.cpu import CPUBackend, OpProfile
    backends = [b for b in ctx.backends if isinstance(b, CPUBackend)]
    phases = {}
    ctx.clear()  # the prompt from an empty cache, then the generation after it
    for phase, run, steps in (("prompt", lambda: ctx.decode(ids), len(ids)), ("gen", generation, n_gen)):
        profiles = [OpProfile() for _ in backends]
        for b, p in zip(backends, profiles):
            b.profile = p
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
        for b in backends:
            b.profile = None
        seconds: dict[str, float] = {}
        calls: dict[str, int] = {}
        for p in profiles:
            for op, sec in p.seconds.items():
                seconds[op] = seconds.get(op, 0.0) + sec
                calls[op] = calls.get(op, 0) + p.calls[op]
        phases[phase] = {"wall_s": wall, "tokens": steps, "graphs": sum(p.graphs for p in profiles),
                         "seconds": seconds, "calls": calls}
    return phases


def print_profile(label: str, phases: dict) -> None:
    gen, prompt = phases["gen"], phases["prompt"]
    print(f"\n{label} profile: ms per generated token ({gen['tokens']} steps) and per prompt token "
          f"({prompt['tokens']}-token prompt), by op kind")
    print(f"  {'op':<16} {'gen ms':>8} {'calls':>6} {'us/call':>8} {'prompt ms':>10}")
    ops = sorted(set(gen["seconds"]) | set(prompt["seconds"]), key=lambda op: -gen["seconds"].get(op, 0.0))
    for op in ops:
        g, c = gen["seconds"].get(op, 0.0), gen["calls"].get(op, 0)
        per_call = f"{g / c * 1e6:>8.1f}" if c else f"{'':>8}"
        print(f"  {op:<16} {g / gen['tokens'] * 1e3:>8.3f} {c // max(1, gen['tokens']):>6} {per_call} "
              f"{prompt['seconds'].get(op, 0.0) / prompt['tokens'] * 1e3:>10.3f}")
    for name, phase in (("gen", gen), ("prompt", prompt)):
        kernels = sum(phase["seconds"].values())
        print(f"  {name}: {phase['wall_s'] / phase['tokens'] * 1e3:.3f} ms per token, of which kernels "
              f"{kernels / phase['tokens'] * 1e3:.3f} and outside them {(phase['wall_s'] - kernels) / phase['tokens'] * 1e3:.3f}"
              f" ({phase['graphs']} graphs)")


def run_pyggml_untokenized(path: str, threads: int, n_gen: int, n_prompt: int, runtime: int,
                           profile: bool = False) -> dict:
    """A model whose random vocabulary no tokenizer is built for: token ids straight into the
    context, greedy steps through the top-1 output (what generation reads back)."""
    from pyggml.cpu import configure_threads
    from pyggml.models import Context, load_model
    configure_threads(threads)
    t0 = time.perf_counter()
    ctx = Context(load_model(path, progress=False), n_ctx=1024)
    load_s = time.perf_counter() - t0
    ids = list(range(3, 3 + n_prompt))
    ctx.decode(ids[:8])
    ctx.decode([int(ctx.decode([5], n_top=1).ids[0, 0])], n_top=1)  # compile the kernels of both paths first
    first, warm = timed_prompt(ctx.clear, lambda: ctx.decode(ids, n_top=1))
    top = ctx.decode([5], n_top=1)
    t0 = time.perf_counter()
    for _ in range(n_gen):
        top = ctx.decode([int(top.ids[0, 0])], n_top=1)
    tg = n_gen / (time.perf_counter() - t0)
    result = {"engine": "pyggml", "load_s": load_s, "prompt_tps": n_prompt / warm, "first_prompt_tps": n_prompt / first,
              "gen_tps": tg, "n_gen": n_gen,
              "gguf_bytes": os.path.getsize(path), "kv_bytes": ctx.kv.nbytes(), "runtime_rss": runtime,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if profile:
        def generation() -> None:
            top = ctx.decode([5], n_top=1)
            for _ in range(n_gen - 1):
                top = ctx.decode([int(top.ids[0, 0])], n_top=1)
        result["profile"] = profiled(ctx, ids, generation, n_gen)
    return result


def run_llama_cpp(path: str, threads: int, n_gen: int, n_prompt: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    llama_cpp.llama_backend_init()
    runtime = resident()
    t0 = time.perf_counter()
    llm = Llama(path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode(), add_bos=True)[:n_prompt]
    first, warm = timed_prompt(llm.reset, lambda: llm.eval(ids))
    t0 = time.perf_counter()
    n = 0
    for _ in llm.generate(ids, temp=0.0, reset=True):
        n += 1
        if n == 1:
            t0 = time.perf_counter()  # the first token comes from the prompt pass
        if n > n_gen:
            break
    tg = (n - 1) / (time.perf_counter() - t0)
    return {"engine": "llama.cpp", "load_s": load_s, "prompt_tps": len(ids) / warm,
            "first_prompt_tps": len(ids) / first, "gen_tps": tg, "n_gen": n - 1,
            "gguf_bytes": os.path.getsize(path), "runtime_rss": runtime,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def synthetic_path(arch: str) -> Path:
    return MOE_FILE if arch == "qwen3moe" else MOE_FILE.with_name(f"synthetic-{arch}-1b.gguf")


def synthetic_moe(arch: str = "qwen3moe") -> Path:
    """The ~1B mixture of experts of random weights, qwen3moe (Q4_0) or gpt-oss (MXFP4 experts,
    the rest Q8_0), built once (a minute or two)."""
    path = synthetic_path(arch)
    if path.exists():
        return path
    sys.path.insert(0, str(ROOT))
    from tests.models.synthetic import Shape, random_weights, write_model
    s = Shape(n_embd=1024, n_layer=24, n_ff=1536, n_head=16, n_head_kv=4, n_vocab=32000, n_expert=32,
              n_expert_used=4, n_ff_exp=384)
    print(f"writing {path} (random weights, once) ...", flush=True)
    weights = random_weights(arch, s, seed=1, moe=True)
    experts = "MXFP4" if arch == "gpt-oss" else "Q4_0"
    types = {name: experts if "_exps." in name else "Q8_0" if arch == "gpt-oss" or "token_embd" in name
             or name == "output.weight" else "Q4_0"
             for name, v in weights.items() if v.ndim >= 2 and "gate_inp" not in name and name.endswith(".weight")}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    write_model(partial, arch, s, weights, types, vocab=True)
    partial.rename(path)
    return path


def model_file(alias: str) -> str:
    if os.path.exists(alias):
        return alias
    from pyggml.models import hub
    return str(hub.fetch(alias))


def run_llama_bench(binary: str, path: str, threads: int, n_gen: int, n_prompt: int) -> dict | None:
    """llama.cpp's own figures for one file: prompt and generation tokens/s (llama-bench -o json)."""
    r = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen), "-o", "json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        why = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        print(f"llama-bench failed on {path} ({why}): {r.stderr.strip().splitlines()[-1:]}")
        return None
    rows = json.loads(r.stdout)
    pp = next(row["avg_ts"] for row in rows if row.get("n_prompt") and not row.get("n_gen"))
    tg = next(row["avg_ts"] for row in rows if row.get("n_gen") and not row.get("n_prompt"))
    return {"engine": "llama-bench", "prompt_tps": pp, "gen_tps": tg}


def rounds_of(n: int, run) -> dict | None:
    """``run(i)`` for i < n (each a fresh process); the first round's figures, with prompt and
    generation tokens/s replaced by the medians and their ranges kept beside them."""
    runs = [r for r in (run(i) for i in range(n)) if r]
    if not runs:
        return None
    result = dict(runs[0])
    for key in ("prompt_tps", "first_prompt_tps", "gen_tps"):
        values = sorted(r[key] for r in runs)
        result[key] = statistics.median(values)
        result[key + "_range"] = (values[0], values[-1])
    return result


def child(engine: str, alias: str, threads: int, n_gen: int, n_prompt: int, python: str | None = None,
          profile: bool = False) -> dict | None:
    if engine == "llama.cpp":  # llama.cpp's child gets the file itself: it may run where pyggml is not installed
        alias = model_file(alias)
    cmd = [python or sys.executable, __file__, "--child", engine, "--models", alias, "--threads", str(threads),
           "-n", str(n_gen), "--prompt-tokens", str(n_prompt)] + (["--profile"] if profile else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        if engine == "pyggml":
            sys.exit(f"pyggml run failed:\n{r.stderr}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-n", type=int, default=64, help="tokens to generate")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--llama-python", default=None, metavar="PYTHON",
                    help="an interpreter with llama-cpp-python, when it is not installed beside pyggml")
    ap.add_argument("--synthetic-moe", nargs="?", const="qwen3moe", default=None, choices=["qwen3moe", "gpt-oss"],
                    help="also a ~1B mixture of experts of random weights: qwen3moe (the default) or gpt-oss")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench, for its figures")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each engine (fresh processes); prints medians and the spread")
    ap.add_argument("--profile", action="store_true",
                    help="after the measured runs, a timed pass of pyggml's: time per op kind and outside the kernels")
    ap.add_argument("--child", choices=["pyggml", "llama.cpp"], help=argparse.SUPPRESS)
    perfdoc.add_argument(ap)
    a = ap.parse_args()
    perfdoc.start(a)
    if a.child:
        if a.child == "pyggml":
            print(json.dumps(run_pyggml(a.models, a.threads, a.n, a.prompt_tokens, a.profile)))
        else:
            print(json.dumps(run_llama_cpp(a.models, a.threads, a.n, a.prompt_tokens)))
        return
    if a.llama_python:
        have_llama = subprocess.run([a.llama_python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    else:
        try:
            import llama_cpp  # noqa: F401
            have_llama = True
        except ImportError:
            have_llama = False
    if not have_llama:
        print("llama-cpp-python is not installed: pyggml figures only")
    print(f"{a.threads} threads, {a.prompt_tokens}-token prompt, {a.n} generated tokens (greedy)\n")
    print(f"{'model':<12} {'engine':<10} {'load s':>7} {'prompt t/s':>11} {'gen t/s':>8} {'peak RSS MB':>12} "
          f"{'runtime MB':>11} {'model MB':>9} {'model/(GGUF+KV)':>16} {'1st prompt t/s':>15}")
    models = [m for m in a.models.split(",") if m] + ([str(synthetic_moe(a.synthetic_moe))] if a.synthetic_moe else [])
    for alias in models:
        results = [rounds_of(a.rounds, lambda i: child("pyggml", alias, a.threads, a.n, a.prompt_tokens,
                                                         profile=a.profile and i == 0))]
        if have_llama:
            results.append(rounds_of(a.rounds, lambda i: child("llama.cpp", alias, a.threads, a.n, a.prompt_tokens,
                                                               a.llama_python)))
        label = Path(alias).stem[:12] if os.path.exists(alias) else alias
        kv = results[0]["kv_bytes"]  # llama.cpp's F16 cache of the same n_ctx has the same size
        for r in filter(None, results):
            model = r["peak_rss"] - r["runtime_rss"]
            print(f"{label:<12} {r['engine']:<10} {r['load_s']:>7.2f} {r['prompt_tps']:>11.1f} {r['gen_tps']:>8.1f} "
                  f"{r['peak_rss'] / 2**20:>12.0f} {r['runtime_rss'] / 2**20:>11.0f} {model / 2**20:>9.0f} "
                  f"{model / (r['gguf_bytes'] + kv):>16.2f} {r['first_prompt_tps']:>15.1f}")
        if a.rounds > 1:
            for r in filter(None, results):
                (p0, p1), (g0, g1) = r["prompt_tps_range"], r["gen_tps_range"]
                print(f"{'':<12} {r['engine']:<10} {'':>7} {f'{p0:.0f}-{p1:.0f}':>11} {f'{g0:.1f}-{g1:.1f}':>8}"
                      f"  (the spread of {a.rounds} rounds; medians above)")
        if len(results) == 2 and results[1]:
            ours, ref = results
            print(f"{'':<12} {'ratio':<10} {'':>7} {ours['prompt_tps'] / ref['prompt_tps']:>11.2f} "
                  f"{ours['gen_tps'] / ref['gen_tps']:>8.2f}")
        if a.llama_bench:
            ref = run_llama_bench(a.llama_bench, model_file(alias), a.threads, a.n, a.prompt_tokens)
            if ref:
                ours = results[0]
                print(f"{'':<12} {'llama-bench':<10} {'':>7} {ref['prompt_tps']:>11.1f} {ref['gen_tps']:>8.1f}")
                print(f"{'':<12} {'ratio':<10} {'':>7} {ours['prompt_tps'] / ref['prompt_tps']:>11.2f} "
                      f"{ours['gen_tps'] / ref['gen_tps']:>8.2f}")
        if a.profile:
            print_profile(label, results[0]["profile"])


if __name__ == "__main__":
    main()
