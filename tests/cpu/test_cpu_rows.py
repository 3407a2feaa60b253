"""Row kernels (pyggml/cpu/rows.py): one parallel loop calls each op's C function over chunks of
rows, so every row must come out as it does alone, for any number of rows; the entry points
refuse arrays the C functions would misread; divisions by zero give C's inf and NaN, as ggml's."""
from __future__ import annotations

import numpy as np
import pytest

from pyggml.cpu import nn
from pyggml.cpu.activations import activation_arrays, quantize_call, quantize_q8, quantize_q8_serial
from pyggml.cpu.fusion import scatter_call
from pyggml.cpu.kinds import Act, DECODER
from pyggml.cpu.qdecode import F16_TABLE, decode_rows
from pyggml.cpu.rows import run_calls
from pyggml.quants import quantize
from pyggml.types import Type

f32 = np.float32
ROW_COUNTS = [0, 1, 2, 3, 63, 64, 65, 130]  # none, one (this thread), fewer and more than the chunks


def _rows(n: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(f32) * f32(3)


def _each_alone(kernel, *inputs: np.ndarray) -> np.ndarray:
    """kernel(*row_i, out_i) row by row: what one call over all rows must equal."""
    out = np.empty_like(inputs[0])
    for r in range(inputs[0].shape[0]):
        kernel(*(x[r:r + 1] for x in inputs), out[r:r + 1])
    return out


@pytest.mark.parametrize("n", ROW_COUNTS)
def test_rows_of_one_call_equal_each_row_alone(n):
    a, g = _rows(n, 576), _rows(n, 576, seed=1)
    for kernel, inputs in ((nn.swiglu, (a, g)), (nn.geglu, (a, g)), (nn.silu, (a,)), (nn.gelu, (a,)),
                           (lambda x, out: nn.rms_norm(x, 1e-6, out), (a,))):
        out = np.full_like(a, np.nan)
        kernel(*inputs, out)
        np.testing.assert_array_equal(out, _each_alone(kernel, *inputs))
    soft = a.copy()
    nn.softmax_rows(soft)
    alone = a.copy()
    for r in range(n):
        nn.softmax_rows(alone[r:r + 1])
    np.testing.assert_array_equal(soft, alone)


@pytest.mark.parametrize("n", ROW_COUNTS)
@pytest.mark.parametrize("kind", [Act.Q8_0, Act.Q8_1, Act.Q8_K])
def test_activations_quantize_the_same_in_threads_and_in_this_one(n, kind):
    x = _rows(n, 512)
    threads, alone = activation_arrays(n, 512, int(kind)), activation_arrays(n, 512, int(kind))
    quantize_q8(x, int(kind), *threads)
    quantize_q8_serial(x, int(kind), *alone)
    for a, b in zip(threads, alone):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", ROW_COUNTS)
def test_rope_rows_equal_each_token_alone(n):
    x = _rows(n * 4, 64).reshape(1, n, 4, 64)
    cos, sin = nn.rope_cache(np.arange(n), 32, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 4096, np.ones(1, dtype=f32), False)
    for neox in (False, True):
        out = np.empty_like(x)
        nn.rope_rotate(x, out, cos, sin, 32, neox)
        for t in range(n):
            one = np.empty_like(x[:, t:t + 1])
            nn.rope_rotate(np.ascontiguousarray(x[:, t:t + 1]), one, cos[t:t + 1].copy(), sin[t:t + 1].copy(), 32, neox)
            np.testing.assert_array_equal(out[:, t:t + 1], one)
        np.testing.assert_array_equal(out[..., 32:], x[..., 32:])  # past n_dims: copied


@pytest.mark.parametrize("n", ROW_COUNTS)
@pytest.mark.parametrize("qtype", [Type.Q8_0, Type.Q4_K])
def test_decoded_rows_equal_each_row_alone(n, qtype):
    w = quantize(_rows(n, 256), qtype) if n else np.zeros((0, qtype.row_size(256)), dtype=np.uint8)
    kind = int(DECODER[qtype])
    out = np.full((n, 256), np.nan, dtype=f32)
    decode_rows(kind, w, out, F16_TABLE)
    for r in range(n):
        one = np.empty((1, 256), dtype=f32)
        decode_rows(kind, w[r:r + 1], one, F16_TABLE)
        np.testing.assert_array_equal(out[r], one[0])


def test_arrays_a_row_kernel_would_misread_are_refused():
    a = _rows(4, 64)
    with pytest.raises(ValueError):
        nn.swiglu(a[:, ::2], a[:, ::2], np.empty((4, 32), dtype=f32))  # rows not contiguous
    with pytest.raises(ValueError):
        nn.swiglu(a, a[:2], np.empty_like(a))  # shapes differ
    with pytest.raises(ValueError):
        nn.rms_norm(a, 1e-6, np.empty((4, 32), dtype=f32))
    with pytest.raises(ValueError):
        quantize_q8(a, int(Act.Q8_0), *activation_arrays(2, 64, int(Act.Q8_0)))  # for fewer rows
    x = a.reshape(1, 4, 1, 64)
    cos, sin = nn.rope_cache(np.arange(2), 32, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 4096, np.ones(1, dtype=f32), False)
    with pytest.raises(ValueError):
        nn.rope_rotate(x, np.empty_like(x), cos, sin, 32, False)  # angles for 2 of 4 tokens
    with pytest.raises(ValueError):
        decode_rows(int(DECODER[Type.Q8_0]), quantize(a, Type.Q8_0), np.empty((3, 64), dtype=f32), F16_TABLE)


def test_a_division_by_zero_gives_what_c_gives():
    """numpy's error model (simd.KERNEL): a row of zeros normed with eps 0 is NaN, as ggml's
    0 * (1 / sqrtf(0)), not an exception."""
    out = np.empty((2, 64), dtype=f32)
    nn.rms_norm(np.zeros((2, 64), dtype=f32), 0.0, out)
    assert np.isnan(out).all()


FIRST_CALLS = """
import sys
import numpy as np
from pyggml.cpu import nn
x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
out = np.empty_like(x)
if sys.argv[1] == "softmax":
    nn.softmax_rows(x.copy())  # compiles run_table
else:  # the first thing this process runs: several rows, on the threads
    nn.rms_norm(x, 1e-6, out)
print("ran", bool(np.isfinite(out[:, :1]).all()) if sys.argv[1] == "norm" else True)
"""


def test_a_process_that_loads_the_kernels_from_the_cache_runs_them_on_its_threads(tmp_path):
    """Row kernels loaded from numba's cache run on its threads from a process's first call
    (numba starts them for a parallel function it compiles or that Python calls; its cache did
    not carry that need when row kernels ran inside compiled entry points): rows.row_kernel
    starts them.  Three processes on one fresh cache: the first compiles run_table, the second
    RMS norm's rows, the third loads both and runs them first thing."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    for what in ("softmax", "norm", "norm"):
        done = subprocess.run([sys.executable, "-c", FIRST_CALLS, what], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["ran", "True"]


@pytest.mark.parametrize("n", [1, 3, 65])
def test_elementwise_rows_round_as_numpy(n):
    """The residual adds, weight rows, scales that a plan runs as calls: each value as numpy's
    float32 operation gives it, b of the same rows or one row for all; zeros, infinities and
    NaN included."""
    a, b = _rows(n, 96), _rows(n, 96, seed=1)
    a[0, :4] = [0.0, np.inf, -np.inf, np.nan]
    b[0, :4] = [0.0, 0.0, np.inf, 1.0]
    for op, fn in ((nn.ADD, np.add), (nn.SUB, np.subtract), (nn.MUL, np.multiply), (nn.DIV, np.divide)):
        for other in (b, b[:1]):
            out = np.full_like(a, np.nan)
            run_calls([nn.elementwise_call(op, a, np.ascontiguousarray(other), out)])
            with np.errstate(all="ignore"):
                np.testing.assert_array_equal(out.view(np.uint32), fn(a, other).view(np.uint32))
    for scale, bias in ((f32(0.125), f32(0.0)), (f32(-3.7), f32(1.5))):
        out = np.full_like(a, np.nan)
        run_calls([nn.elementwise_call(nn.SCALE, a, None, out, scale, bias)])
        expected = a * scale
        if bias:
            expected += bias
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_calls_a_row_kernel_would_misread_are_refused():
    a = _rows(4, 64)
    with pytest.raises(ValueError):
        nn.elementwise_call(nn.ADD, a, a[:2], np.empty_like(a))  # neither a's rows nor one row
    with pytest.raises(ValueError):
        nn.elementwise_call(nn.MUL, a, a.astype(np.float64), np.empty_like(a))  # not float32
    with pytest.raises(ValueError):
        nn.set_rows_f16_call(a, np.arange(3, dtype=np.int64), np.zeros((8, 64), dtype=np.uint16))  # ids for 3 rows of 4
    with pytest.raises(ValueError):
        scatter_call(a, np.array([a.ctypes.data], dtype=np.int64), np.array([0, 65], dtype=np.int64))  # past the row
    yq, yd, ys = activation_arrays(4, 64, int(Act.Q8_0))
    with pytest.raises(ValueError):
        quantize_call(a, int(Act.Q8_0), yq[:2], yd, ys)
    mask = np.zeros((1, 8), dtype=f32)
    cells = np.zeros((8, 64), dtype=np.uint16)
    alone, n_seen, seen = nn.row_cells(mask)
    with pytest.raises(ValueError):  # 8 cells of 64 values: 2 heads of 32 for a query of 64
        nn.attention_call(np.ones((2, 1, 64), dtype=f32), cells, cells, 2, mask, alone, n_seen, seen,
                          np.zeros((0, 0), dtype=f32), 0.125, 0.0, np.empty((1, 2, 32), dtype=f32))


def test_an_index_out_of_the_cache_is_refused():
    with pytest.raises(IndexError):
        nn.set_rows_f16(_rows(2, 64), np.array([0, 8], dtype=np.int64), np.zeros((8, 64), dtype=np.uint16))


def test_each_row_kernels_argument_record_is_its_signature():
    """A row kernel's arguments are declared once, by its parameters (rows.row_args): the record
    names them in order, leaves out the slots it does not read, and packs each value into its
    own slot of ROW_KERNEL's ten integers and two floats."""
    import inspect
    import re
    from pyggml.cpu import activations, fusion, nn, qdot
    pairs = [(nn.SoftmaxArgs, nn._softmax_rows), (nn.NormArgs, nn._norm_rows), (nn.ElementwiseArgs, nn._elementwise_rows),
             (nn.GluArgs, nn._silu_rows), (nn.GluArgs, nn._gelu_rows), (nn.RopeArgs, nn._rope_rows),
             (nn.SetRowsArgs, nn._set_rows_f16_rows), (activations.QuantizeArgs, activations._quantize_rows),
             (fusion.ScatterArgs, fusion._scatter_rows), (qdot.ActivationBytesArgs, qdot._activation_bytes_rows)]
    for record, kernel in pairs:
        params = list(inspect.signature(kernel).parameters)[2:]
        assert record._fields == tuple(p for p in params if not re.fullmatch(r"[if]\d+", p)), kernel.__name__
    ints, floats = nn.NormArgs(summed_at=5, normed_at=9, n=7, eps=0.5).packed()
    assert ints == (0, 0, 5, 0, 9, 0, 7, 0, 0, 0) + (0,) * 6 and floats == (0.5, 0.0)
    assert nn.ElementwiseArgs(op=nn.SCALE, scale=2.0, bias=-1.0).packed()[1] == (2.0, -1.0)
    with pytest.raises(TypeError):
        nn.NormArgs(i9=1)  # a slot the kernel does not read has no name
