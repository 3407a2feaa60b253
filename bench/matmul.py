"""MUL_MAT throughput per weight type on model-sized shapes (prints a table; asserts nothing).

GB/s counts the weight bytes read per product; GFLOP/s counts 2*M*K*N.  Matrix-vector
(N=1) is the token-by-token decoding case, matrix-matrix (N=64) prompt processing.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import pyggml as pg
from pyggml import Type, ops
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)

TYPES = [Type.F32, Type.F16, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q2_K, Type.Q3_K,
         Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.IQ4_NL, Type.IQ4_XS]
SHAPES = [(576, 1536), (1536, 576), (2048, 2048), (4096, 4096)]  # (K, M): SmolLM2 FFN up/down, 1B- and 8B-like


def random_weight(qtype: Type, k: int, m: int) -> pg.Tensor:
    rng = np.random.default_rng(0)
    w = pg.new_tensor(qtype, (k, m), "w")
    pg.alloc_tensors([w], pg.cpu_device().get_buffer_type())
    if qtype in pg.quants.QUANTIZABLE:
        data = pg.quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype)
    else:  # random blocks with sane scales: quantize to Q8_0-free bytes, then fix up the halves
        from pyggml.quants.layouts import LAYOUTS
        data = rng.integers(0, 256, size=(m, qtype.row_size(k)), dtype=np.uint8)
        blocks = data.reshape(-1).view(LAYOUTS[qtype])
        for name in LAYOUTS[qtype].names:
            if LAYOUTS[qtype][name].kind == "f":
                blocks[name] = 0.01
    pg.tensor_set(w, data)
    return w


def bench(qtype: Type, k: int, m: int, n: int, backend, min_time: float) -> tuple[float, float]:
    w = random_weight(qtype, k, m)
    x = pg.new_tensor(Type.F32, (k, n), "x").set_input()
    out = ops.mul_mat(w, x)
    graph = pg.build_forward(out)
    sched = pg.Scheduler([backend])
    sched.alloc_graph(graph)
    pg.tensor_set(x, np.random.default_rng(1).standard_normal((n, k)).astype(np.float32))
    sched.graph_compute(graph)  # compile and warm up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        sched.graph_compute(graph)
        reps += 1
    dt = (time.perf_counter() - start) / reps
    return w.nbytes() / dt / 1e9, 2 * m * k * n / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--types", default=",".join(t.name for t in TYPES))
    ap.add_argument("--threads", type=int, default=None)
    perfdoc.add_argument(ap)
    args = ap.parse_args()
    perfdoc.start(args)
    backend = pg.cpu_device().init_backend()
    if args.threads:
        backend.set_n_threads(args.threads)
    print(f"CPU backend, {backend.n_threads} threads")
    print(f"{'type':8} {'K x M':>11} | {'N=1 GB/s':>9} {'GFLOP/s':>8} | {'N=64 GB/s':>9} {'GFLOP/s':>8}")
    for name in args.types.split(","):
        qtype = Type[name]
        for k, m in SHAPES:
            if k % qtype.block_size:
                continue
            gbs1, gf1 = bench(qtype, k, m, 1, backend, args.min_time)
            gbs64, gf64 = bench(qtype, k, m, 64, backend, args.min_time)
            print(f"{qtype.name:8} {f'{k}x{m}':>11} | {gbs1:9.2f} {gf1:8.1f} | {gbs64:9.2f} {gf64:8.1f}", flush=True)


if __name__ == "__main__":
    main()
