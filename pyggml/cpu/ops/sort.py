"""TOP_K, ARGSORT and ARGMAX, in pyggml.ranking's order."""
from __future__ import annotations


import numpy as np

from ... import ranking
from ...opdefs import (ArgsortParams, SortOrder)
from ...tensor import Tensor
from .. import nn, router
from ..plan import TableStep
from ..buffer import tensor_view

from .base import f32, Step, reader, _row_view


# up to this k a pass keeping the k best ranked (nn.top_k_rows) beats a partition and a sort
HEAP_TOP_K = 256


def top_k_indices(row: np.ndarray, k: int) -> np.ndarray:
    """pyggml.ranking.top_k_indices (the one order of TOP_K), with a heap for few of many."""
    n = row.size
    k = min(k, n)
    if 0 < k <= HEAP_TOP_K:
        out = np.empty((1, k), dtype=np.int64)
        nn.top_k_rows(np.ascontiguousarray(row, dtype=f32).reshape(1, n), k, out)
        return out[0]
    return ranking.top_k_indices(row, k)


def bind_argsort(node: Tensor, shared: dict) -> Step:
    x, out = reader(node.src[0]), tensor_view(node)
    descending = ArgsortParams.of(node).order == SortOrder.DESC

    def step() -> None:
        v = x()
        out[...] = np.argsort(-v if descending else v, axis=-1, kind="stable").astype(np.int32)
    return step


def bind_top_k(node: Tensor, shared: dict) -> Step:
    x, out, k = reader(node.src[0]), tensor_view(node), node.ne[0]
    n = node.src[0].ne[0]
    x_rows = _row_view(node.src[0])
    if x_rows is not None and out.flags.c_contiguous and 0 < k <= min(n, HEAP_TOP_K):
        out_rows = out.reshape(-1, k)
        return TableStep(lambda: [router.top_k_call(x_rows, out_rows)])  # an experts' router's

    def step() -> None:
        v = x()
        if 0 < k <= min(n, HEAP_TOP_K):
            ids = np.empty((v.size // n, k), dtype=np.int64)
            nn.top_k_rows(np.ascontiguousarray(v).reshape(-1, n), k, ids)
            out[...] = ids.reshape(out.shape)
            return
        for idx in np.ndindex(*v.shape[:-1]):
            out[idx] = top_k_indices(v[idx], k)
    return step


def bind_argmax(node: Tensor, shared: dict) -> Step:
    x, out = reader(node.src[0]), tensor_view(node)
    return lambda: out.__setitem__(Ellipsis, x()[0, 0].argmax(axis=-1).astype(np.int32).reshape(1, 1, 1, -1))
