"""RMS_NORM, NORM and SOFT_MAX (with attention sinks)."""
from __future__ import annotations


import numpy as np

from ...opdefs import (NormParams, SoftMaxParams)
from ...tensor import Tensor
from .. import nn, router
from ..buffer import tensor_view
from ..plan import TableStep

from .base import f32, Step, reader, _tile, _row_view, _by_rows


def bind_rms_norm(node: Tensor, shared: dict) -> Step:
    x, out, eps = reader(node.src[0]), tensor_view(node), NormParams.of(node).eps
    x_rows, out_rows = _row_view(node.src[0]), _row_view(node)
    if x_rows is not None and out_rows is not None:
        return TableStep(lambda: [nn.rms_norm_call(x_rows, eps, out_rows)])
    return lambda: _by_rows(nn.rms_norm, x(), params=(eps,), out=out)


def bind_norm(node: Tensor, shared: dict) -> Step:
    x, out, eps = reader(node.src[0]), tensor_view(node), NormParams.of(node).eps

    def step() -> None:
        v = x().astype(np.float64)
        centered = v - v.mean(axis=-1, keepdims=True)
        out[...] = centered / np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return step


def bind_soft_max(node: Tensor, shared: dict) -> Step:
    a, mask = node.src[0], node.src[1]
    sinks = node.src[2] if len(node.src) > 2 else None
    x, out, scale = reader(a), tensor_view(node), f32(SoftMaxParams.of(node).scale)
    x_rows, out_rows = _row_view(a), _row_view(node)
    if mask is None and sinks is None and x_rows is not None and out_rows is not None and x_rows.shape == out_rows.shape:
        return TableStep(lambda: [router.softmax_call(x_rows, out_rows, scale)])  # an experts' router's
    m = reader(mask) if mask is not None else None
    s = reader(sinks) if sinks is not None else None
    n_rows = a.ne[1]

    def step() -> None:
        v = x() * scale
        if m is not None:
            v += _tile(m()[:, :, :n_rows, :], v.shape)
        rows = np.ascontiguousarray(v).reshape(-1, v.shape[-1])
        if s is None:
            nn.softmax_rows(rows)
        else:  # the sink of each row's head (ne[2])
            per_row = np.broadcast_to(s().reshape(-1)[None, :, None], v.shape[:3]).reshape(-1)
            nn.softmax_rows_sinks(rows, np.ascontiguousarray(per_row, dtype=f32))
        out[...] = rows.reshape(v.shape)
    return step
