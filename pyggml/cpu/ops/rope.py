"""ROPE, its angles worked out once per step from the positions."""
from __future__ import annotations


import numpy as np

from ...opdefs import (RopeMode,
                      RopeParams)
from ...tensor import Tensor
from .. import nn
from ..buffer import tensor_view
from ..plan import TableStep

from .base import f32, Step, reader, _row_view, _shared_value


def bind_rope(node: Tensor, shared: dict) -> Step:
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    p = RopeParams.of(node)
    factors = tensor_view(ff) if ff is not None else np.ones(1, dtype=f32)
    positions, x, out = tensor_view(pos), reader(a), tensor_view(node)
    neox = p.mode == RopeMode.NEOX
    # rope_rotate reads each pair before it writes it: the result may go straight into out
    direct = out.flags.c_contiguous

    def rope_angles() -> tuple[np.ndarray, np.ndarray]:
        return nn.rope_cache(positions.reshape(-1).astype(np.int64), p.n_dims, p.freq_base, p.freq_scale, p.ext_factor,
                             p.attn_factor, p.beta_fast, p.beta_slow, p.n_ctx_orig, factors.reshape(-1), ff is not None)

    xv = _row_view(a)
    if xv is not None and direct and a.ne[::-1] == out.shape:
        # as a table's call: the angles in arrays of the plan's, computed by the first ROPE of
        # the plan (before its table runs) and read by the others with the same positions
        key = ("rope table", id(pos), id(ff), p)
        first = key not in shared
        if first:
            shared[key] = tuple(np.empty((positions.size, p.n_dims // 2), dtype=f32) for _ in range(2))
        cos, sin = shared[key]

        def prepare() -> None:
            c, s = rope_angles()
            cos[...], sin[...] = c, s
        x4 = xv.reshape(out.shape)
        return TableStep(lambda: [nn.rope_call(x4, out, cos, sin, p.n_dims, neox)],
                         prepare if first else None, reads=(pos, ff) if ff is not None else (pos,))

    # the angles of the step's positions, computed by the first ROPE of the plan and taken by
    # the others with the same positions and parameters (every layer's Q and K)
    angles = _shared_value(shared, ("rope", id(pos), id(ff), p), rope_angles)

    def step() -> None:
        cos, sin = angles()
        v = np.ascontiguousarray(x())  # [ne3, n_tokens, n_head, head_dim]
        if direct:
            nn.rope_rotate(v, out, cos, sin, p.n_dims, neox)
            return
        res = np.empty(v.shape, dtype=f32)
        nn.rope_rotate(v, res, cos, sin, p.n_dims, neox)
        out[...] = res
    return step
