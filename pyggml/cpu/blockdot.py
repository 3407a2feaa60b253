"""Decode-step products of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), read
straight from the GGUF bytes.

For a batch of columns qdot.exact_matmul unpacks a weight row into bytes once and reuses them
for every column.  A decode step has one column, and there the unpacking (a store and a load of
every weight as a byte, besides the lane sums' round trip through memory) cost more than the
products: these kernels do what ggml's AVX2 ``vec_dot`` does in registers instead - per block,
the nibbles (and Q5's fifth bits) become 32 bytes, one ``dot4`` gives the 8 lane sums, and the
lane chain's fused multiply-add takes them at once - with the same float steps as
``qdot._chain32`` in the same order, so the results are the same bits.

Two rows go through the loop side by side, as in ``simd.lane_chain8x2``: each chain of fused
multiply-adds hides the other's latency.
"""
from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _loop_begin, _loop_end, dot4, hsum8_ir, splat8, target_has_vnni


class Block(NamedTuple):
    size: int       # bytes per 32-element block
    qs: int         # offset of the 16 nibble bytes (Q8_0: the 32 value bytes)
    has_min: bool   # an F16 minimum after the F16 scale (Q4_1, Q5_1)
    five: bool      # a 32-bit word of fifth bits just before qs (Q5_0, Q5_1)
    offset: int     # subtracted from every value (Q4_0: 8, Q5_0: 16)
    bytes8: bool    # Q8_0: the values are signed bytes as stored


# by qdot's unpacker numbers (qdot.EXACT)
BLOCKS = (Block(18, 2, False, False, 8, False), Block(20, 4, True, False, 0, False),
          Block(22, 6, False, True, 16, False), Block(24, 8, True, True, 0, False),
          Block(34, 2, False, False, 0, True))


def load_at(builder, base, offset, ty):
    """IR: a value of type ty at byte address base + offset (an int or an i64 value), any alignment."""
    at = ir.Constant(ir.IntType(64), offset) if isinstance(offset, int) else offset
    return builder.load(builder.bitcast(builder.gep(base, [at]), ty.as_pointer()), align=1)


def half_at(builder, base, offset):
    """IR: the F16 at byte address base + offset as float (exact)."""
    return builder.fpext(builder.bitcast(load_at(builder, base, offset, ir.IntType(16)), ir.HalfType()), ir.FloatType())


def _block_values(builder, base, blk: Block):
    """A block's 32 weights as bytes (the values minus blk.offset), and whether they are signed."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    v16, v32 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)
    if blk.bytes8:
        return load_at(builder, base, blk.qs, v32), True
    packed = load_at(builder, base, blk.qs, v16)
    lo = builder.and_(packed, ir.Constant(v16, [15] * 16))
    hi = builder.lshr(packed, ir.Constant(v16, [4] * 16))
    # element j: the low nibble of byte j, element 16 + j: its high nibble
    q = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), list(range(32))))
    if blk.five:  # bit j of qh is element j's fifth bit
        qh = load_at(builder, base, blk.qs - 4, i32)
        bits = builder.zext(builder.bitcast(qh, ir.VectorType(ir.IntType(1), 32)), v32)
        q = builder.or_(q, builder.shl(bits, ir.Constant(v32, [4] * 32)))
    if blk.offset:
        return builder.sub(q, ir.Constant(v32, [blk.offset] * 32)), True
    return q, False


def _row_dots(blk: Block, n_rows: int):
    """An intrinsic ``(row, yb, yd, ys, nb) -> float32``, or for two rows ``(row0, row1, yb, yd,
    ys, nb) -> (float32, float32)``:
    ggml's vec_dot of each weight row (uint8, the GGUF blocks) with one activation column
    quantized to bytes (yb, int8), its block scales yd and, for the types with a minimum, its
    block sums ys (Q8_1)."""
    vnni = target_has_vnni()

    def typer_one(typingctx, row, yb, yd, ys, nb):
        return types.float32(row, yb, yd, ys, types.intp), codegen

    def typer_two(typingctx, row0, row1, yb, yd, ys, nb):
        return types.UniTuple(types.float32, 2)(row0, row1, yb, yd, ys, types.intp), codegen

    def codegen(context, builder, signature, args):
        f32t, i64 = ir.FloatType(), ir.IntType(64)
        v8f = ir.VectorType(f32t, 8)
        ptrs = [context.make_array(t)(context, builder, a).data for t, a in zip(signature.args[:-1], args[:-1])]
        rows, (yb_ptr, yd_ptr, ys_ptr) = ptrs[:n_rows], ptrs[n_rows:]
        nb = args[-1]
        fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32t, [f32t] * 3), "llvm.fma.f32")
        zero8, zero = ir.Constant(v8f, [0.0] * 8), ir.Constant(f32t, 0.0)

        b, pre, loop, done = _loop_begin(builder, nb, "blocks")
        accs = [builder.phi(v8f) for _ in rows]  # the 8 lanes of each row
        mins = [builder.phi(f32t) for _ in rows] if blk.has_min else []  # the minimum's term
        for phi in accs:
            phi.add_incoming(zero8, pre)
        for phi in mins:
            phi.add_incoming(zero, pre)
        y = load_at(builder, yb_ptr, builder.mul(b, ir.Constant(i64, 32)), ir.VectorType(ir.IntType(8), 32))
        yd = builder.load(builder.gep(yd_ptr, [b]))
        ys = builder.load(builder.gep(ys_ptr, [b])) if blk.has_min else None
        next_accs, next_mins = [], []
        for r, row in enumerate(rows):
            base = builder.gep(row, [builder.mul(b, ir.Constant(i64, blk.size))])
            q, signed = _block_values(builder, base, blk)
            lanes = builder.sitofp(dot4(builder, q, y, signed, vnni), v8f)
            scale = splat8(builder, builder.fmul(half_at(builder, base, 0), yd))  # d_w * d_y, as ggml
            next_accs.append(builder.call(fma8, [scale, lanes, accs[r]]))
            if blk.has_min:
                m = half_at(builder, base, 2)
                next_mins.append(builder.call(fma1, [m, ys, mins[r]]))
        for phi, nxt in zip(accs + mins, next_accs + next_mins):
            phi.add_incoming(nxt, loop)
        _loop_end(builder, b, nb, loop, done)

        finals = []  # every phi of the exit block before any other instruction
        for nxt, start in [(a, zero8) for a in next_accs] + [(m, zero) for m in next_mins]:
            phi = builder.phi(nxt.type)
            phi.add_incoming(start, pre)
            phi.add_incoming(nxt, loop)
            finals.append(phi)
        results = []
        for r in range(n_rows):
            total = hsum8_ir(builder, finals[r])
            if blk.has_min:
                total = builder.fadd(total, finals[n_rows + r])
            results.append(total)
        if n_rows == 1:
            return results[0]
        return context.make_tuple(builder, signature.return_type, results)
    return intrinsic(typer_one if n_rows == 1 else typer_two)


_ONE = [_row_dots(blk, 1) for blk in BLOCKS]
_TWO = [_row_dots(blk, 2) for blk in BLOCKS]
_q4_0, _q4_1, _q5_0, _q5_1, _q8_0 = _ONE
_q4_0x2, _q4_1x2, _q5_0x2, _q5_1x2, _q8_0x2 = _TWO

_jit = njit(cache=True, inline="always", boundscheck=False)


@_jit
def row_dot(kind, row, yb, yd, ys):
    """vec_dot of one weight row of a 32-element block type (qdot's unpacker number) with one
    activation column (yb: its integers as int8, yd/ys: per block)."""
    nb = yd.size
    if kind == 0:
        return _q4_0(row, yb, yd, ys, nb)
    if kind == 1:
        return _q4_1(row, yb, yd, ys, nb)
    if kind == 2:
        return _q5_0(row, yb, yd, ys, nb)
    if kind == 3:
        return _q5_1(row, yb, yd, ys, nb)
    return _q8_0(row, yb, yd, ys, nb)


@_jit
def row_pair_dots(kind, row0, row1, yb, yd, ys):
    """``row_dot`` of two weight rows with the same column, their chains interleaved."""
    nb = yd.size
    if kind == 0:
        return _q4_0x2(row0, row1, yb, yd, ys, nb)
    if kind == 1:
        return _q4_1x2(row0, row1, yb, yd, ys, nb)
    if kind == 2:
        return _q5_0x2(row0, row1, yb, yd, ys, nb)
    if kind == 3:
        return _q5_1x2(row0, row1, yb, yd, ys, nb)
    return _q8_0x2(row0, row1, yb, yd, ys, nb)
