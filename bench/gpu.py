"""GPU benchmark: quantized matrix-vector kernels against the device's copy bandwidth, and
end-to-end prompt / generation speed of llama-shaped models this script writes itself.

    python bench/gpu.py                       # kernels + models of ~1B and ~8B parameters
    python bench/gpu.py --sizes 1b --no-kernels
    python bench/gpu.py --device CPU --sizes tiny   # checks the model writer and loader without a GPU
    PYTHONPATH=tests/cuda/fake python bench/gpu.py --sizes tiny --kernel-shapes 64x512 --iters 2 --copy-mib 8
                                                    # the whole script on the CUDA emulator (figures meaningless)

No model can be carried to the GPU machine, so the models are written here with the gguf
package: random weights in Q4_K (attention, FFN), Q6_K (output head) and Q8_0 (embedding),
with small finite block scales so that the numbers stay finite.  Speeds are what matter.
On a GPU, generation is timed three ways (pyggml/cuda/replay.py): every step through the op
table, from the launches recorded on a step graph's second run, and as the CUDA graph
captured on its third.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyggml as pg  # noqa: E402
from pyggml.quants.layouts import LAYOUTS  # noqa: E402
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

SIZES = {  # n_embd, n_layer, n_ff, n_head, n_head_kv, n_vocab
    "tiny": (256, 2, 512, 4, 2, 1024),
    "1b": (2048, 16, 8192, 32, 8, 32000),
    "8b": (4096, 32, 14336, 32, 8, 128256),
}
KERNEL_SHAPES = "4096x4096,14336x4096,4096x14336"  # rows M x columns K
KERNEL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


def random_blocks(qtype: pg.Type, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=rows * qtype.row_size(cols), dtype=np.uint8)
    blocks = raw.view(LAYOUTS[qtype])
    for field in ("d", "m", "dmin"):
        if field in blocks.dtype.names:
            blocks[field] = np.float16(0.002)
    if "e" in blocks.dtype.names:  # MXFP4's E8M0 scale: 2^-9
        blocks["e"] = 119
    return raw.reshape(rows, -1)


# -- kernels ---------------------------------------------------------------------------------------

def copy_bandwidth(cp, mib: int = 1024) -> float:
    """Device-to-device copy GB/s (bytes read + written), the ceiling for a streaming kernel."""
    a = cp.zeros(mib << 20, dtype=cp.uint8)
    b = cp.empty_like(a)
    b[...] = a
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        b[...] = a
    stop.record()
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1000 / 10
    return 2 * a.nbytes / seconds / 1e9


def bench_kernels(cp, bandwidth: float, shapes: list[tuple[int, int]], n: int = 50,
                  rotate_mib: int = 256) -> list[tuple]:
    """The matrix-vector kernel alone (activations quantized once), n launches back to back:
    captured as one CUDA graph, so that the host's launch cost does not leave the GPU idle
    between them (4096 x 4096 in Q4_K is ~2 us of DRAM time, less than a launch from Python),
    and cycling through copies of the weights that together exceed the L2 cache (H200: 60 MB),
    so that every launch streams its weights from memory, as a decode step does."""
    from pyggml.cuda import replay
    from pyggml.cuda.kernels import begin_graph, mul_mat_vec_q
    rng = np.random.default_rng(0)
    rows = []
    for name in KERNEL_TYPES:
        qtype = pg.Type[name]
        for m, k in shapes:
            w = cp.asarray(random_blocks(qtype, m, k, rng))
            copies = [w] + [w.copy() for _ in range(min(n, -(-(rotate_mib << 20) // w.nbytes)) - 1)]
            x = cp.asarray(rng.standard_normal((1, k), dtype=np.float32))
            out = cp.empty((1, m), dtype=cp.float32)
            begin_graph()
            mul_mat_vec_q(w, qtype, x, out, key=("bench",))  # quantizes x, once
            with replay.recording(True) as launches:
                for i in range(n):
                    mul_mat_vec_q(copies[i % len(copies)], qtype, x, out, key=("bench",))
            try:
                run = replay.capture(launches).launch
            except Exception as e:  # noqa: BLE001 - then the launches one by one (host cost included)
                print(f"  ({name} {m}x{k}: CUDA graph capture failed: {e}; timing launches from Python)")
                run = launches.run
            run()
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            run()
            stop.record()
            stop.synchronize()
            seconds = cp.cuda.get_elapsed_time(start, stop) / 1000 / n
            gbs = w.nbytes / seconds / 1e9
            rows.append((name, m, k, seconds * 1e6, gbs, gbs / bandwidth))
            del copies, w
    return rows


# -- end to end ------------------------------------------------------------------------------------

def write_llama(path: Path, size: str) -> None:
    import gguf
    n_embd, n_layer, n_ff, n_head, n_kv, n_vocab = SIZES[size]
    head = n_embd // n_head
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-llama-{size}")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    def quant(name: str, qtype: str, rows: int, cols: int) -> None:
        t = pg.Type[qtype]
        w.add_tensor(name, random_blocks(t, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType(int(t)))

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    quant("token_embd.weight", "Q8_0", n_vocab, n_embd)
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight")
        quant(f"blk.{il}.attn_q.weight", "Q4_K", n_embd, n_embd)
        quant(f"blk.{il}.attn_k.weight", "Q4_K", n_kv * head, n_embd)
        quant(f"blk.{il}.attn_v.weight", "Q4_K", n_kv * head, n_embd)
        quant(f"blk.{il}.attn_output.weight", "Q4_K", n_embd, n_embd)
        norm(f"blk.{il}.ffn_norm.weight")
        quant(f"blk.{il}.ffn_gate.weight", "Q4_K", n_ff, n_embd)
        quant(f"blk.{il}.ffn_up.weight", "Q4_K", n_ff, n_embd)
        quant(f"blk.{il}.ffn_down.weight", "Q6_K", n_embd, n_ff)
    norm("output_norm.weight")
    quant("output.weight", "Q6_K", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def profile_decode(ctx, token: int, n: int = 4) -> list[tuple[str, float, int]]:
    """Where a decode step's time goes on the GPU: each op kind's milliseconds per token, with
    the device synchronized around every op (so launches and Python count where they happen;
    the total is above the unprofiled step).  Returns (op, ms per token, ops per token)."""
    import cupy as cp

    from pyggml.cuda import kernels as cuda_kernels
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}

    def timed(name, fn):
        def run(*args):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn(*args)
            cp.cuda.Device().synchronize()
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
            counts[name] = counts.get(name, 0) + 1
        return run
    with cuda_kernels.instrumented(timed), replay_mode("op table"):  # (a replay would skip the op table)
        for _ in range(n):
            token = int(ctx.decode([token])[-1].argmax())
    return sorted(((k, v * 1000 / n, counts[k] // n) for k, v in seconds.items()), key=lambda r: -r[1])


# How a CUDA decode step runs (pyggml/cuda/replay.py): through the op table every time, from
# the launches recorded on its second run, or as the CUDA graph captured on its third.
REPLAY_MODES = {"op table": {"PYGGML_CUDA_REPLAY": "0"}, "launches": {"PYGGML_CUDA_GRAPHS": "0"}, "CUDA graph": {}}


@contextmanager
def replay_mode(mode: str):
    saved = {k: os.environ.pop(k, None) for k in ("PYGGML_CUDA_REPLAY", "PYGGML_CUDA_GRAPHS")}
    os.environ.update(REPLAY_MODES[mode])
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def bench_model(path: Path, device_name: str, n_prompt: int, n_gen: int,
                profile: bool = False) -> tuple[float, float, dict[str, float], int, list]:
    """Load time, prompt tokens/s, generation tokens/s by replay mode (one mode off CUDA), weight
    bytes, and the decode profile.  Every mode generates from the same position after the prompt."""
    from pyggml.models import Context, load_model
    from pyggml.models.loader import default_devices
    devices = default_devices()
    index = next(i for i, d in enumerate(devices) if d.get_name().lower() == device_name.lower())
    t0 = time.perf_counter()
    model = load_model(path, ngl=f"{index}:all", devices=devices, progress=False)
    load = time.perf_counter() - t0
    cuda = device_name.upper().startswith("CUDA")
    modes = list(REPLAY_MODES) if cuda else ["op table"]
    ctx = Context(model, n_ctx=n_prompt + n_gen + 16)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, model.hp.n_vocab, size=n_prompt).tolist()
    ctx.decode(prompt)  # warm up: kernels compiled, both graphs built and placed
    ctx.decode([prompt[0]])
    ctx.clear()
    t0 = time.perf_counter()
    logits = ctx.decode(prompt)
    pp = n_prompt / (time.perf_counter() - t0)
    first = int(logits[-1].argmax())
    tg = {}
    for mode in modes:
        with replay_mode(mode):
            ctx.truncate(n_prompt)
            token = first
            for _ in range(3):  # the step's graph: built, recorded, captured (as a user's first tokens)
                token = int(ctx.decode([token])[-1].argmax())
            t0 = time.perf_counter()
            for _ in range(n_gen):
                token = int(ctx.decode([token])[-1].argmax())
            tg[mode] = n_gen / (time.perf_counter() - t0)
    ctx.truncate(n_prompt)
    rows = profile_decode(ctx, first) if profile and cuda else []
    nbytes = model.weights_nbytes()
    model.free()
    return load, pp, tg, nbytes, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="CUDA0")
    ap.add_argument("--sizes", default="1b,8b", help=f"comma-separated: {', '.join(SIZES)}")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--kernel-shapes", default=KERNEL_SHAPES, help="matrix-vector shapes, MxK,...")
    ap.add_argument("--iters", type=int, default=50, help="timed launches per kernel shape")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the copy that measures bandwidth")
    ap.add_argument("--rotate-mib", type=int, default=256,
                    help="the kernels cycle through copies of their weights of at least this size (beyond L2)")
    ap.add_argument("--profile", action="store_true", help="also time a decode step op by op")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--dir", default=None, help="where to write the models (default: a temporary directory)")
    perfdoc.add_argument(ap)
    args = ap.parse_args()
    perfdoc.start(args)

    bandwidth = None
    if args.device.upper().startswith("CUDA") and not args.no_kernels:
        import cupy as cp
        bandwidth = copy_bandwidth(cp, args.copy_mib)
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.kernel_shapes.split(",")]
        from pyggml.cuda import cuda_devices
        print(f"device copy bandwidth: {bandwidth:.0f} GB/s ({cuda_devices()[0].get_description()})")
        print(f"{'type':<6}{'M':>7}{'K':>7}{'us':>9}{'GB/s':>9}{'of copy':>9}")
        for name, m, k, us, gbs, frac in bench_kernels(cp, bandwidth, shapes, args.iters, args.rotate_mib):
            print(f"{name:<6}{m:>7}{k:>7}{us:>9.1f}{gbs:>9.0f}{frac:>9.0%}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in filter(None, args.sizes.split(",")):
            path = Path(tmp) / f"llama-{size}.gguf"
            t0 = time.perf_counter()
            write_llama(path, size)
            written = time.perf_counter() - t0
            load, pp, tg, nbytes, profile = bench_model(path, args.device, args.prompt, args.gen, args.profile)
            gen = ", ".join(f"{tps:.1f} ({mode})" if len(tg) > 1 else f"{tps:.1f}" for mode, tps in tg.items())
            print(f"llama {size} ({nbytes / 2**30:.2f} GiB of weights) on {args.device}: written in {written:.1f} s, "
                  f"loaded in {load:.1f} s; prompt {pp:.1f} tokens/s ({args.prompt} tokens), "
                  f"generation {gen} tokens/s")
            best = max(tg.values())  # a decode step reads every weight once: its bandwidth in effect
            print(f"  fastest generation reads the weights at {nbytes * best / 1e9:.0f} GB/s"
                  + (f" ({nbytes * best / 1e9 / bandwidth:.0%} of the copy bandwidth)" if bandwidth else ""))
            if profile:
                print(f"  decode profile ({sum(r[1] for r in profile):.2f} ms per token with a sync around every op):")
                for name, ms, count in profile:
                    print(f"    {name:<16}{ms:>8.3f} ms  {count:>5} ops")
            path.unlink()


if __name__ == "__main__":
    main()
