"""Op parameter records and ggml_nbytes: the pieces every backend and the RPC validator share."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import pyggml as pg
from pyggml import Type, ops
from pyggml.opdefs import (PARAMS, ConcatParams, FlashAttnParams, GluOp, GluParams, NormParams, Op, OpParams,
                           PermuteParams, RopeMode, RopeParams, ScaleParams, SoftMaxParams, UnaryOp, UnaryParams)

EXAMPLES = [ScaleParams(0.5, -2.0), UnaryParams(UnaryOp.GELU_ERF), GluParams(GluOp.GEGLU, True), NormParams(1e-6),
            SoftMaxParams(0.125, 0.0), RopeParams(64, RopeMode.NEOX, 8192, 1e6, 0.25, 1.0, 1.1, 32.0, 1.0),
            PermuteParams(1, 0, 3, 2), ConcatParams(2), FlashAttnParams(0.0625, 0.0, 30.0)]


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: type(r).__name__)
def test_a_record_comes_back_from_its_slots(record: OpParams):
    slots = np.zeros(16, np.int32)
    record.pack(slots)
    assert type(record).unpack(slots) == record.__class__(*[np.float32(v) if isinstance(v, float) else v
                                                              for v in record.values()])


def test_the_slots_are_ggmls():
    """The wire carries op_params as they are: the same slots ggml uses (RoPE: n_dims in 1, mode
    in 2, n_ctx_orig in 4, the six floats from 5)."""
    x = pg.new_tensor(Type.F32, (64, 4, 3), "x")
    pos = pg.new_tensor(Type.I32, (3,), "pos")
    r = ops.rope_ext(x, pos, None, 32, RopeMode.NEOX, 4096, 5e5, 0.5, 1.0, 0.9, 16.0, 2.0)
    want = np.zeros(16, np.int32)
    want[1], want[2], want[4] = 32, 2, 4096
    want[5:11] = np.array([5e5, 0.5, 1.0, 0.9, 16.0, 2.0], np.float32).view(np.int32)
    assert np.array_equal(r.op_params, want)
    s = ops.soft_max_ext(x, None, 0.25)
    assert s.op_params.view(np.float32)[0] == 0.25 and not s.op_params[1:].any()
    g = ops.glu(x, x, GluOp.SWIGLU, swapped=True)
    assert g.op_params[:2].tolist() == [2, 1] and not g.op_params[2:].any()


def test_every_op_with_parameters_has_one_record():
    assert set(PARAMS) >= {Op.SCALE, Op.UNARY, Op.GLU, Op.NORM, Op.RMS_NORM, Op.SOFT_MAX, Op.ROPE, Op.CONCAT,
                           Op.FLASH_ATTN_EXT, Op.PERMUTE}


def test_an_unknown_enum_value_is_an_error():
    slots = np.zeros(16, np.int32)
    slots[0] = 99
    with pytest.raises(ValueError):
        UnaryParams.unpack(slots)


def _span(t: pg.Tensor) -> int:
    """One past the last byte any element (or block) of t occupies, from the addresses of all
    of them - computed without ggml's formula."""
    counts = (t.ne[0] // t.type.block_size, *t.ne[1:])
    index = np.indices(counts).reshape(4, -1)
    addresses = (np.array(t.nb)[:, None] * index).sum(axis=0)
    return int(addresses.max()) + t.type.type_size


TYPES = [t for t in Type if t.block_size > 0 and t.type_size > 0]


@pytest.mark.parametrize("type", TYPES, ids=lambda t: t.name)
def test_nbytes_is_ggmls_for_every_view(type):
    base = pg.new_tensor(type, (2 * type.block_size, 3, 4, 5), "base")
    assert base.nbytes() == _span(base) == type.row_size(base.ne[0]) * 60
    dims = [0, 1, 2, 3] if type.block_size == 1 else [1, 2, 3]  # a block type keeps its rows whole
    for perm in itertools.permutations(dims):
        axes = list(range(4))
        for d, p in zip(dims, perm):
            axes[d] = p
        view = ops.permute(base, *axes)
        assert view.nbytes() == _span(view), (type.name, axes)
    if type.block_size == 1:
        t = ops.transpose(pg.new_tensor(type, (4, 3), "t"))
        assert t.nbytes() == _span(t) == 12 * type.type_size  # a transposed [4, 3] F32 view: 48 bytes


def _llamacpp_enum(header: str, name: str) -> dict[str, int]:
    import re
    body = re.search(rf"enum {name} \{{(.*?)\}};", header, re.S).group(1)
    names = re.findall(r"^\s*([A-Z][A-Z0-9_]+)\s*[,=]", body, re.M)
    return {n: i for i, n in enumerate(names)}


def test_op_numbers_are_those_of_llama_cpps_ggml_h():
    """ggml-rpc 7.0.0 sends op numbers as ggml.h lists them; ours are the same (checked against
    the header where ../shared/bin/build-llamacpp left llama.cpp's sources)."""
    from pathlib import Path
    from pyggml.opdefs import GGML_OP_COUNT
    header = Path("~/.cache/llama.cpp-ref/src/ggml/include/ggml.h").expanduser()
    if not header.exists():
        pytest.skip(f"llama.cpp's sources are not here ({header}): run ../shared/bin/build-llamacpp")
    text = header.read_text()
    theirs = _llamacpp_enum(text, "ggml_op")
    assert theirs["GGML_OP_COUNT"] == GGML_OP_COUNT
    for op in Op:
        assert theirs[f"GGML_OP_{op.name}"] == op.value, op.name
    unary = _llamacpp_enum(text, "ggml_unary_op")
    for u in UnaryOp:
        if u.name != "GELU_TANH":  # (our alias of GELU)
            assert unary[f"GGML_UNARY_OP_{u.name}"] == u.value, u.name
    glu = _llamacpp_enum(text, "ggml_glu_op")
    for g in GluOp:
        assert glu[f"GGML_GLU_OP_{g.name}"] == g.value, g.name
