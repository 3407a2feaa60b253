"""The CPU backend's op table: for each op a binder, which turns a node into a step.

The binders live by op family: elementwise.py, norm.py, rope.py, matmul.py, attention.py,
rows.py, sort.py; base.py holds what they share.

A binder takes an allocated node and returns its step: a function of no arguments that
computes the node in place, in float32.  What does not depend on the data is resolved when
the binder runs - the numpy views of the node's sources and result (``tensor_view``), its
parameters, which kernel to call and how its arguments are laid out - so that a graph plan
(``CPUBackend.graph_plan_create``), which binds every node once, pays per step only for the
kernels and the checks that read the data (indices in range, the cells a mask shows).
Computing one node op by op is ``bind(node)()``: the same step, made and dropped.

Where a node's kernels take arrays that stay where they are from step to step (a decoding
step's, mostly), its step is a plan.TableStep: the kernels' calls with their arguments
resolved, which the plan runs together with its neighbours' in one compiled call; what such
a step must work out from the graph's inputs at every run (RoPE's angles, the mask's cells,
the row ids' check) it does in its ``prepare``, into arrays its calls read.

``shared`` is the plan's: a binder may leave there what a later node of the same graph can
reuse (the products of one activation with several weights convert it once).
"""
from __future__ import annotations

import numpy as np

from ...opdefs import Op
from .. import nn
from .attention import bind_flash_attn_ext
from .base import Binder, Step
from .elementwise import (UNARY, _binary, bind_add_id, bind_clamp, bind_concat, bind_cpy, bind_glu, bind_scale,
                          bind_sum_rows, bind_unary)
from .matmul import bind_mul_mat, bind_mul_mat_id
from .norm import bind_norm, bind_rms_norm, bind_soft_max
from .rope import bind_rope
from .rows import bind_get_rows, bind_set_rows
from .sort import bind_argmax, bind_argsort, bind_top_k, top_k_indices

OP_TABLE: dict[Op, Binder] = {
    Op.ADD: _binary(np.add, nn.ADD),
    Op.ADD_ID: bind_add_id,
    Op.SUB: _binary(np.subtract, nn.SUB),
    Op.MUL: _binary(np.multiply, nn.MUL),
    Op.DIV: _binary(np.divide, nn.DIV),
    Op.SCALE: bind_scale,
    Op.UNARY: bind_unary,
    Op.GLU: bind_glu,
    Op.RMS_NORM: bind_rms_norm,
    Op.NORM: bind_norm,
    Op.SOFT_MAX: bind_soft_max,
    Op.ROPE: bind_rope,
    Op.MUL_MAT: bind_mul_mat,
    Op.GET_ROWS: bind_get_rows,
    Op.SET_ROWS: bind_set_rows,
    Op.CPY: bind_cpy,
    Op.CONT: bind_cpy,
    Op.DUP: bind_cpy,
    Op.CONCAT: bind_concat,
    Op.ARGMAX: bind_argmax,
    Op.ARGSORT: bind_argsort,
    Op.SUM_ROWS: bind_sum_rows,
    Op.CLAMP: bind_clamp,
    Op.MUL_MAT_ID: bind_mul_mat_id,
    Op.TOP_K: bind_top_k,
    Op.FLASH_ATTN_EXT: bind_flash_attn_ext,
}

__all__ = ["OP_TABLE", "UNARY", "Binder", "Step", "top_k_indices"]
