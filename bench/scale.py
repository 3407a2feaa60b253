"""Scale-out benchmark: does a second server make generation faster?

Starts its own ``pyggml-rpc-server`` processes on 127.0.0.1, each pinned to one core with one
thread (``taskset -c N pyggml-rpc-server -t 1``), and prints for one model:

- one server holding every layer;
- two servers, split mode ``layer`` (each holds half of the layers; they take turns);
- two servers, split mode ``tensor`` (each holds half of every layer; they compute each step
  together, passing activations to each other directly);

with single-stream decode and prompt tokens/s, each layout's ratio to one server, the bytes
each server receives from the other per generated token (tensor split), and whether the
logits are bit-identical to one server's.  With ``--streams N``, also the aggregate tokens/s
of N concurrent streams through ``pyggml-server`` on each layout (with layer split, a decode
step's sequences are cut into one group per server that flow through them one after another:
Context.n_groups).

    python bench/scale.py [--model smollm2|gemma3-270m|dense-1b] [--tokens 32] [--prompt 128] [--streams 8]
                          [--rounds 3] [--llama-cpp BIN_DIR] [--netns [--rate 1gbit]]

With ``--compare-lanes N``, the serving engine in this process over the two pinned servers (layer
split) with N streams, its pipelined lanes on and off in turn (Engine._lane_step): aggregate
tokens/s of each.

With ``--netns`` each server runs on a host of its own: a network namespace joined to a bridge
in this one by a veth pair (root only), so that the servers reach the client and each other
(a tensor split's activations) over those links; ``--rate 1gbit`` shapes each end of every
link with tc, as a gigabit LAN would.  (llama.cpp's servers of ``--llama-cpp`` stay on
127.0.0.1.)

With ``--llama-cpp BIN_DIR`` (llama.cpp's ``llama-bench`` and ``ggml-rpc-server``, e.g. from
``../shared/bin/build-llamacpp``), llama.cpp's own layer split comes beside ours: its
``ggml-rpc-server`` pinned the same way (one core, one thread each), every layer on one server
and then split over two, ``llama-bench`` with the same prompt and token counts.

``moe-1b`` and ``gpt-oss-1b`` are bench/generate.py's ~1B mixtures of experts (qwen3moe with Q4_0
experts; gpt-oss with MXFP4 ones): random vocabularies, so their prompt is token ids and no
streams run through pyggml-server.  ``dense-1b`` is a llama of about 1B parameters (Llama 3.2 1B's shape, Q4_0, random weights and
SmolLM2's vocabulary and tokenizer), written once into ``~/.cache/pyggml/bench``.  The servers
and the client share the machine: the client needs a core of its own for the figures to mean
what they say (on 2 cores it competes with the servers).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import pyggml as pg
from pyggml.models import hub
from tests.rpc.rpc_helpers import ServerProcess
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

DENSE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyggml" / "bench" / "dense-llama-1b-q4_0.gguf"
DENSE_SHAPE = dict(n_embd=2048, n_layer=16, n_ff=8192, n_head=32, n_head_kv=8)  # Llama 3.2 1B
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 8


def dense_1b() -> Path:
    """The ~1B dense llama (written once: random Q4_0 blocks, SmolLM2's vocabulary)."""
    if DENSE_FILE.exists():
        return DENSE_FILE
    import gguf

    from pyggml.gguf import GGUFFile
    src = GGUFFile(hub.resolve("smollm2"))
    s = DENSE_SHAPE
    n_vocab = src.tensors["token_embd.weight"].ne[1]
    rng = np.random.default_rng(1)
    print(f"writing {DENSE_FILE} (random weights, once) ...", flush=True)
    DENSE_FILE.parent.mkdir(parents=True, exist_ok=True)
    partial = DENSE_FILE.with_suffix(".partial")
    w = gguf.GGUFWriter(str(partial), "llama")
    w.add_name("random-dense-llama-1b")
    w.add_context_length(4096)
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    copy_tokenizer(w, hub.resolve("smollm2"))  # so that text goes in and out

    def q4_0(name: str, rows: int, cols: int) -> None:
        blocks = np.zeros((rows, cols // 32, 18), dtype=np.uint8)
        blocks[..., :2] = np.frombuffer(np.full(rows * cols // 32, 0.01, dtype=np.float16).tobytes(),
                                        dtype=np.uint8).reshape(rows, cols // 32, 2)
        blocks[..., 2:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
        w.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    d, ff, kv = s["n_embd"], s["n_ff"], s["n_head_kv"] * (s["n_embd"] // s["n_head"])
    q4_0("token_embd.weight", n_vocab, d)
    for il in range(s["n_layer"]):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(d, dtype=np.float32))
        q4_0(f"blk.{il}.attn_q.weight", d, d)
        q4_0(f"blk.{il}.attn_k.weight", kv, d)
        q4_0(f"blk.{il}.attn_v.weight", kv, d)
        q4_0(f"blk.{il}.attn_output.weight", d, d)
        w.add_tensor(f"blk.{il}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        q4_0(f"blk.{il}.ffn_gate.weight", ff, d)
        q4_0(f"blk.{il}.ffn_up.weight", ff, d)
        q4_0(f"blk.{il}.ffn_down.weight", d, ff)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.rename(DENSE_FILE)
    return DENSE_FILE


def copy_tokenizer(w, path: Path) -> None:
    """The ``tokenizer.*`` metadata of the GGUF at ``path``, with its types, into writer ``w``."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = gguf.GGUFValueType(field.types[0])
        if kind == gguf.GGUFValueType.ARRAY:
            sub = gguf.GGUFValueType(field.types[1])
            values = [bytes(field.parts[i]).decode("utf-8") if sub == gguf.GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, values, kind, sub)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)


def pinned_server(core: int, host: tuple[str, str] | None = None) -> ServerProcess:
    """``pyggml-rpc-server -t 1`` pinned to ``core``; with ``host`` (a network namespace and its
    address: --netns), on that host."""
    prefix = ("taskset", "-c", str(core)) if shutil.which("taskset") else ()
    if host is None:
        return ServerProcess("-t", "1", "--poll", "0", prefix=prefix)
    return ServerProcess("-H", host[1], "-t", "1", "--poll", "0", prefix=("ip", "netns", "exec", host[0], *prefix))


# the ~1B mixtures of experts of bench/generate.py (random vocabularies: no tokenizer, so their
# prompt is token ids and there are no streams through pyggml-server)
SYNTHETIC = {"moe-1b": "qwen3moe", "gpt-oss-1b": "gpt-oss"}


@contextlib.contextmanager
def placed(path: Path, endpoints: list[str], mode: str, n_prompt: int, tokenized: bool = True):
    """A context over the servers ``endpoints`` (every layer on one, or split by ``mode``), the
    loaded model, and the prompt's ids."""
    ngl = "all" if len(endpoints) == 1 or mode == "tensor" else "auto"
    if tokenized:
        with pg.Model(path, n_ctx=512, rpc=endpoints, ngl=ngl, split_mode=mode, progress=False) as m:
            yield m.context, m.model, m.tokenize(PROMPT)[:n_prompt]
        return
    from pyggml.models import Context, load_model
    from pyggml.rpc import connect
    devices = connect(endpoints) + [pg.cpu_device()]
    model = None
    try:
        model = load_model(path, ngl, devices, split_mode=mode)
        yield Context(model, n_ctx=512), model, [100 + i % 1000 for i in range(n_prompt)]
    finally:
        if model is not None:
            model.free()
        for d in devices[:-1]:
            d.conn.close()


def measure(ctx, ids: list[int], n_tokens: int) -> dict:
    """Prompt tokens/s (a warm prompt of ``ids``) and decode tokens/s (greedy, ``n_tokens``
    steps after it), and the logits of the prompt's last token.  As llama-bench measures: the
    same prompt and steps once before, so that every shape measured has its graph built and
    sent, and its step kept on the servers (a split's first steps of a shape go request by
    request: rpc/steps.py)."""
    def once() -> dict:
        ctx.clear()
        t0 = time.perf_counter()
        logits = ctx.decode(ids)
        prompt_s = time.perf_counter() - t0
        token = int(np.argmax(logits[-1]))
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            token = int(np.argmax(ctx.decode([token])[-1]))
        decode_s = time.perf_counter() - t0
        return {"prompt_tps": len(ids) / prompt_s, "decode_tps": n_tokens / decode_s, "logits": logits[-1]}
    once()
    return once()


def streams(path: Path, endpoints: list[str], mode: str, n_streams: int, n_tokens: int) -> float:
    """Aggregate tokens/s of ``n_streams`` concurrent chat streams through ``pyggml-server``
    placed over ``endpoints`` with split mode ``mode``."""
    from bench.serve import Server, free_port
    from bench.serve import measure as measure_streams
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-scale-{port}.log"
    server = Server([sys.executable, "-m", "pyggml.cli.server", "-m", str(path), "--port", str(port), "-c", "2048",
                     "-np", str(n_streams), "--rpc", ",".join(endpoints), "-ngl", "all" if len(endpoints) == 1
                     else "auto", "-sm", mode], f"http://127.0.0.1:{port}", log)
    try:
        measure_streams(server.url, n_streams, 4)  # warm-up: the batch shapes built and kept
        return measure_streams(server.url, n_streams, n_tokens)["tok_s"]
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, dense-1b, moe-1b (qwen3moe), "
                                                        "gpt-oss-1b, or a GGUF path")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--streams", type=int, default=0, help="also the aggregate tokens/s of this many concurrent "
                                                            "streams through pyggml-server (0: not measured)")
    ap.add_argument("--rounds", type=int, default=1, help="measure the layouts in turn this many times and "
                                                          "print medians (this machine's speed drifts)")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens each stream asks for (its prompt is read "
                                                                  "too: few tokens measure mostly prompts)")
    ap.add_argument("--compare-lanes", type=int, default=0, metavar="N",
                    help="N streams through the engine over the two servers (layer split), lanes on and off in turn")
    ap.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                    help="llama.cpp's bin folder (llama-bench, ggml-rpc-server): its layer split beside ours")
    ap.add_argument("--netns", action="store_true",
                    help="each server on a host of its own: a network namespace joined to this one's bridge "
                         "(root only; the servers reach each other over it too)")
    ap.add_argument("--rate", default=None, metavar="RATE",
                    help="with --netns: shape each end of every server's link to RATE (tc's units: 1gbit, 100mbit)")
    perfdoc.add_argument(ap)
    args = ap.parse_args()
    if args.rate and not args.netns:
        ap.error("--rate shapes the links of --netns")
    if args.model in SYNTHETIC and (args.streams or args.compare_lanes):
        ap.error(f"{args.model} has no tokenizer: no streams through pyggml-server")
    perfdoc.start(args)
    with contextlib.ExitStack() as stack:
        hosts = [None, None]
        if args.netns:
            from tests.rpc.rpc_helpers import NamespaceUnavailable, bridged_namespaces
            try:
                hosts = stack.enter_context(bridged_namespaces(2, args.rate))
            except NamespaceUnavailable as e:
                sys.exit(f"--netns: {e}")
            print(f"servers at {hosts[0][1]} and {hosts[1][1]}, each in a network namespace of its own"
                  + (f", links shaped to {args.rate} each way" if args.rate else ""), flush=True)
        run(args, hosts)


def run(args, hosts: list) -> None:
    """main's work, with the servers on ``hosts`` (namespaces, or None: 127.0.0.1)."""
    tokenized = args.model not in SYNTHETIC
    if args.model in SYNTHETIC:
        from generate import synthetic_moe  # (bench/generate.py, beside this script)
        path = synthetic_moe(SYNTHETIC[args.model])
    else:
        path = dense_1b() if args.model == "dense-1b" else hub.resolve(args.model)
    servers = [pinned_server(0, hosts[0]), pinned_server(1, hosts[1])]
    if args.compare_lanes:
        try:
            compare_lanes(path, servers, args.compare_lanes, args.stream_tokens, args.rounds)
        finally:
            for s in servers:
                s.stop()
        return
    rounds: dict[str, list[dict]] = {}
    try:
        layouts = [("one server", [servers[0]], "layer"), ("two servers, layer split", servers, "layer"),
                   ("two servers, tensor split", servers, "tensor")]
        for r in range(args.rounds):  # the layouts in turn, round after round: a noisy spell hits them all
            for label, used, mode in layouts:
                with placed(path, [s.endpoint for s in used], mode, args.prompt, tokenized) as (ctx, model, ids):
                    row = measure(ctx, ids, args.tokens)
                    if mode == "tensor":
                        row["exchanged"] = ctx.exchanged_bytes()
                if args.streams:
                    row["streams_tps"] = streams(path, [s.endpoint for s in used], mode, args.streams,
                                                 args.stream_tokens)
                rounds.setdefault(label, []).append(row)
                print(f"  round {r + 1}, {label}: done", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    rows = {label: median_row(runs) for label, runs in rounds.items()}
    base = rows["one server"]
    print(f"\n{path.name}: servers pinned to one core each, one thread; {args.prompt}-token prompt, "
          f"{args.tokens} decoded tokens" + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else ""))
    print(f"{'layout':<28} {'decode tok/s':>12} {'x one':>7} {'prompt tok/s':>13} {'x one':>7}  logits")
    for label, r in rows.items():
        same = "bit-identical" if np.array_equal(r["logits"], base["logits"]) else "DIFFER"
        print(f"{label:<28} {r['decode_tps']:>12.2f} {r['decode_tps'] / base['decode_tps']:>7.2f} "
              f"{r['prompt_tps']:>13.1f} {r['prompt_tps'] / base['prompt_tps']:>7.2f}  {same}")
    if args.streams:
        print(f"\n{args.streams} concurrent streams through pyggml-server, {args.stream_tokens} tokens each")
        print(f"{'layout':<28} {'aggregate tok/s':>15} {'x one':>7}")
        for label, r in rows.items():
            print(f"{label:<28} {r['streams_tps']:>15.2f} {r['streams_tps'] / base['streams_tps']:>7.2f}")
    ex = rows["two servers, tensor split"]["exchanged"]
    print("tensor split, bytes each server receives from the others per decoded token: "
          + ", ".join(f"{b / 1024:.0f} KiB" for b in ex) + " (slices that feed a product in its blocks: Q8_0/Q8_1/Q8_K)")
    if args.rounds > 1:
        spread = {label: max(r["decode_tps"] for r in runs) / min(r["decode_tps"] for r in runs)
                  for label, runs in rounds.items()}
        print("decode tok/s, largest over smallest round: "
              + ", ".join(f"{label} {x:.2f}" for label, x in spread.items()))
    if args.llama_cpp:
        theirs = llama_cpp_layouts(args.llama_cpp, path, args.prompt, args.tokens)
        print(f"\nllama.cpp's layer split (ggml-rpc-server pinned, -t 1; llama-bench -p {args.prompt} -n {args.tokens})")
        print(f"{'layout':<28} {'decode tok/s':>12} {'x one':>7} {'prompt tok/s':>13} {'x one':>7}  "
              f"{'pyggml / llama.cpp':>18}")
        for label, r in theirs.items():
            base_t = theirs["one server"]
            mine = rows[label]["decode_tps"] / r["decode_tps"]
            print(f"{label:<28} {r['decode_tps']:>12.2f} {r['decode_tps'] / base_t['decode_tps']:>7.2f} "
                  f"{r['prompt_tps']:>13.1f} {r['prompt_tps'] / base_t['prompt_tps']:>7.2f}  {mine:>12.2f} decode")


def compare_lanes(path: Path, servers: list, n_streams: int, n_tokens: int, rounds: int) -> None:
    """Aggregate tokens/s of ``n_streams`` greedy streams of ``n_tokens`` each through the
    Engine over ``servers`` (layer split), its lanes on and off in turn, ``rounds`` times."""
    import threading

    from pyggml.models.engine import Engine, Options
    from pyggml.models.sampling import SamplingParams
    lane_step = Engine._lane_step
    with pg.Model(path, n_ctx=2048, rpc=[s.endpoint for s in servers], progress=False) as m:
        layers = m.model.placement.layers
        print(f"{path.name}: layers per server {[layers.count(d) for d in sorted(set(layers))]}, "
              f"{n_streams} streams of {n_tokens} tokens", flush=True)
        prompts = [m.tokenize(f"Story number {i}: once upon a time") for i in range(n_streams)]
        with Engine(m, n_parallel=n_streams, n_batch=max(64, n_streams)) as engine:
            engine.wait_built_ahead(300)

            def run(lanes: bool) -> float:
                Engine._lane_step = lane_step if lanes else (lambda self, t_start: False)
                finished = threading.Semaphore(0)

                def sink(event) -> None:
                    if event.kind in ("done", "error"):
                        finished.release()
                t0 = time.perf_counter()
                for ids in prompts:
                    engine.start(ids, Options(sampling=SamplingParams(temperature=0.0), max_tokens=n_tokens), sink)
                for _ in prompts:
                    finished.acquire(timeout=600)
                return n_streams * n_tokens / (time.perf_counter() - t0)
            try:
                run(True)  # warm-up
                for r in range(rounds):
                    on, off = run(True), run(False)
                    print(f"  round {r + 1}: lanes {on:.2f} tok/s, without {off:.2f} tok/s, {on / off:.2f}x", flush=True)
            finally:
                Engine._lane_step = lane_step


def llama_cpp_layouts(bin_dir: Path, model: Path, n_prompt: int, n_gen: int) -> dict[str, dict]:
    """llama-bench's decode and prompt tokens/s with every layer on one ggml-rpc-server, and
    with the layers split over two (llama.cpp's only split over RPC), each server pinned to
    its own core with one thread, as ours are."""
    import json
    import subprocess

    from bench.serve import free_port
    ports = [free_port(), free_port()]
    prefix = [("taskset", "-c", str(i)) if shutil.which("taskset") else () for i in range(2)]
    servers = [subprocess.Popen([*prefix[i], str(bin_dir / "ggml-rpc-server"), "-t", "1", "-H", "127.0.0.1",
                                 "-p", str(p)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i, p in enumerate(ports)]

    def bench(endpoints: list[int]) -> dict:
        r = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", "1", "-p", str(n_prompt),
                            "-n", str(n_gen), "-ngl", "99", "-o", "json",
                            "-rpc", ",".join(f"127.0.0.1:{p}" for p in endpoints)],
                           capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {r.stderr.strip()[-500:]}")
        runs = json.loads(r.stdout)
        return {"prompt_tps": float(next(x["avg_ts"] for x in runs if x["n_prompt"])),
                "decode_tps": float(next(x["avg_ts"] for x in runs if x["n_gen"]))}
    try:
        time.sleep(1.0)
        return {"one server": bench(ports[:1]), "two servers, layer split": bench(ports)}
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)


def median_row(runs: list[dict]) -> dict:
    """A layout's figures: the median of each rate over its rounds; the first round's logits
    (every round's are checked equal) and bytes."""
    row = dict(runs[0])
    for key in ("decode_tps", "prompt_tps", "streams_tps"):
        if key in row:
            row[key] = float(np.median([r[key] for r in runs]))
    if any(not np.array_equal(r["logits"], row["logits"]) for r in runs):
        row["logits"] = np.full_like(row["logits"], np.nan)  # printed as DIFFER
    return row


if __name__ == "__main__":
    main()
