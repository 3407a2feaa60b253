"""Write tests/data/ggml_vec_dot.npz: llama.cpp's own quantized dot products on random data.

Needs llama-cpp-python (any environment; not a dependency of pyggml): its ggml CPU library is
loaded with ctypes and its ``quantize_row_q8_*`` and ``ggml_vec_dot_*`` functions are called on
random weight blocks and activations.  tests/cpu/test_ggml_exact.py checks that pyggml's CPU
kernels give the same float32 bits.

    python tools/ggml_vec_dot_data.py --llama-python /path/to/venv/bin/python

``--lib PATH --types MXFP4`` takes another build's ``libggml-cpu.so`` (e.g. the one
``../shared/bin/build-llamacpp`` builds) for the types named, and adds them to the file: MXFP4
came after llama-cpp-python's build, and its vec_dot is the same AVX2 code on AVX2 and
AVX-512 machines.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "ggml_vec_dot.npz"

# (weight type, vec_dot function suffix, activation quantizer, activation block bytes, elements)
CASES = [("Q4_0", "q4_0_q8_0", "q8_0", 34, 32), ("Q4_1", "q4_1_q8_1", "q8_1", 36, 32),
         ("Q5_0", "q5_0_q8_0", "q8_0", 34, 32), ("Q5_1", "q5_1_q8_1", "q8_1", 36, 32),
         ("Q8_0", "q8_0_q8_0", "q8_0", 34, 32), ("Q4_K", "q4_K_q8_K", "q8_K", 292, 256),
         ("Q5_K", "q5_K_q8_K", "q8_K", 292, 256), ("Q6_K", "q6_K_q8_K", "q8_K", 292, 256),
         ("MXFP4", "mxfp4_q8_0", "q8_0", 34, 32)]
K, M, N = 512, 16, 3

RUN_IN_LLAMA_ENV = r'''
import ctypes, sys, numpy as np, pathlib
if LIB is None:
    import llama_cpp
lib = ctypes.CDLL(LIB or str(pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
lib.ggml_cpu_init()
P = ctypes.c_void_p
data = dict(np.load(sys.argv[1]))
out = {}
for name, vd, qa, bs, be in CASES:
    w, x = data[name + "_w"], data[name + "_x"]
    res = np.empty((x.shape[0], w.shape[0]), np.float32)
    for n in range(x.shape[0]):
        y = np.zeros(K // be * bs, np.uint8)
        getattr(lib, "quantize_row_" + qa)(np.ascontiguousarray(x[n]).ctypes.data_as(P), y.ctypes.data_as(P), ctypes.c_int64(K))
        for r in range(w.shape[0]):
            s = ctypes.c_float()
            row = np.ascontiguousarray(w[r])
            getattr(lib, "ggml_vec_dot_" + vd)(ctypes.c_int(K), ctypes.byref(s), ctypes.c_size_t(0), row.ctypes.data_as(P),
                                               ctypes.c_size_t(0), y.ctypes.data_as(P), ctypes.c_size_t(0), ctypes.c_int(1))
            res[n, r] = s.value
    out[name + "_out"] = res
np.savez(sys.argv[2], **data, **out)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", default=sys.executable, help="a Python interpreter that can import llama_cpp")
    ap.add_argument("--lib", default=None, help="another build's libggml-cpu.so instead of llama-cpp-python's")
    ap.add_argument("--types", default=None, help="only these types (comma-separated), added to the file")
    args = ap.parse_args()
    only = args.types.split(",") if args.types else None
    cases = [c for c in CASES if only is None or c[0] in only]
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import pyggml as pg
    from tests.test_quants import random_blocks
    rng = np.random.default_rng(7)
    data = {}
    for name, *_ in cases:
        t = pg.Type[name]
        data[name + "_w"] = random_blocks(t, n_rows=M, blocks_per_row=K // t.block_size, seed=int(t)).view(np.uint8).reshape(M, -1)
        if t == pg.Type.MXFP4:  # scales of 2**-18 .. 2**2: large enough not to vanish, small enough to stay finite
            data[name + "_w"].reshape(M, -1, t.type_size)[:, :, 0] = rng.integers(110, 131, (M, K // 32))
        data[name + "_x"] = (rng.standard_normal((N, K)) * 2).astype(np.float32)
    tmp = OUT.with_suffix(".in.npz")
    np.savez(tmp, **data)
    code = f"K = {K}\nCASES = {cases!r}\nLIB = {args.lib!r}\n" + RUN_IN_LLAMA_ENV
    fresh = OUT.with_suffix(".new.npz")
    subprocess.run([args.llama_python, "-c", code, str(tmp), str(fresh)], check=True)
    tmp.unlink()
    merged = {**(dict(np.load(OUT)) if only and OUT.exists() else {}), **dict(np.load(fresh))}
    fresh.unlink()
    np.savez(OUT, **merged)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
