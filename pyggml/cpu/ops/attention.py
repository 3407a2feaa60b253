"""FLASH_ATTN_EXT over an F16 cache, with the cells a mask shows worked out once per step."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...opdefs import (FlashAttnParams)
from ...tensor import Tensor
from ...types import Type
from .. import nn
from ..buffer import tensor_view
from ..plan import TableStep

from .base import f32, Step, reader, _shared_value


def _cells_by_cell(t: Tensor) -> tuple[Callable[[], list[np.ndarray]], list[np.ndarray] | None]:
    """Per ne3 slice, the K or V cache's cells as nn.attention_cells reads them ([cells,
    n_head_kv * d]: F16 bits, or float32 values): views of the cache made now where its heads lie
    side by side in each cell (also returned), else made from its values at every step (None)."""
    if t.type in (Type.F16, Type.F32):
        view = tensor_view(t)
        view = view.view(np.uint16) if t.type == Type.F16 else view
        cells = [nn.by_cell(view[i3]) for i3 in range(t.ne[3])]
        if all(np.may_share_memory(c, view) for c in cells):
            return (lambda: cells), cells
        return (lambda: [nn.by_cell(view[i3]) for i3 in range(t.ne[3])]), None
    values = reader(t)
    return (lambda: [nn.by_cell(x) for x in values()]), None


class _MaskCells:
    """A step's mask as the attention calls of a plan's table read it, for every layer: its
    rows cut to the cells some row sees and the row cells (nn.row_cells), laid out for that
    many cells in arrays made for all of them; and each call's sizes, whose cell count follows."""

    def __init__(self, mask: Tensor, n_tokens: int) -> None:
        self.view, self.n_tokens, width = tensor_view(mask), n_tokens, mask.ne[0]
        self.mask = np.zeros((n_tokens, width), dtype=f32)
        self.alone = np.zeros(n_tokens, dtype=np.bool_)
        self.n_seen = np.zeros(n_tokens, dtype=np.int64)
        self.cells = np.zeros((n_tokens, width), dtype=np.int32)
        self.sizes: list[np.ndarray] = []

    def prepare(self) -> None:
        m = self.view[0, 0, :self.n_tokens]
        seen = nn.seen_cells(m)
        cut = self.mask.reshape(-1)[:self.n_tokens * seen].reshape(self.n_tokens, seen)
        cut[...] = m[:, :seen]
        alone, n_seen, cells = nn.row_cells(cut)
        self.alone[...], self.n_seen[...] = alone, n_seen
        self.cells.reshape(-1)[:cells.size] = cells.reshape(-1)
        for sizes in self.sizes:
            sizes[nn.SIZES_CELLS] = seen


def _attention_table_step(node: Tensor, shared: dict, scratch: np.ndarray, keys: list[np.ndarray] | None,
                          values: list[np.ndarray] | None) -> TableStep | None:
    """FLASH_ATTN_EXT as a table's call, where its arrays stay where they are from step to step
    (a decoding step's: one sequence's token, the cache read in place, the mask an input); None
    elsewhere."""
    q, k, v, mask = node.src[:4]
    if (keys is None or values is None or mask is None
            or mask.type != Type.F32 or q.type != Type.F32 or q.ne[3] != 1):
        return None
    qv, out = tensor_view(q)[0], tensor_view(node)[0]
    if not (qv.flags.c_contiguous and out.flags.c_contiguous and mask.ne[1] >= q.ne[1]):
        return None
    p = FlashAttnParams.of(node)
    key = ("attention mask table", id(mask), q.ne[1])
    first = key not in shared
    cut = shared[key] = shared.get(key) or _MaskCells(mask, q.ne[1])
    sinks = _sinks(node)
    call, sizes = nn.attention_call(qv, keys[0], values[0], k.ne[2], cut.mask, cut.alone, cut.n_seen, cut.cells,
                                    scratch, f32(p.scale), f32(p.logit_softcap), out, sinks)
    cut.sizes.append(sizes)
    return TableStep(lambda: [call], cut.prepare if first else None, reads=(mask,),
                     hold=(sizes, cut, scratch, qv, out, keys, values, sinks))  # (the call has their addresses only)


def _sinks(node: Tensor) -> np.ndarray | None:
    """FLASH_ATTN_EXT's attention sinks (its fifth source, F32 [n_head]) as they lie, or None."""
    sinks = node.src[4] if len(node.src) > 4 else None
    return tensor_view(sinks).reshape(-1) if sinks is not None else None


def bind_flash_attn_ext(node: Tensor, shared: dict) -> Step:
    """Attention with the rounding of llama.cpp's unfused path over an F16 cache (KQ =
    mul_mat(K, Q), softmax, mul_mat(V, KQ)), as nn.attention_cells computes it, reading the
    cache where it lies."""
    q, k, v, mask = node.src[:4]
    p = FlashAttnParams.of(node)
    scale, softcap = f32(p.scale), f32(p.logit_softcap)
    n_tokens, n_kv, n_head_kv = q.ne[1], k.ne[1], k.ne[2]
    out = tensor_view(node)      # [ne3, n_tokens, n_head, dv]
    (keys, fixed_keys), (values, fixed_values) = _cells_by_cell(k), _cells_by_cell(v)
    qv = reader(q)
    direct = out.flags.c_contiguous
    # the rows' working arrays (a slot per chunk of rows), kept from step to step; the steps of
    # a plan run one after another: its layers share them
    n_rows, d, dv = q.ne[2] * n_tokens, q.ne[0], v.ne[0]
    key = ("attention scratch", n_rows, n_kv, d, dv)
    scratch = shared.get(key)
    if scratch is None:
        scratch = shared[key] = nn.attention_scratch(n_rows, n_kv, d, dv)
    table_step = _attention_table_step(node, shared, scratch, fixed_keys, fixed_values)
    if table_step is not None:
        return table_step
    if mask is not None:
        masked = reader(mask)

        def cut_mask() -> tuple:  # the cells some row sees, and each row's, once per step for every layer
            m = masked()[0, 0, :n_tokens]
            m = np.ascontiguousarray(m[:, :nn.seen_cells(m)])
            return m, nn.row_cells(m)
        mask_rows = _shared_value(shared, ("attention mask", id(mask), n_tokens), cut_mask)
    else:
        no_mask = np.zeros((n_tokens, n_kv), dtype=f32)
        no_mask_cells = (no_mask, nn.row_cells(no_mask))
        mask_rows = lambda: no_mask_cells  # noqa: E731

    sinks = _sinks(node)

    def step() -> None:
        m, seen = mask_rows()
        qa, ka, va = qv(), keys(), values()
        for i3 in range(q.ne[3]):
            res = out[i3] if direct else np.empty(out.shape[1:], dtype=f32)
            nn.attention_cells(np.ascontiguousarray(qa[i3]), ka[i3], va[i3], n_head_kv, m, scale, softcap, res, seen,
                               scratch, sinks)
            if not direct:
                out[i3] = res
    return step
