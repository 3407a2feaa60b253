"""Device operations (kernel launches) per decoded token of the CUDA backend, op by op.

On a GPU, small ops cost their launch (and CuPy's Python around it), not their arithmetic, so
this count bounds decode speed as much as the weights' bandwidth does.  It is counted on the
CUDA emulator's CuPy stand-in, which counts every device operation CuPy would launch:

    PYTHONPATH=tests/cuda/fake python bench/gpu_launches.py [--model smollm2] [--host-time]

--host-time also times a decode step's host side (the kernels are not run) for each way a
step runs (pyggml/cuda/replay.py): through the op table, from its recorded launches, as a
CUDA graph.  It is pyggml's own Python per token: CuPy's launch cost (a few microseconds per
launch on a GPU) comes on top, except for the one launch of a CUDA graph.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyggml as pg  # noqa: E402
from bench.gpu import REPLAY_MODES, replay_mode  # noqa: E402
import perfdoc  # noqa: E402  (bench/perfdoc.py, beside this script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--host-time", action="store_true", help="also time the host side of a decode step")
    perfdoc.add_argument(ap)
    args = ap.parse_args()
    perfdoc.start(args)
    import cupy
    if not hasattr(cupy, "launches"):
        sys.exit("gpu_launches: needs the emulator's CuPy stand-in: PYTHONPATH=tests/cuda/fake")
    from pyggml.cuda import kernels as cuda_kernels
    launches, calls = collections.Counter(), collections.Counter()

    def counted(name, fn):
        def run(*args):
            before = cupy.launches
            fn(*args)
            launches[name] += cupy.launches - before
            calls[name] += 1
        return run
    with pg.Model(args.model, n_ctx=256, ngl="all", progress=False) as m:
        ids = m.tokenize("The capital of France is Paris. The capital of Italy is")
        m.context.decode(ids)
        with cuda_kernels.instrumented(counted):
            before = cupy.launches
            m.context.decode([ids[-1]])  # the step graph's first run: through the op table
            total = cupy.launches - before
        n_layer = m.model.hp.n_layer
        print(f"{args.model}: {total} device operations per decoded token ({total / n_layer:.1f} per layer, "
              f"{n_layer} layers)")
        for name, n in launches.most_common():
            print(f"  {name:<16}{n:>6} in {calls[name]:>4} ops ({n / calls[name]:.1f} each)")
        if args.host_time:
            cupy.run_kernels = False
            for mode in REPLAY_MODES:
                with replay_mode(mode):
                    m.context.truncate(len(ids))
                    for _ in range(3):  # built, recorded, captured
                        m.context.decode([ids[-1]])
                    t0, before, n = time.perf_counter(), cupy.launches, 20
                    for _ in range(n):
                        m.context.decode([ids[-1]])
                    ms = (time.perf_counter() - t0) * 1000 / n
                print(f"  host time per token, {mode + ':':<12}{ms:6.2f} ms, "
                      f"{(cupy.launches - before) / n:.0f} device operations launched")


if __name__ == "__main__":
    main()
