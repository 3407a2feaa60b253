"""GET_ROWS and SET_ROWS, the row ids checked at every step (they are data)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import quants
from ...tensor import Tensor
from ...types import Type
from .. import nn, router
from ..buffer import tensor_rows, tensor_view
from ..kinds import DECODER
from ..plan import TableStep
from ..qdecode import F16_TABLE, decode_rows_call
from ..qmatmul import dequantize_rows
from ..qmatmul import supports as quant_supported

from .base import Step, reader, _row_view


def _row_ids(t: Tensor, n_rows: int, what: str, shared: dict) -> Callable[[], np.ndarray]:
    """For a step that runs in Python: the row ids in t as int64, checked at every step to lie in
    [0, n_rows) - by the first step of the plan that reads t (_checked_ids), whose array the
    others read (a decode step's cache writes: two SET_ROWS per layer, all at the step's cells)."""
    ids, prepare = _checked_ids(t, n_rows, what, shared)
    if prepare is None:
        return lambda: ids

    def checked() -> np.ndarray:
        prepare()
        return ids
    return checked


def _checked_ids(t: Tensor, n_rows: int, what: str, shared: dict) -> tuple[np.ndarray, Callable[[], None] | None]:
    """The row ids in t as int64, in an array of the plan's that table calls read, and what
    fills and checks it before they run: the first step of the plan that reads t gets it (the
    others None)."""
    key = ("checked row ids", id(t), n_rows)
    if key in shared:
        return shared[key], None
    view = tensor_view(t)
    ids = shared[key] = np.empty(view.shape, dtype=np.int64)

    def prepare() -> None:
        ids[...] = view
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise IndexError(f"{what}: index out of range [0, {n_rows}) in {t.name or 'indices'}")
    return ids, prepare


def bind_get_rows(node: Tensor, shared: dict) -> Step:
    a, idx = node.src[0], node.src[1]
    out_rows = _row_view(node)
    if (quant_supported(a.type) and a.type.is_quantized and a.ne[2] == a.ne[3] == 1 and idx.ne[1] == idx.ne[2] == 1
            and out_rows is not None and tensor_rows(a)[0, 0].flags.c_contiguous):
        # an embedding's rows for a step's tokens, as a table's call (the ids checked before it runs)
        w, (ids, prepare) = tensor_rows(a)[0, 0], _checked_ids(idx, a.ne[1], "GET_ROWS", shared)
        return TableStep(lambda: [decode_rows_call(DECODER[a.type], w, out_rows, F16_TABLE, ids[0, 0, 0])], prepare,
                         reads=(idx,))
    if a.type == Type.F32 and idx.type == Type.I32 and tensor_view(node).flags.c_contiguous and a.nb[0] == 4:
        # float rows (a layer's outputs, a router's chosen weights) by ids the step may compute itself
        n_rows, name = a.ne[1], idx.name or "indices"
        picks = router.PickedRows(tensor_view(a), tensor_view(idx)[0], tensor_view(node), lambda bad: IndexError(
            f"GET_ROWS: index out of range [0, {n_rows}) in {name} ({bad})"))
        return TableStep(lambda: [picks.call()], picks.clear, hold=(picks,), check=picks.check)
    index = _row_ids(idx, a.ne[1], "GET_ROWS", shared)  # [1, i2, i1, n]
    out = tensor_view(node)    # [i2, i1, n, ne0]
    src = (lambda rows=tensor_rows(a): rows) if a.type.is_quantized else reader(a)
    decode = (lambda picked: dequantize_rows(picked, a.type, a.ne[0])) if quant_supported(a.type) \
        else (lambda picked: quants.dequantize(picked, a.type))

    def step() -> None:
        ids = index()
        rows = src()
        for i2 in range(idx.ne[2]):
            for i1 in range(idx.ne[1]):
                picked = rows[i2, i1][ids[0, i2, i1]]
                out[i2, i1] = decode(np.ascontiguousarray(picked)) if a.type.is_quantized else picked
    return step


def bind_set_rows(node: Tensor, shared: dict) -> Step:
    src, idx, dst = node.src[0], node.src[1], node.src[2]
    r2, r3 = src.ne[2] // idx.ne[1], src.ne[3] // idx.ne[2]
    quantized = node.type.is_quantized
    out = tensor_rows(node) if quantized else tensor_view(node)
    # the KV cache's writes (F32 rows into F16 ones, both contiguous): a table's calls, one per
    # matrix, the ids checked before the table runs
    if node.type == Type.F16 and src.type == Type.F32:
        halves, rows_in = out.view(np.uint16), tensor_view(src)
        matrices = [(rows_in[i3, i2], halves[i3, i2], i3 // r3, i2 // r2)
                    for i3 in range(src.ne[3]) for i2 in range(src.ne[2])]
        if all(a.flags.c_contiguous and b.flags.c_contiguous for a, b, _, _ in matrices):
            ids, prepare = _checked_ids(idx, dst.ne[1], "SET_ROWS", shared)  # (int64, each [0, j3, j2] a row)
            return TableStep(lambda: [nn.set_rows_f16_call(rows, ids[0, j3, j2], cache_rows)
                                      for rows, cache_rows, j3, j2 in matrices], prepare, reads=(idx,))
    index = _row_ids(idx, dst.ne[1], "SET_ROWS", shared)  # [1, i2, i1, n]
    x = reader(src)            # [s3, s2, n, ne0]

    def step() -> None:
        ids = index()
        xv = x()
        for i3 in range(src.ne[3]):
            for i2 in range(src.ne[2]):
                rows, at = xv[i3, i2], ids[0, i3 // r3, i2 // r2]
                out[i3, i2][at] = quants.quantize(rows, node.type) if quantized else rows
    return step
