"""Every quant format against gguf's reference (de)quantizers, bit for bit."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyggml import Type, quants
from pyggml.cpu.qmatmul import dequantize_rows
from pyggml.quants.layouts import LAYOUTS

QUANTIZED = [t for t in Type if t.is_quantized]
GGUF_DEQUANT = [t for t in QUANTIZED if t not in (Type.Q8_1, Type.Q8_K)]  # gguf has no reference for these two


def random_blocks(qtype: Type, n_rows: int = 5, blocks_per_row: int = 3, seed: int = 0) -> np.ndarray:
    """Random bytes for every field, with the float fields set to finite random values."""
    rng = np.random.default_rng(seed + int(qtype))
    raw = rng.integers(0, 256, size=(n_rows, blocks_per_row * qtype.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1).view(LAYOUTS[qtype])
    for name in LAYOUTS[qtype].names:
        if LAYOUTS[qtype][name].kind == "f":
            blocks[name] = rng.standard_normal(blocks.shape).astype(LAYOUTS[qtype][name]) * 0.1
    if qtype == Type.MXFP4:  # E8M0 scales of 2**-18 .. 2**2: neither vanishing nor overflowing
        blocks["e"] = rng.integers(110, 131, blocks.shape)
    return raw


def test_type_table_matches_gguf():
    for t in Type:
        if t == Type.Q8_1:  # ggml's block_q8_1 is 2 halves + 32 quants = 36 bytes; gguf-py still says 40
            assert (t.block_size, t.type_size) == (32, 36)
            continue
        assert (t.block_size, t.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))], t


@pytest.mark.parametrize("qtype", GGUF_DEQUANT + [Type.F16, Type.BF16], ids=lambda t: t.name)
def test_dequantize_bit_identical_to_gguf(qtype):
    raw = random_blocks(qtype) if qtype.is_quantized else \
        np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32).astype(
            np.float16 if qtype == Type.F16 else np.float32)
    if qtype == Type.BF16:
        raw = quants.quantize(raw, Type.BF16)
    elif qtype == Type.F16:
        raw = raw.view(np.uint8)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    ours = quants.dequantize(raw, qtype)
    ours_gguf_enum = quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(ours, ours_gguf_enum)


@pytest.mark.parametrize("qtype", [Type.Q8_1, Type.Q8_K], ids=lambda t: t.name)
def test_dequantize_activation_types(qtype):
    """No gguf reference: check against the format definition, d * qs."""
    raw = random_blocks(qtype)
    blocks = raw.reshape(-1).view(LAYOUTS[qtype])
    expected = blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    assert np.array_equal(quants.dequantize(raw, qtype).reshape(expected.shape), expected)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_numba_row_decoders_match_numpy(qtype):
    raw = random_blocks(qtype, n_rows=7)
    k = raw.shape[1] // qtype.type_size * qtype.block_size
    assert np.array_equal(dequantize_rows(raw, qtype, k), quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.BF16],
                         ids=lambda t: t.name)
def test_quantize_bit_identical_to_gguf(qtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 256)).astype(np.float32) * rng.uniform(0.01, 10, (6, 1)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block takes the d == 0 branch
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    ours = quants.quantize(x, qtype)
    assert ours.dtype == np.uint8 and np.array_equal(ours, ref)


# normalized mean squared round-trip error on gaussian data; ggml's reference quantizers
# reach about 1.5e-3 (Q4_K), 8e-5 (Q6_K), 2e-5 (Q8_K): ours must be within 1.6x of those
@pytest.mark.parametrize("qtype,bound", [(Type.Q4_K, 6e-3), (Type.Q6_K, 4e-4), (Type.Q8_K, 6e-5), (Type.Q8_1, 6e-5)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_own_quantizers_round_trip(qtype, bound):
    x = np.random.default_rng(3).standard_normal((16, 1024)).astype(np.float32)
    q = quants.quantize(x, qtype)
    assert q.shape == (16, 1024 // qtype.block_size * qtype.type_size)
    y = quants.dequantize(q, qtype)
    nmse = float(((y - x) ** 2).mean() / (x ** 2).mean())
    assert nmse < bound
    if qtype == Type.Q8_K:  # bsums are the sums of each 16 quants
        b = q.reshape(-1).view(LAYOUTS[qtype])
        assert np.array_equal(b["bsums"], b["qs"].reshape(-1, 16, 16).astype(np.int64).sum(-1))


def test_quantize_rejects_partial_blocks():
    with pytest.raises(ValueError, match="block size"):
        quants.quantize(np.zeros((2, 40), np.float32), Type.Q8_0)
    with pytest.raises(ValueError, match="whole number of blocks"):
        quants.dequantize(np.zeros((2, 35), np.uint8), Type.Q8_0)
