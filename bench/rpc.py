"""RPC benchmark: what remote devices cost on loopback.

Starts its own ``pyggml-rpc-server`` processes on 127.0.0.1 and prints, for one model:
generation tokens/s locally, with every layer on one server, and split over two servers
(embedding and head on one, the layers on the other; the activations passed between the
servers directly, and - "via client" - through this client); the time added per token per
server; bytes on the wire per generated token; upload MB/s of the first load; the time of
a second load that the servers' tensor caches answer; and a cold load from a server that
holds the file itself (``--gguf``); and how long failover takes from a server's kill -9 to
the next token.

    python bench/rpc.py [--model smollm2] [--tokens 64] [--llama-cpp BIN_DIR]
    python bench/rpc.py --synthetic-moe [--llama-cpp BIN_DIR]   # the ~1B qwen3moe of bench/generate.py
    python bench/rpc.py --netns --rate 100mbit                  # servers on "another host" (root only)
    python bench/rpc.py --pipeline                              # a 512-token prompt, micro-batches or not
    python bench/rpc.py --transport zmq                         # ZeroMQ servers' rows beside TCP's
    python bench/rpc.py --failover-load 10,100                  # recovery under 4 streams, after 10 s and 100 s
    python bench/rpc.py --place-by-speed                        # servers of -t 1 and -t 2: by memory, by speed

``--synthetic-moe`` measures generation only (local, one server, two servers), for the
mixture of experts that ``bench/generate.py --synthetic-moe`` writes: its random vocabulary
has no tokenizer, so token ids go straight into a context.

With ``--llama-cpp BIN_DIR`` (llama.cpp's ``llama-bench`` and ``ggml-rpc-server``, e.g. from
``../shared/bin/build-llamacpp``; reference tools, never dependencies) the same machine's
llama.cpp figures come beside ours: local, one server, two servers, and the ratio of the
time added per token per server.

Everything runs on one machine: the servers compete with the client for its cores, so
on a 2-core machine the split run measures contention as much as the protocol.  With
``--netns`` the servers run in a network namespace of their own, joined to the client's by a
veth pair (``--rate``: each end shaped with tc), as on another host behind a real link: there
the activations the split servers pass each other stay off the client's link.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import pyggml as pg
from pyggml.rpc import backend as rpc_backend
from tests.rpc.rpc_helpers import NamespaceUnavailable, ServerProcess, network_namespace
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Hosts:
    """Where the servers run: here (on 127.0.0.1), or behind ``prefix`` bound to ``address``."""
    prefix: tuple[str, ...] = ()
    address: str | None = None

    def server(self, *args: str, env: dict | None = None) -> ServerProcess:
        host = ("-H", self.address) if self.address else ()
        return ServerProcess(*host, *args, env=env, prefix=self.prefix)


def wire_bytes(model: pg.Model) -> int:
    conns = {id(d.conn): d.conn for d in model.rpc_devices}.values()
    return sum(c.bytes_sent + c.bytes_received for c in conns)


def waited(model: pg.Model) -> float:
    return sum(c.wait_seconds for c in {id(d.conn): d.conn for d in model.rpc_devices}.values())


def generation(model: pg.Model, n: int) -> tuple[float, float, float]:
    """(tokens/s, wire bytes per token, seconds per token spent waiting for servers) of
    top-k sampling (k 40, a fixed seed) after a short prompt: what a chat generates."""
    ids = model.tokenize("Once upon a time, in a land far away,")  # a text that goes on
    list(model.generate(ids, max_tokens=2, temperature=0.8, top_k=40, seed=1))  # warm up: graphs built and sent
    model.context.clear()
    tokens = model.generate(ids, max_tokens=n + 1, temperature=0.8, top_k=40, seed=1)
    next(tokens)  # the prompt
    b0, w0, t0 = wire_bytes(model), waited(model), time.perf_counter()
    count = sum(1 for _ in tokens)
    dt = time.perf_counter() - t0
    count = max(count, 1)
    return count / dt, (wire_bytes(model) - b0) / count, (waited(model) - w0) / count


def untokenized_generation(ctx, conns: list, n: int) -> tuple[float, float, float]:
    """generation() for a model without a tokenizer: token ids into the context, each step's
    top 40 brought back (what top-k sampling reads) and the first of them fed back."""
    ctx.clear()
    top = ctx.decode(list(range(3, 11)), n_top=40)
    top = ctx.decode([int(top.ids[0, 0])], n_top=40)  # warm up: the step's graph built and sent
    b0 = sum(c.bytes_sent + c.bytes_received for c in conns)
    w0, t0 = sum(c.wait_seconds for c in conns), time.perf_counter()
    for _ in range(n):
        top = ctx.decode([int(top.ids[0, 0])], n_top=40)
    dt = time.perf_counter() - t0
    wire = sum(c.bytes_sent + c.bytes_received for c in conns) - b0
    return n / dt, wire / n, (sum(c.wait_seconds for c in conns) - w0) / n


def moe_main(args, env: dict, hosts: Hosts) -> None:
    """The three generation placements of the synthetic mixture of experts, and llama.cpp's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from generate import synthetic_moe

    from pyggml.models import Context, load_model
    from pyggml.models.loader import default_devices
    from pyggml.rpc import connect
    path = Path(args.synthetic_moe) if args.synthetic_moe else synthetic_moe()
    with tempfile.TemporaryDirectory() as tmp:
        servers = [hosts.server("--cache-dir", f"{tmp}/cache{i}", env=env) for i in range(2)]
        opened = []
        try:
            runs = {}
            for name, n_servers, ngl in (("local", 0, None), ("1 server, all layers", 1, "all"),
                                         ("2 servers, split", 2, "0:prolog,epilog;1:all")):
                devices = connect([s.endpoint for s in servers[:n_servers]]) if n_servers else []
                opened += devices
                model = load_model(path, ngl=ngl, devices=[*devices, *default_devices()], progress=False)
                conns = list({id(d.conn): d.conn for d in devices}.values())
                runs[name] = (Context(model, n_ctx=args.ctx), conns, n_servers)
            results: dict[str, list] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, (ctx, conns, _n) in runs.items():
                    results[name].append(untokenized_generation(ctx, conns, args.tokens))
                print("round: " + ", ".join(f"{name} {r[-1][0]:.1f} tokens/s" for name, r in results.items()),
                      file=sys.stderr)
        finally:
            for d in opened:
                d.conn.close()
            for s in servers:
                s.stop()
    rows = [(name, *sorted(results[name])[len(results[name]) // 2], runs[name][2]) for name in runs]
    local_tps = rows[0][1]
    print(f"model {path.name} (synthetic qwen3moe, {path.stat().st_size / 2**20:.0f} MiB), {args.tokens} generated "
          f"tokens x {args.rounds} rounds, {pg.cpu_device().get_description()}")
    print(f"{'placement':<24}{'tokens/s':>10}{'ms/token':>10}{'added ms/token/server':>24}{'wire bytes/token':>18}")
    for name, tps, per_token, _wait, n in rows:
        added = (1000 / tps - 1000 / local_tps) / n if n else 0.0
        print(f"{name:<24}{tps:>10.1f}{1000 / tps:>10.2f}{added:>24.2f}{per_token:>18.0f}")
    if args.llama_cpp:
        print_llama_cpp(llama_cpp_rows(args.llama_cpp, path, args.tokens, hosts=hosts),
                        {name: tps for name, tps, *_ in rows}, args.tokens)


def print_llama_cpp(theirs: dict[str, float], ours: dict[str, float], n: int) -> None:
    print(f"llama.cpp (llama-bench -t 2 -n {n}, ggml-rpc-server -t 2; every layer on the servers):")
    for name, (n_servers, tps) in zip(theirs, enumerate(theirs.values())):
        added = (1000 / tps - 1000 / theirs["local"]) / n_servers if n_servers else 0.0
        mine = (1000 / ours[name] - 1000 / ours["local"]) / n_servers if n_servers else 0.0
        ratio = f"  pyggml's added time / llama.cpp's: {mine / added:.2f}" if n_servers and added > 0 else ""
        print(f"  {name:<22}{tps:>10.1f} tok/s{added:>10.2f} ms/token/server added{ratio}"
              f"  (pyggml {ours[name]:.1f} tok/s, {ours[name] / tps:.2f}x)")


def llama_cpp_rows(bin_dir: Path, model: Path, n: int, threads: int = 2, hosts: Hosts | None = None
                   ) -> dict[str, float]:
    """llama-bench's generation tokens/s locally and with every layer on one and on two
    ggml-rpc-servers (started here, one CPU thread pool each)."""
    import json
    import socket
    import subprocess

    def bench(*extra: str) -> float:
        r = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0",
                            "-n", str(n), "-o", "json", *extra], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {r.stderr.strip()[-500:]}")
        return float(json.loads(r.stdout)[0]["avg_ts"])

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    rows = {"local": bench("-ngl", "0")}
    ports = [free_port(), free_port()]
    hosts = hosts or Hosts()
    address = hosts.address or "127.0.0.1"
    servers = [subprocess.Popen([*hosts.prefix, str(bin_dir / "ggml-rpc-server"), "-t", str(threads), "-H", address,
                                 "-p", str(p)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    try:
        time.sleep(1.0)
        rows["1 server, all layers"] = bench("-ngl", "99", "-rpc", f"{address}:{ports[0]}")
        rows["2 servers, split"] = bench("-ngl", "99", "-rpc", ",".join(f"{address}:{p}" for p in ports))
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)
    return rows


def timed_load(args, endpoint: str) -> tuple[float, int]:
    """Seconds to load the model onto the server at ``endpoint``, and the bytes sent to it."""
    t0 = time.perf_counter()
    model = pg.Model(args.model, n_ctx=args.ctx, rpc=endpoint, ngl="all", progress=False)
    seconds = time.perf_counter() - t0
    sent = model.rpc_devices[0].conn.bytes_sent
    model.close()
    return seconds, sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3, help="runs per placement (the median is shown)")
    ap.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                    help="llama.cpp's bin folder (llama-bench, ggml-rpc-server): its figures beside ours")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the server processes, e.g. OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--synthetic-moe", nargs="?", const="", default=None, metavar="FILE",
                    help="the ~1B qwen3moe of random weights instead (generation only; see above), or FILE: "
                         "another GGUF whose vocabulary has no tokenizer")
    ap.add_argument("--netns", action="store_true",
                    help="the servers in another network namespace, reached over a veth pair (root only)")
    ap.add_argument("--rate", default=None, metavar="RATE",
                    help="with --netns: shape each end of the pair to RATE (tc's units: 1gbit, 100mbit)")
    ap.add_argument("--pipeline", action="store_true",
                    help="a prompt over two servers pinned to one core each, with and without micro-batches")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="with --pipeline: the prompt's length")
    ap.add_argument("--sequences", type=lambda t: [int(x) for x in t.split(",")], default=[8, 32],
                    help="with --pipeline: decode steps of this many sequences (comma-separated), "
                         "in one batch and in groups of sequences")
    ap.add_argument("--decode-steps", type=int, default=16, help="with --pipeline: decode steps timed")
    ap.add_argument("--transport", choices=["tcp", "zmq"], default="tcp",
                    help="zmq: rows of servers on the ZeroMQ transport too (one server; two, split - their "
                         "activations go through the client, as ZeroMQ servers make no links)")
    ap.add_argument("--failover-load", type=lambda t: [float(x) for x in t.split(",")], default=None,
                    metavar="S,S", help="recovery under load: 4 streams decoded together, a server in use killed "
                                        "after each of these many seconds of load (and started again)")
    ap.add_argument("--place-by-speed", action="store_true",
                    help="two servers, -t 1 and -t 2 (equal --mem): generation placed by memory, then by speed")
    perfdoc.add_argument(ap)
    args = ap.parse_args()
    perfdoc.start(args)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    if args.failover_load:
        failover_load_main(args, env)
        return
    if args.place_by_speed:
        place_by_speed_main(args, env)
        return
    main_of = moe_main if args.synthetic_moe is not None else pipeline_main if args.pipeline else placements_main
    if not args.netns:
        main_of(args, env, Hosts())
        return
    try:
        with network_namespace(args.rate) as (name, address):
            print(f"servers in network namespace {name} at {address}, over a veth pair"
                  + (f" shaped to {args.rate} each way" if args.rate else ""), file=sys.stderr)
            main_of(args, env, Hosts(("ip", "netns", "exec", name), address))
    except NamespaceUnavailable as e:
        print(f"--netns skipped: {e}")


def place_by_speed_main(args, env: dict) -> None:
    """Tokens/s of generation over two servers of unequal speed (-t 1 and -t 2, the same --mem),
    the layers spread by memory (half each) and by each server's measured speed (-ngl auto)."""
    if args.model == "dense-1b":  # bench/scale.py's ~1B llama (written once)
        from bench.scale import dense_1b
        args.model = str(dense_1b())
    servers = [ServerProcess("-t", "1", "--mem", "1G", env=env), ServerProcess("-t", "2", "--mem", "1G", env=env)]
    try:
        for s in servers:
            print(f"{s.endpoint}: {s.banner[1].strip()}")
        rows = {}
        for place_by in ("memory", "speed"):
            with pg.Model(args.model, n_ctx=args.ctx, rpc=[s.endpoint for s in servers], progress=False,
                          place_by=place_by) as m:
                layers = m.model.placement.layers
                runs = sorted(generation(m, args.tokens)[0] for _ in range(args.rounds))
                rows[place_by] = (runs[len(runs) // 2], layers.count(0), layers.count(1))
        print(f"model {args.model}, {args.tokens} tokens, median of {args.rounds} runs:")
        print(f"{'placed by':<10}{'layers -t 1':>12}{'layers -t 2':>12}{'tokens/s':>10}{'x memory':>10}")
        for place_by, (tps, slow, fast) in rows.items():
            print(f"{place_by:<10}{slow:>12}{fast:>12}{tps:>10.1f}{tps / rows['memory'][0]:>10.2f}")
    finally:
        for s in servers:
            s.stop()


def failover_load_main(args, env: dict) -> None:
    """How long a kill -9 pauses the streams of pyggml's engine under steady load (4 streams
    of greedy answers, one after another in each slot), after each span of load: recovery
    rebuilds only the live cells, so it should not grow with the time served."""
    import threading
    from pyggml.models.engine import Engine
    servers = [ServerProcess(env=env), ServerProcess(env=env)]
    m = pg.Model(args.model, n_ctx=2048, rpc=[s.endpoint for s in servers], progress=False, failover=True)
    engine = Engine(m, n_parallel=4, n_batch=128)
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            for _ in engine.submit(f"{PROMPT} ({i})", max_tokens=args.tokens, temperature=0):
                pass
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    rows = []
    try:
        for seconds in args.failover_load:
            time.sleep(seconds)
            live = engine.ctx.kv.n_used
            victim = servers[len(rows) % 2]
            before = engine.stats.recoveries
            t0 = time.perf_counter()
            victim.kill()
            while engine.stats.recoveries == before and time.perf_counter() - t0 < 120:
                time.sleep(0.01)
            rows.append((seconds, live, engine.stats.recovery_seconds, time.perf_counter() - t0))
            victim.proc.wait()
            servers[servers.index(victim)] = ServerProcess("-p", str(victim.port), env=env)
            before = engine.stats.recoveries
            while engine.stats.recoveries == before:  # taken back
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        engine.close()
        m.close()
        for s in servers:
            s.stop()
    print(f"model {args.model}, 4 streams of {args.tokens} tokens, two servers, a kill -9 after each span of load:")
    print(f"{'load s':>8}{'live cells':>12}{'recovery s':>12}{'kill to placed s':>18}")
    for seconds, live, recovery, total in rows:
        print(f"{seconds:>8.0f}{live:>12}{recovery:>12.2f}{total:>18.2f}")


def pipeline_main(args, env: dict, hosts: Hosts) -> None:
    """Prompt tokens/s of a model whose layers are split over two servers, each pinned to a
    core of its own with one thread (``taskset``), read in one ubatch after another and in
    micro-batches that keep both servers busy at once (Context.n_micro)."""
    import os
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("--pipeline needs two cores")
        return
    servers = [ServerProcess("--threads", "1", *(("-H", hosts.address) if hosts.address else ()), env=env,
                             prefix=(*hosts.prefix, "taskset", "-c", str(cores[i]))) for i in range(2)]
    try:
        from pyggml.batch_rules import BATCH_RULES  # each sequence takes whole pages of cells
        n_ctx = max(1024, args.prompt_tokens + 16, 2 * BATCH_RULES.kv_page * max(args.sequences, default=0))
        m = pg.Model(args.model, n_ctx=n_ctx, rpc=[s.endpoint for s in servers],
                     n_batch=256, progress=False)
        ids = (m.tokenize(PROMPT * 64))[:args.prompt_tokens]
        micro, groups, results = m.context.n_micro, m.context.n_groups, {}
        decodes: dict[int, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for name, n_micro in (("one ubatch after another", 0), (f"micro-batches of {micro}", micro)):
                m.context.n_micro = n_micro
                m.context.clear()
                m.context.decode(ids[:16])  # graphs of both shapes made and sent once before timing
                m.context.clear()
                t0 = time.perf_counter()
                m.context.decode(ids)
                results.setdefault(name, []).append(len(ids) / (time.perf_counter() - t0))
            m.context.n_micro = micro
            for n_seq in args.sequences:
                for name, n_groups in (("one batch", 0), ("groups of sequences", groups)):
                    m.context.n_groups = n_groups
                    decodes.setdefault(n_seq, {}).setdefault(name, []).append(
                        batched_decode(m.context, n_seq, args.decode_steps))
        m.close()
    finally:
        for s in servers:
            s.stop()
    layers = "layers split over two servers pinned to one core each (--threads 1)"
    print_pipelining(f"model {args.model}, a {len(ids)}-token prompt, {layers}, median of {args.rounds} rounds:",
                     results)
    for n_seq, runs in decodes.items():
        print_pipelining(f"decode steps of {n_seq} sequences (top-k 40), {args.decode_steps} steps:", runs)


def print_pipelining(title: str, results: dict[str, list[float]]) -> None:
    """The median tokens/s without and with pipelining (in that order), and their ratio."""
    print(title)
    medians = {name: sorted(v)[len(v) // 2] for name, v in results.items()}
    for name, tps in medians.items():
        print(f"  {name:<28}{tps:>8.1f} tokens/s")
    base, piped = medians.values()
    print(f"  pipelining: {piped / base:.2f}x")


def batched_decode(ctx, n_seq: int, steps: int) -> float:
    """Generated tokens/s of ``n_seq`` sequences decoded together (a server's decode steps with
    every slot busy), each after a short prompt of its own."""
    from pyggml.models.context import Batch
    ctx.clear_cache()
    pos = []
    for i in range(n_seq):
        prompt = np.arange(8 + i % 5, dtype=np.int32) + 100 * (i + 1)
        ctx.decode_batch(Batch.of(prompt, 0, seq=i), n_top=40)
        pos.append(len(prompt))
    tokens, seqs = np.full(n_seq, 1, np.int32), np.arange(n_seq, dtype=np.int32)
    t0 = 0.0
    for step in range(steps + 2):  # two steps first: graphs made and sent
        if step == 2:
            t0 = time.perf_counter()
        top = ctx.decode_batch(Batch(tokens, np.array(pos, np.int32), seqs, np.ones(n_seq, bool)), n_top=40)
        tokens = top.ids[:, 0].astype(np.int32)
        pos = [p + 1 for p in pos]
    return n_seq * steps / (time.perf_counter() - t0)


def placements_main(args, env: dict, hosts: Hosts) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # the two of the split share this machine's cores, so they busy-wait little (--poll 3);
        # one server alone is started as one per machine would be (the default --poll)
        servers = [hosts.server("--cache-dir", f"{tmp}/cache{i}", "--poll", "3", env=env) for i in range(2)]
        solo = hosts.server("--cache-dir", f"{tmp}/cache-solo", "--poll", "50", env=env)
        servers.append(solo)
        zmq_servers = ([hosts.server("--transport", "zmq", "--poll", "3", env=env) for _ in range(2)]
                       + [hosts.server("--transport", "zmq", "--poll", "50", env=env)]
                       if args.transport == "zmq" else [])
        servers += zmq_servers
        try:
            local = pg.Model(args.model, n_ctx=args.ctx, progress=False)
            weights = local.model.weights_nbytes()
            t0 = time.perf_counter()
            one = pg.Model(args.model, n_ctx=args.ctx, rpc=solo.endpoint, ngl="all", progress=False)
            first_load = time.perf_counter() - t0
            upload = one.rpc_devices[0].conn.bytes_sent
            two, via = (pg.Model(args.model, n_ctx=args.ctx, rpc=[s.endpoint for s in servers[:2]],
                                 ngl="0:prolog,epilog;1:all", progress=False) for _ in range(2))
            runs = {"local": (local, 0), "1 server, all layers": (one, 1), "2 servers, split": (two, 2),
                    "2 servers, via client": (via, 2)}  # activations between the servers through us
            if zmq_servers:
                runs["1 zmq server"] = (pg.Model(args.model, n_ctx=args.ctx, rpc=zmq_servers[2].endpoint, ngl="all",
                                                 progress=False), 1)
                runs["2 zmq servers, split"] = (pg.Model(args.model, n_ctx=args.ctx,
                                                         rpc=[s.endpoint for s in zmq_servers[:2]],
                                                         ngl="0:prolog,epilog;1:all", progress=False), 2)
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
            for _ in range(args.rounds):  # interleaved, so that a noisy moment hits every placement
                for name, (model, _n) in runs.items():
                    rpc_backend.PEERS = model is not via
                    results[name].append(generation(model, args.tokens))
                rpc_backend.PEERS = True
                print("round: " + ", ".join(f"{name} {r[-1][0]:.1f} tokens/s" for name, r in results.items()),
                      file=sys.stderr)
            rows = []
            for name, (model, n) in runs.items():
                tps = sorted(r[0] for r in results[name])[len(results[name]) // 2]  # the median run
                median = sorted(results[name], key=lambda r: r[0])[len(results[name]) // 2]
                rows.append((name, tps, median[1], n, median[2]))
                if n:
                    model.close()
            local_tps = rows[0][1]

            cached_load, cached_upload = timed_load(args, solo.endpoint)
        finally:
            for s in servers:
                s.stop()
        holder = hosts.server("--gguf", str(pg.hub.resolve(args.model)), env=env)  # hashes it once (remembered)
        try:
            disk_load, disk_upload = timed_load(args, holder.endpoint)
        finally:
            holder.stop()
        pair = [hosts.server(env=env), hosts.server(env=env)]  # failover: kill -9 of one mid-generation
        try:
            m = pg.Model(args.model, n_ctx=args.ctx, rpc=[s.endpoint for s in pair], progress=False, failover=True)
            tokens = m.generate(m.tokenize("1, 2, 3, 4, 5, 6, 7,"), max_tokens=64, temperature=0)  # goes on
            for _ in range(8):
                next(tokens)
            pair[1].kill()
            t0 = time.perf_counter()
            next(tokens)
            recovery = time.perf_counter() - t0
            list(tokens)
            m.close()
        finally:
            for s in pair:
                s.stop()

    print(f"model {args.model}: {weights / 2**20:.1f} MiB of weights, {args.tokens} generated tokens x "
          f"{args.rounds} rounds, "
          f"{pg.cpu_device().get_description()}")
    print(f"{'placement':<24}{'tokens/s':>10}{'ms/token':>10}{'added ms/token/server':>24}{'wire bytes/token':>18}"
          f"{'client ms/token':>17}")
    for name, tps, per_token, n, wait in rows:
        added = (1000 / tps - 1000 / local_tps) / n if n else 0.0
        client = 1000 / tps - 1000 * wait  # what the client itself spent; the rest was waiting for servers
        print(f"{name:<24}{tps:>10.1f}{1000 / tps:>10.2f}{added:>24.2f}{per_token:>18.0f}{client:>17.2f}")
    print("(client ms/token of a remote placement: the time not spent waiting for a server's answer)")
    if args.llama_cpp:
        print_llama_cpp(llama_cpp_rows(args.llama_cpp, pg.hub.resolve(args.model), args.tokens, hosts=hosts),
                        {name: tps for name, tps, *_ in rows}, args.tokens)
    print(f"first load onto a server: {first_load:.2f} s, {upload / 2**20:.1f} MiB sent "
          f"({upload / 2**20 / first_load:.0f} MB/s including file reading and hashing)")
    print(f"cached second load:       {cached_load:.2f} s, {cached_upload / 2**20:.2f} MiB sent "
          f"({first_load / cached_load:.1f}x faster)")
    print(f"from the server's --gguf: {disk_load:.2f} s, {disk_upload / 2**20:.2f} MiB sent "
          f"({disk_upload / weights:.2%} of the weights; {first_load / disk_load:.1f}x faster than uploading)")
    print(f"failover, kill -9 to the next token: {recovery:.2f} s (one of two servers; the survivor reloads "
          f"the model by upload and replays the cache)")


if __name__ == "__main__":
    main()
