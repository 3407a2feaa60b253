"""Products read straight from the GGUF blocks, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
Q6_K, with llama.cpp's kernels' float steps for each (vec_dot, its repacked Q4_K gemm, its
tiled K-quant matmul: the kernel llama.cpp picks for a column, blockdot.column_format).

These kernels do what ggml's SIMD ``vec_dot`` does, in registers - per 32 weights the nibbles
(and fifth or sixth bits) become 32 bytes, one ``dot4`` gives 8 lane sums - with the same
float steps as ggml's in the same order, so the results are the same bits.  Integer sums are
exact in any order; only the float steps are ggml's.

Each format is three pieces of IR: the per-column values of a block (``shared``), one row's
block (``block``: the next values of its accumulators) and the result from the accumulators
(``finish``); a PairFormat has a fourth, both rows' values of a block (``rows``), and its
chains carry the two rows side by side.  ``_tile_ir`` makes the loop around them for two rows
and one, two, four or eight columns: a chain per (row, column) - independent chains hide each
other's fused multiply-add latency, and the columns share each block's load and unpacking.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quants.layouts import KVALUES_MXFP4
from .kinds import BATCH_FORMAT, Fmt, literal_kind
from .simd import (KERNEL, dot4, fold_halves, hsum8_ir, integer_dots, loop_begin, loop_end, pair_products, pair_sums,
                   scaled_dot4, splat)

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V8F, V4I, V8I, V16I, V32B = (ir.VectorType(F32, 8), ir.VectorType(I32, 4), ir.VectorType(I32, 8), ir.VectorType(I32, 16),
                             ir.VectorType(I8, 32))
DOTS = integer_dots()  # the CPU's integer dot instructions (simd.DOT_LEVELS)


def load_at(builder, base, offset, ty):
    """IR: a value of type ty at byte address base + offset (an int or an i64 value), any alignment."""
    at = ir.Constant(I64, offset) if isinstance(offset, int) else offset
    return builder.load(builder.bitcast(builder.gep(base, [at]), ty.as_pointer()), align=1)


def half_at(builder, base, offset):
    """IR: the F16 at byte address base + offset as float (exact)."""
    return builder.fpext(builder.bitcast(load_at(builder, base, offset, ir.IntType(16)), ir.HalfType()), F32)


def _splat(ty, value):
    return ir.Constant(ty, [value] * ty.count)


def _fma(builder, a, b, c):
    """IR: a * b + c rounded once (float32 or a vector of them)."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _nibbles(builder, packed):
    """32 bytes from 16: element j the low nibble of byte j, element 16 + j its high nibble.  The
    16 bytes in both halves, the high half shifted by 4 (one variable shift of 64-bit lanes),
    then masked: a broadcast load, a shift and an and."""
    both = builder.shuffle_vector(packed, packed, ir.Constant(ir.VectorType(I32, 32), list(range(16)) * 2))
    v4q = ir.VectorType(I64, 4)
    shifted = builder.lshr(builder.bitcast(both, v4q), ir.Constant(v4q, [0, 0, 4, 4]))
    return builder.and_(builder.bitcast(shifted, V32B), _splat(V32B, 15))


def _hsum_int(builder, v):
    """The sum of an integer vector's elements (exact in any order)."""
    return fold_halves(builder, v, builder.add)


class Format(NamedTuple):
    block_bytes: int
    init: list            # the accumulators' starting values (ir.Constant), per row
    shared: Callable      # (builder, b, nb, yb, yd, ys) -> dict of the column's values for block b
    block: Callable       # (builder, base, col, accs) -> the accumulators' next values
    finish: Callable      # (builder, accs) -> the float32 result


class PairFormat(NamedTuple):
    """A format whose two rows' chains share vectors twice as wide: row 0's in the low half of
    each, row 1's in the high half.  Every lane computes what it would alone (the same float
    steps, lane by lane), so the results are Format's bits with half the instructions."""
    block_bytes: int
    init: list            # the accumulators' starting values, for both rows
    shared: Callable      # (builder, b, nb, yb, yd, ys) -> dict of the column's values for block b
    rows: Callable        # (builder, base0, base1) -> dict of the two rows' values for a block
    block: Callable       # (builder, rows, col, accs) -> the accumulators' next values
    finish: Callable      # (builder, accs) -> (row 0's result, row 1's result)
    # ggml's loops that take two blocks per step end an odd count with a scalar step after the
    # sum: (builder, rows, col, results) -> the results, with the last block's part.  The loop
    # over the blocks then stops before an odd last block
    tail: Callable | None = None


def _concat(builder, a, b):
    """IR: vectors a and b (of one type) end to end."""
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))


def _half(builder, v, which: int):
    """IR: the low (0) or high (1) half of a vector."""
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(which * n, (which + 1) * n))))


def _two_halves(builder, a, b, lanes: int):
    """IR: a vector of 2 x lanes floats, a in the low half, b in the high half."""
    two = builder.insert_element(builder.insert_element(ir.Constant(ir.VectorType(F32, 2), ir.Undefined), a,
                                                        ir.Constant(I32, 0)), b, ir.Constant(I32, 1))
    return builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(I32, 2 * lanes), [0] * lanes + [1] * lanes))


# -- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: ggml's vec_dot over 32-element blocks (qdot._chain32) --------

class Legacy(NamedTuple):
    size: int       # bytes per 32-element block
    qs: int         # offset of the 16 nibble bytes (Q8_0: the 32 value bytes)
    has_min: bool   # an F16 minimum after the F16 scale (Q4_1, Q5_1)
    five: bool      # a 32-bit word of fifth bits just before qs (Q5_0, Q5_1)
    offset: int     # subtracted from every value (Q4_0: 8, Q5_0: 16)
    bytes8: bool    # Q8_0: the values are signed bytes as stored


def lane_sums_at(builder, nb):
    """IR: where, in an activation row of nb 32-value blocks as bytes (qdot._activation_bytes_row),
    the blocks' lane sums begin: after the values, padded to whole 64 bytes."""
    return builder.shl(builder.ashr(builder.add(nb, ir.Constant(I64, 1)), ir.Constant(I64, 1)), ir.Constant(I64, 6))


def _lane_sums_offset(blk: Legacy) -> int:
    """The offset whose lane sums a legacy format's dots start at (_legacy), 0 for none."""
    if blk.bytes8:
        return 128 if DOTS == "vnni" else 0
    return blk.offset


def _legacy(blk: Legacy) -> PairFormat:
    """8 lanes, ``acc = fma(d_w * d_y, lanes, acc)`` per block, hsum8; with a minimum, its term
    ``summs = fma(m_w, s_y, summs)`` in a scalar of its own, added last.  Two rows' 8 lanes
    side by side in 16 (PairFormat): one dot, one conversion and one fused multiply-add for both.

    Signed weights (q - offset; Q8_0's bytes, q - 128 for q = byte + 128) are dotted as
    ``dot4(q, y)`` started at ``-offset x`` the lane's sum of y: the same integers as the sign
    trick, with one addition (none with VNNI) per row and column where the trick takes a sign
    instruction (five selects with VNNI) and an absolute value per row; y's lane sums are a
    column's, computed once for every product when its activations become bytes (LANE_SUMS).
    Not Q8_0's without VNNI: AVX2's 16-bit pair sums of q up to 255 could overflow (simd.dot4),
    so those take the sign trick."""
    offset = _lane_sums_offset(blk)
    by_offset = offset > 0

    def shared(builder, b, nb, yb, yd, ys):
        y = load_at(builder, yb, builder.mul(b, ir.Constant(I64, 32)), V32B)
        d = builder.load(builder.gep(yd, [b]))
        if blk.has_min:  # as the rows' scales lie: (d, s) for each row
            s = builder.load(builder.gep(ys, [b]))
            scales = builder.shuffle_vector(splat(builder, d, 2), splat(builder, s, 2), ir.Constant(V4I, [0, 2, 1, 3]))
        else:
            scales = splat(builder, d, 2)
        col = {"y": _concat(builder, y, y), "scales": scales}
        if by_offset:  # -offset x the lane sums, stored after the values (LANE_SUMS)
            at = builder.add(lane_sums_at(builder, nb), builder.mul(b, ir.Constant(I64, 32)))
            col["offset"] = _concat(builder, *(load_at(builder, yb, at, V8I),) * 2)
        return col

    def row_values(builder, base):
        """One row's 32 values as bytes, and whether they are signed."""
        if blk.bytes8:
            q = load_at(builder, base, blk.qs, V32B)
            return (builder.xor(q, _splat(V32B, -128)), False) if by_offset else (q, True)
        q = _nibbles(builder, load_at(builder, base, blk.qs, ir.VectorType(I8, 16)))
        if blk.five:  # bit j of qh is element j's fifth bit
            bits = builder.bitcast(load_at(builder, base, blk.qs - 4, I32), ir.VectorType(ir.IntType(1), 32))
            q = builder.or_(q, builder.shl(builder.zext(bits, V32B), _splat(V32B, 4)))
        if blk.offset and not by_offset:
            return builder.sub(q, _splat(V32B, blk.offset)), True
        return q, False

    def rows(builder, base0, base1):
        (q0, signed), (q1, _) = row_values(builder, base0), row_values(builder, base1)
        # both rows' F16 scales (and minima) in one conversion: d0 (m0) d1 (m1)
        words = [load_at(builder, base, 0, I32 if blk.has_min else I16) for base in (base0, base1)]
        pair = builder.insert_element(builder.insert_element(
            ir.Constant(ir.VectorType(words[0].type, 2), ir.Undefined), words[0], ir.Constant(I32, 0)),
            words[1], ir.Constant(I32, 1))
        n = 4 if blk.has_min else 2
        scales = builder.fpext(builder.bitcast(pair, ir.VectorType(ir.HalfType(), n)), ir.VectorType(F32, n))
        return {"q": _concat(builder, q0, q1), "signed": signed, "scales": scales}

    def block(builder, two, col, accs):
        if by_offset:
            sums = dot4(builder, two["q"], col["y"], False, DOTS, acc=col["offset"])
        else:
            sums = dot4(builder, two["q"], col["y"], two["signed"], DOTS)
        lanes = builder.sitofp(sums, ir.VectorType(F32, 16))
        # d_w x d_y of each row (lanes 0 and 2 with a minimum: 1 and 3 hold m_w x s_y, unused)
        products = builder.fmul(two["scales"], col["scales"])
        d_lane = 2 if blk.has_min else 1
        d = builder.shuffle_vector(products, products, ir.Constant(V16I, [0] * 8 + [d_lane] * 8))
        nxt = [_fma(builder, d, lanes, accs[0])]
        if blk.has_min:  # the minima's sums m_w x s_y + summs in lanes 1 and 3 (0 and 2: unused)
            nxt.append(_fma(builder, two["scales"], col["scales"], accs[1]))
        return nxt

    def finish(builder, accs):
        totals = [hsum8_ir(builder, _half(builder, accs[0], r)) for r in range(2)]
        if blk.has_min:
            totals = [builder.fadd(t, builder.extract_element(accs[1], ir.Constant(I32, 2 * r + 1)))
                      for r, t in enumerate(totals)]
        return tuple(totals)

    init = [_splat(ir.VectorType(F32, 16), 0.0)] + ([_splat(ir.VectorType(F32, 4), 0.0)] if blk.has_min else [])
    return PairFormat(blk.size, init, shared, rows, block, finish)


# -- MXFP4: 32 E2M1 codes and an E8M0 scale per block, Q8_0 activations --------------------------

def _e2m1_values(builder, codes):
    """IR: signed bytes KVALUES_MXFP4[code] (doubled E2M1 values) for a vector of 4-bit codes (32 or 64 bytes): AVX2's
    byte shuffle as a table of 16 (ggml's), else the table's shape in arithmetic - the low three
    bits are 0..3 as they are, then 4 6 (2c - 4) and 8 12 (4c - 16); the high bit the sign."""
    n = codes.type.count
    if DOTS != "plain":
        v32b = ir.VectorType(I8, 32)
        shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32b, [v32b] * 2),
                                                 "llvm.x86.avx2.pshuf.b")
        table = ir.Constant(v32b, [int(v) for v in KVALUES_MXFP4] * 2)
        if n == 32:
            return builder.call(shuffle, [table, codes])
        return _concat(builder, *(builder.call(shuffle, [table, _half(builder, codes, h)]) for h in range(2)))
    vb = ir.VectorType(I8, n)
    low = builder.and_(codes, _splat(vb, 7))
    mag = builder.select(builder.icmp_unsigned("<", low, _splat(vb, 4)), low,
                         builder.select(builder.icmp_unsigned("<", low, _splat(vb, 6)),
                                        builder.sub(builder.shl(low, _splat(vb, 1)), _splat(vb, 4)),
                                        builder.sub(builder.shl(low, _splat(vb, 2)), _splat(vb, 16))))
    negative = builder.icmp_unsigned("!=", builder.and_(codes, _splat(vb, 8)), _splat(vb, 0))
    return builder.select(negative, builder.sub(_splat(vb, 0), mag), mag)


def _e8m0_halves(builder, e):
    """IR: ggml_e8m0_to_fp32_half of a vector of i32 exponents: 2^(e - 128) as float32 (e < 2:
    its subnormal bits)."""
    vi = e.type
    small = builder.icmp_unsigned("<", e, ir.Constant(vi, [2] * vi.count))
    bits = builder.select(small, builder.shl(ir.Constant(vi, [0x00200000] * vi.count), e),
                          builder.shl(builder.sub(e, ir.Constant(vi, [1] * vi.count)), ir.Constant(vi, [23] * vi.count)))
    return builder.bitcast(bits, ir.VectorType(F32, vi.count))


def _mxfp4() -> PairFormat:
    """ggml_vec_dot_mxfp4_q8_0 (AVX2; the same code on AVX-512 machines): two blocks per step,
    each into an accumulator of its own - ``acc_even`` for blocks 0, 2, 4 ..., ``acc_odd`` for
    1, 3, 5 ... - as ``fma(d_y * e8m0_half(e_w), lanes, acc)``; the result hsum8(acc_even +
    acc_odd), then an odd last block's integer sum times its scale in one fused step.  Two rows'
    8 lanes side by side in 16 (PairFormat), as the legacy formats'."""
    v16f = ir.VectorType(F32, 16)

    def shared(builder, b, nb, yb, yd, ys):
        y = load_at(builder, yb, builder.mul(b, ir.Constant(I64, 32)), V32B)
        d = builder.load(builder.gep(yd, [b]))
        odd = builder.trunc(builder.and_(b, ir.Constant(I64, 1)), ir.IntType(1))
        return {"y": _concat(builder, y, y), "scales": splat(builder, d, 2), "odd": odd}

    def rows(builder, base0, base1):
        codes = [_nibbles(builder, load_at(builder, base, 1, ir.VectorType(I8, 16))) for base in (base0, base1)]
        e = [builder.zext(builder.load(base), I32) for base in (base0, base1)]
        pair = builder.insert_element(builder.insert_element(ir.Constant(ir.VectorType(I32, 2), ir.Undefined), e[0],
                                                             ir.Constant(I32, 0)), e[1], ir.Constant(I32, 1))
        return {"q": _e2m1_values(builder, _concat(builder, *codes)), "scales": _e8m0_halves(builder, pair)}

    def products(builder, two, col):
        """Each row's d_y x d_w (one rounding), and its lanes' integer sums."""
        sums = dot4(builder, two["q"], col["y"], True, DOTS)
        return builder.fmul(col["scales"], two["scales"]), sums

    def block(builder, two, col, accs):
        d, sums = products(builder, two, col)
        lanes = builder.sitofp(sums, v16f)
        d16 = builder.shuffle_vector(d, d, ir.Constant(V16I, [0] * 8 + [1] * 8))
        even, odd_acc = accs
        nxt = _fma(builder, d16, lanes, builder.select(col["odd"], odd_acc, even))
        return [builder.select(col["odd"], even, nxt), builder.select(col["odd"], nxt, odd_acc)]

    def finish(builder, accs):
        both = builder.fadd(accs[0], accs[1])
        return tuple(hsum8_ir(builder, _half(builder, both, r)) for r in range(2))

    def tail(builder, two, col, results):
        d, sums = products(builder, two, col)
        return tuple(_fma(builder, builder.extract_element(d, ir.Constant(I32, r)),
                          builder.sitofp(_hsum_int(builder, _half(builder, sums, r)), F32), results[r])
                     for r in range(2))

    return PairFormat(17, [_splat(v16f, 0.0)] * 2, shared, rows, block, finish, tail)


# -- K-quants: 256-element blocks, Q8_K activations (yd per block, ys: 16 sums of 16 values) ----

def _k_shared(builder, b, nb, yb, yd, ys):
    at = builder.mul(b, ir.Constant(I64, 256))
    sums = load_at(builder, builder.bitcast(ys, I8.as_pointer()), builder.mul(b, ir.Constant(I64, 64)),
                   ir.VectorType(F32, 16))
    return {"y": [load_at(builder, yb, builder.add(at, ir.Constant(I64, 32 * c)), V32B) for c in range(8)],
            "d": builder.load(builder.gep(yd, [b])),
            "bsums": builder.fptosi(sums, V16I)}  # exact integers held as float32


def _q4_k_scales(builder, base):
    """The 8 six-bit sub-block scales and mins of a Q4_K block (qdecode._k4_scale_min), as i32."""
    v4 = ir.VectorType(I8, 4)
    a, m, h = (load_at(builder, base, 4 + 4 * i, v4) for i in range(3))
    six, top = _splat(v4, 63), _splat(v4, 6)
    sc_hi = builder.or_(builder.and_(h, _splat(v4, 15)), builder.shl(builder.lshr(a, top), _splat(v4, 4)))
    mn_hi = builder.or_(builder.lshr(h, _splat(v4, 4)), builder.shl(builder.lshr(m, top), _splat(v4, 4)))
    join = ir.Constant(ir.VectorType(I32, 8), list(range(8)))
    scales = builder.shuffle_vector(builder.and_(a, six), sc_hi, join)
    mins = builder.shuffle_vector(builder.and_(m, six), mn_hi, join)
    return builder.zext(scales, V8I), builder.zext(mins, V8I)


def _q4_k_sums(builder, base, col, five: bool = False):
    """A Q4_K (or Q5_K) block's integers: each sub-block's 8 lanes of q x y, each times the
    sub-block's scale (simd.scaled_dot4: ggml's vpmaddwd by the scales), and the 8 sub-blocks'
    min x (their activations' sum)."""
    scales, mins = _q4_k_scales(builder, base)
    qh = load_at(builder, base, 16, V32B) if five else None  # bit s of byte l: sub-block s, value l
    subs = []
    for pair in range(4):  # 32 bytes: the low nibbles are sub-block 2 pair, the high 2 pair + 1
        packed = load_at(builder, base, (48 if five else 16) + 32 * pair, V32B)
        for half, q in enumerate((builder.and_(packed, _splat(V32B, 15)), builder.lshr(packed, _splat(V32B, 4)))):
            s = 2 * pair + half
            if five:
                fifth = builder.and_(builder.lshr(qh, _splat(V32B, s)), _splat(V32B, 1))
                q = builder.or_(q, builder.shl(fifth, _splat(V32B, 4)))
            scale = builder.shuffle_vector(scales, scales, ir.Constant(V8I, [s] * 8))
            subs.append(scaled_dot4(builder, q, col["y"][s], scale, DOTS))
    return subs, builder.mul(pair_sums(builder, col["bsums"]), mins)


def _summed(builder, vecs):
    """IR: the lane-by-lane sum of integer vectors (exact in any order)."""
    while len(vecs) > 1:
        vecs = [builder.add(a, b) for a, b in zip(vecs[::2], vecs[1::2])] + vecs[len(vecs) - len(vecs) % 2:]
    return vecs[0]


def _q45_k(five: bool) -> Format:
    """Q4_K / Q5_K's vec_dot (ggml_vec_dot_q4_K_q8_K, _q5_K_): 8 lanes, each the sum of its 4-value products of
    all 8 sub-blocks times their scales, ``acc = fma(d_y * d_w, lanes, acc)`` per block, hsum8;
    the mins' term with ``dmin = -d_y * m_w`` in 4 accumulators of sub-block pairs (Q4_K),
    ``(m0 + m2) + (m1 + m3)``, or summed as integers into one (Q5_K); added last."""
    v4f = ir.VectorType(F32, 4)

    def block(builder, base, col, accs):
        subs, min_terms = _q4_k_sums(builder, base, col, five)
        lanes = _summed(builder, subs)
        scale = splat(builder, builder.fmul(half_at(builder, base, 0), col["d"]))
        acc = _fma(builder, scale, builder.sitofp(lanes, V8F), accs[0])
        dmin = builder.fmul(builder.fneg(col["d"]), half_at(builder, base, 2))
        if five:
            return [acc, _fma(builder, dmin, builder.sitofp(_hsum_int(builder, min_terms), F32), accs[1])]
        pairs = builder.sitofp(pair_sums(builder, min_terms), v4f)  # the mins of sub-blocks 0+1, 2+3, ...
        eight = splat(builder, dmin)
        dmins = builder.shuffle_vector(eight, eight, ir.Constant(ir.VectorType(I32, 4), [0, 1, 2, 3]))
        return [acc, _fma(builder, dmins, pairs, accs[1])]

    def finish(builder, accs):
        total = hsum8_ir(builder, accs[0])
        if five:
            return builder.fadd(total, accs[1])
        m = [builder.extract_element(accs[1], ir.Constant(I32, i)) for i in range(4)]
        return builder.fadd(total, builder.fadd(builder.fadd(m[0], m[2]), builder.fadd(m[1], m[3])))

    init = [_splat(V8F, 0.0), ir.Constant(F32, 0.0) if five else _splat(v4f, 0.0)]
    return Format(176 if five else 144, init, _k_shared, block, finish)


def _sums_of_eight(builder, vecs):
    """IR: eight i32 x 8 vectors -> an i32 x 8 whose element i is the sum of vecs[i] (exact):
    two rounds of pairwise sums within each 128-bit half (the pattern of AVX2's vphaddd), then
    the halves added."""
    def hadd(a, b):
        lo = ir.Constant(V8I, [0, 2, 8, 10, 4, 6, 12, 14])
        hi = ir.Constant(V8I, [1, 3, 9, 11, 5, 7, 13, 15])
        return builder.add(builder.shuffle_vector(a, b, lo), builder.shuffle_vector(a, b, hi))
    quads = [hadd(hadd(vecs[i], vecs[i + 1]), hadd(vecs[i + 2], vecs[i + 3])) for i in (0, 4)]
    # quads[j]: vecs 4j .. 4j + 3's sums of their low 128 bits, then of their high 128 bits
    low = builder.shuffle_vector(quads[0], quads[1], ir.Constant(V8I, [0, 1, 2, 3, 8, 9, 10, 11]))
    high = builder.shuffle_vector(quads[0], quads[1], ir.Constant(V8I, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(low, high)


def _q4_k_x8_paired(per_pair: bool) -> PairFormat:
    """_q4_k_x8's float steps, two rows' chains side by side (PairFormat).  Its integers from
    dots of 64 bytes: a row's 32 packed bytes hold sub-blocks 2p (low nibbles) and 2p + 1 (high)
    and the activations of both lie one after the other, so one dot gives a pair's 16 lanes,
    each already times its sub-block's scale (simd.scaled_dot4); a pair's total is the sum of
    its 16 lanes, and both rows' 4 totals come from one tree of sums (_sums_of_eight).  The
    mins' terms: each sub-block pair's two products summed (simd.pair_products)."""
    v64b, v2f = ir.VectorType(I8, 64), ir.VectorType(F32, 2)

    def shared(builder, b, nb, yb, yd, ys):
        at = builder.mul(b, ir.Constant(I64, 256))
        sums = load_at(builder, builder.bitcast(ys, I8.as_pointer()), builder.mul(b, ir.Constant(I64, 64)),
                       ir.VectorType(F32, 16))
        per_sub = pair_sums(builder, builder.fptosi(sums, V16I))  # exact integers held as float32
        return {"y": [load_at(builder, yb, builder.add(at, ir.Constant(I64, 64 * p)), v64b) for p in range(4)],
                "d": splat(builder, builder.load(builder.gep(yd, [b])), 2),
                "bsums": _concat(builder, per_sub, per_sub)}

    def rows(builder, base0, base1):
        qs, lane_scales, mins = [], [], []
        for base in (base0, base1):
            sc, mn = _q4_k_scales(builder, base)
            mins.append(mn)
            for pair in range(4):  # the low nibbles are sub-block 2 pair, the high 2 pair + 1
                packed = load_at(builder, base, 16 + 32 * pair, V32B)
                qs.append(_concat(builder, builder.and_(packed, _splat(V32B, 15)), builder.lshr(packed, _splat(V32B, 4))))
                lane_scales.append(builder.shuffle_vector(sc, sc, ir.Constant(V16I, [2 * pair] * 8 + [2 * pair + 1] * 8)))
        halves = [[half_at(builder, base, at) for base in (base0, base1)] for at in (0, 2)]
        return {"q": qs, "lane_scales": lane_scales, "mins": _concat(builder, *mins),
                "d": _two_halves(builder, *halves[0], 1), "dmin": _two_halves(builder, *halves[1], 1)}

    def block(builder, two, col, accs):
        dots = [scaled_dot4(builder, q, col["y"][i % 4], two["lane_scales"][i], DOTS) for i, q in enumerate(two["q"])]
        totals = _sums_of_eight(builder, [builder.add(_half(builder, v, 0), _half(builder, v, 1)) for v in dots])
        mins = pair_products(builder, col["bsums"], two["mins"], DOTS)  # row 0's 4 pairs, then row 1's (as totals)
        if not per_pair:
            totals, mins = pair_sums(builder, pair_sums(builder, totals)), pair_sums(builder, pair_sums(builder, mins))
        d, dmin = builder.fmul(two["d"], col["d"]), builder.fmul(two["dmin"], col["d"])
        totals, mins = builder.sitofp(totals, ir.VectorType(F32, totals.type.count)), \
            builder.sitofp(mins, ir.VectorType(F32, mins.type.count))
        n = totals.type.count // 2  # parts per row: row 0's, then row 1's
        acc, acc_min = accs
        for part in range(n):
            pick = ir.Constant(ir.VectorType(I32, 2), [part, n + part])
            acc = _fma(builder, builder.shuffle_vector(totals, totals, pick), d, acc)
            acc_min = _fma(builder, builder.shuffle_vector(mins, mins, pick), dmin, acc_min)
        return [acc, acc_min]

    def finish(builder, accs):
        diff = builder.fsub(accs[0], accs[1])
        return tuple(builder.extract_element(diff, ir.Constant(I32, r)) for r in range(2))

    zero = _splat(v2f, 0.0)
    return PairFormat(144, [zero, zero], shared, rows, block, finish)


def _q45_k_tiled(five: bool) -> Format:
    """Q4_K / Q5_K from 8 columns, llama.cpp's tiled matmul (its AVX-512 VNNI kernel): per block
    ``r = float(scales' integer) * d_w``, ``r = fma(-dmin_w, float(mins' integer), r)``,
    ``acc = fma(r, d_y, acc)``."""
    def block(builder, base, col, accs):
        subs, min_terms = _q4_k_sums(builder, base, col, five)
        r = builder.fmul(builder.sitofp(_hsum_int(builder, _summed(builder, subs)), F32), half_at(builder, base, 0))
        mins = builder.sitofp(_hsum_int(builder, min_terms), F32)
        r = _fma(builder, builder.fneg(half_at(builder, base, 2)), mins, r)
        return [_fma(builder, r, col["d"], accs[0])]

    return Format(176 if five else 144, [ir.Constant(F32, 0.0)], _k_shared, block, lambda builder, accs: accs[0])


def _q6_k_lanes(builder, base, col):
    """A Q6_K block's 8 lanes: each the integer over its 4 values of all 8 chunks of 32, times
    their 16-value scales, less 32 x scale x bsum of the lane's two 16-value groups (ggml takes
    the -32 of the codes off per group, through the activations' sums)."""
    lanes = _splat(V8I, 0)
    for half in range(2):
        qh = load_at(builder, base, 128 + 32 * half, V32B)
        for plane in range(4):
            ql = load_at(builder, base, 64 * half + 32 * (plane % 2), V32B)
            lo = builder.and_(ql, _splat(V32B, 15)) if plane < 2 else builder.lshr(ql, _splat(V32B, 4))
            hi = builder.and_(builder.lshr(qh, _splat(V32B, 2 * plane)), _splat(V32B, 3))
            q = builder.or_(lo, builder.shl(hi, _splat(V32B, 4)))  # 0..63
            two = builder.sext(load_at(builder, base, 192 + 8 * half + 2 * plane, ir.VectorType(I8, 2)),
                               ir.VectorType(I32, 2))
            sc = builder.shuffle_vector(two, two, ir.Constant(V8I, [0] * 4 + [1] * 4))  # a scale per 16 values
            lanes = builder.add(lanes, scaled_dot4(builder, q, col["y"][4 * half + plane], sc, DOTS))
    scales = builder.sext(load_at(builder, base, 192, ir.VectorType(I8, 16)), V16I)
    offsets = pair_products(builder, scales, col["bsums"], DOTS)
    return builder.sub(lanes, builder.shl(offsets, _splat(V8I, 5)))


def _q6_k() -> Format:
    """Q6_K's vec_dot: ``acc = fma(d_y * d_w, lanes, acc)`` per block, then hsum8 (+ 0, as
    the K-quants' vec_dot adds its sum of mins, 0 here)."""
    def block(builder, base, col, accs):
        scale = splat(builder, builder.fmul(col["d"], half_at(builder, base, 208)))
        return [_fma(builder, scale, builder.sitofp(_q6_k_lanes(builder, base, col), V8F), accs[0])]

    def finish(builder, accs):
        return builder.fadd(hsum8_ir(builder, accs[0]), ir.Constant(F32, 0.0))

    return Format(210, [_splat(V8F, 0.0)], _k_shared, block, finish)


def _q6_k_tiled() -> PairFormat:
    """Q6_K from 8 columns, llama.cpp's tiled matmul: per block
    ``r = float(integer sum) * d_w``, ``acc = fma(r, d_y, acc)``; two rows side by side
    (PairFormat).  Only the block's integer counts, so it is summed as cheaply as it comes:
    dots of two 32-value chunks at once, each lane already times its 16 values' scale
    (simd.scaled_dot4), all lanes summed, less 32 x the scales times the activations' sums
    (simd.pair_products)."""
    v64b, v2f, v2i = ir.VectorType(I8, 64), ir.VectorType(F32, 2), ir.VectorType(I32, 2)

    def shared(builder, b, nb, yb, yd, ys):
        at = builder.mul(b, ir.Constant(I64, 256))
        sums = load_at(builder, builder.bitcast(ys, I8.as_pointer()), builder.mul(b, ir.Constant(I64, 64)),
                       ir.VectorType(F32, 16))
        return {"y": [load_at(builder, yb, builder.add(at, ir.Constant(I64, 64 * c)), v64b) for c in range(4)],
                "d": splat(builder, builder.load(builder.gep(yd, [b])), 2),
                "bsums": builder.fptosi(sums, V16I)}  # the sum of each 16 values (exact integers held as float32)

    def chunk(builder, base, c):
        """Chunk c's 32 values (0..63): the values 32c .. 32c + 31 of the block."""
        half, plane = divmod(c, 4)
        ql = load_at(builder, base, 64 * half + 32 * (plane % 2), V32B)
        lo = builder.and_(ql, _splat(V32B, 15)) if plane < 2 else builder.lshr(ql, _splat(V32B, 4))
        qh = load_at(builder, base, 128 + 32 * half, V32B)
        hi = builder.and_(builder.lshr(qh, _splat(V32B, 2 * plane)), _splat(V32B, 3))
        return builder.or_(lo, builder.shl(hi, _splat(V32B, 4)))

    def rows(builder, base0, base1):
        qs = [_concat(builder, chunk(builder, base, 2 * k), chunk(builder, base, 2 * k + 1))
              for base in (base0, base1) for k in range(4)]
        scales = [builder.sext(load_at(builder, base, 192, ir.VectorType(I8, 16)), V16I) for base in (base0, base1)]
        # a dot of chunks 2k and 2k + 1: lane j holds 4 values of the 16 that share scale 4k + j / 4
        lane_scales = [builder.shuffle_vector(sc, sc, ir.Constant(V16I, [4 * k + j // 4 for j in range(16)]))
                       for sc in scales for k in range(4)]
        return {"q": qs, "lane_scales": lane_scales, "scales": scales,
                "d": _two_halves(builder, half_at(builder, base0, 208), half_at(builder, base1, 208), 1)}

    def block(builder, two, col, accs):
        lanes = []  # each row's 8 lanes, which sum to its block's integer
        for r in range(2):
            dots = [scaled_dot4(builder, q, col["y"][k], two["lane_scales"][4 * r + k], DOTS)
                    for k, q in enumerate(two["q"][4 * r:4 * r + 4])]
            summed = builder.add(builder.add(dots[0], dots[1]), builder.add(dots[2], dots[3]))
            offsets = pair_products(builder, two["scales"][r], col["bsums"], DOTS)  # the -32 of every code
            lanes.append(builder.sub(builder.add(_half(builder, summed, 0), _half(builder, summed, 1)),
                                     builder.shl(offsets, _splat(V8I, 5))))
        quads = _sums_of_eight(builder, lanes * 4)  # (both rows' sums, four times)
        total = builder.shuffle_vector(quads, quads, ir.Constant(v2i, [0, 1]))
        r = builder.fmul(builder.sitofp(total, v2f), two["d"])
        return [_fma(builder, r, col["d"], accs[0])]

    def finish(builder, accs):
        return tuple(builder.extract_element(accs[0], ir.Constant(I32, r)) for r in range(2))

    return PairFormat(210, [_splat(v2f, 0.0)], shared, rows, block, finish)


# how far ahead of each row's block the kernels ask for weight bytes: a decode step reads every
# weight once, from memory, and with the hardware prefetcher alone the products waited on it.
# Far enough to cover memory's latency at a single column's pace, near enough that the lines are
# still in cache when the rows reach them (in a model other ops run in between).  Every row of a
# tile asks for its own: a pair of rows moves two blocks on per step, and asking ahead of one
# row only covered half of what the rows then read (medium products 10-30% slower on a Zen 3).
# Two requests per block: into the L2 cache far ahead, into L1 nearer - a core keeps only so many
# misses to memory in flight, and the L2's request lets the L1's find its line on the way (a
# decoding step's 178 MB Gemma 3 head streamed 8% faster than with one request 8 KB ahead)
PREFETCH_NEAR, PREFETCH_FAR = 4096, 16384


def _prefetch(builder, base, block_bytes: int) -> None:
    """IR: prefetch (for reading) the cache lines PREFETCH_NEAR past a block at ``base`` into
    every cache level, and those PREFETCH_FAR past it into L2 - its rows lie one after another,
    so that is where the next rows' blocks are."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
                                        "llvm.prefetch.p0i8")
    for ahead, locality in ((PREFETCH_NEAR, 3), (PREFETCH_FAR, 2)):  # (llvm.prefetch's 3: all levels; 2: from L2 on)
        for line in range(0, block_bytes, 64):
            at = builder.gep(base, [ir.Constant(I64, ahead + line)])
            builder.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])


def _block_loop(builder, inits: list, nb, body: Callable) -> list:
    """IR: ``for b in range(nb): accs = body(b, accs)`` from ``inits``, one basic block; returns
    the accumulators' final values (their starting values when nb <= 0)."""
    b, pre, loop, done = loop_begin(builder, nb, "blocks")
    accs = [builder.phi(c.type) for c in inits]
    for phi, c in zip(accs, inits):
        phi.add_incoming(c, pre)
    nexts = body(b, accs)
    for phi, nxt in zip(accs, nexts):
        phi.add_incoming(nxt, loop)
    loop_end(builder, b, nb, loop, done)
    return _merge(builder, inits, pre, nexts, loop)  # the exit block's phis, before any other instruction


def _merge(builder, a: list, a_block, b: list, b_block) -> list:
    """IR: phis of values a (coming from block a_block) and b (from b_block), pair by pair."""
    merged = []
    for x, y in zip(a, b):
        phi = builder.phi(x.type)
        phi.add_incoming(x, a_block)
        phi.add_incoming(y, b_block)
        merged.append(phi)
    return merged


def _tile_ir(builder, fmt: Format | PairFormat, rows: list, cols: list, nb) -> list[list]:
    """IR: the products of weight rows ``rows`` (pointers to their GGUF blocks) with activation
    columns ``cols`` ((yb, yd, ys) pointers), one chain per (row, column) in one loop over the
    blocks; returns the results by row, then column.  Each chain's float steps are the format's
    for that pair alone.  The rows' unpacking is written once per column but computed once: the
    same loads and arithmetic in one basic block, which LLVM's common-subexpression pass merges
    (so C columns cost C dots, not C unpackings).  A PairFormat's two rows are unpacked once
    and go on in one chain of double-width vectors per column."""
    n_acc = len(fmt.init)
    paired = isinstance(fmt, PairFormat)
    if paired:
        assert len(rows) == 2
    chains = [(0, c) for c in range(len(cols))] if paired else [(r, c) for r in range(len(rows)) for c in range(len(cols))]

    def body(b, accs):  # chain i's accumulators at i * n_acc
        shared = [fmt.shared(builder, b, nb, *col) for col in cols]
        bases = [builder.gep(row, [builder.mul(b, ir.Constant(I64, fmt.block_bytes))]) for row in rows]
        for base in bases:  # each row's stream: a pair of rows reads two blocks per block step
            _prefetch(builder, base, fmt.block_bytes)
        two = fmt.rows(builder, *bases) if paired else None
        nexts = []
        for i, (r, c) in enumerate(chains):
            nexts += fmt.block(builder, two if paired else bases[r], shared[c], accs[i * n_acc:(i + 1) * n_acc])
        return nexts

    tail = fmt.tail if paired else None
    one = ir.Constant(I64, 1)
    odd = builder.trunc(builder.and_(nb, one), ir.IntType(1)) if tail else None
    finals = _block_loop(builder, fmt.init * len(chains), builder.sub(nb, builder.zext(odd, I64)) if tail else nb, body)
    results = [fmt.finish(builder, finals[i * n_acc:(i + 1) * n_acc]) for i in range(len(chains))]
    if tail:  # an odd last block: its part added to each result
        pre = builder.basic_block
        flat = [v for pair in results for v in pair]
        with builder.if_then(odd):
            last = builder.sub(nb, one)
            two = fmt.rows(builder, *[builder.gep(row, [builder.mul(last, ir.Constant(I64, fmt.block_bytes))])
                                      for row in rows])
            ended = [fmt.tail(builder, two, fmt.shared(builder, last, nb, *cols[c]), results[i])
                     for i, (_, c) in enumerate(chains)]
            tail_end = builder.basic_block
        flat = _merge(builder, flat, pre, [v for pair in ended for v in pair], tail_end)
        results = [tuple(flat[2 * i:2 * i + 2]) for i in range(len(chains))]
    if paired:  # a (row 0, row 1) pair per column
        return [[results[c][r] for c in range(len(cols))] for r in range(2)]
    return [results[r * len(cols):(r + 1) * len(cols)] for r in range(len(rows))]


def _by_format(builder, kind: Fmt, fmt, emit: Callable) -> list:
    """IR: ``emit(format)`` for the format ``fmt`` (a runtime kinds.Fmt number, column_format's)
    says - weight kind ``kind``'s own, or its batch format where it has one; returns emit's
    values, merged from both branches."""
    batch = BATCH_FORMAT.get(kind)
    if batch is None:
        return emit(FORMATS[kind])
    is_batch = builder.icmp_signed("==", fmt, ir.Constant(fmt.type, int(batch)))
    with builder.if_else(is_batch) as (then, otherwise):
        with then:
            batch_values, batch_end = emit(FORMATS[batch]), builder.basic_block
        with otherwise:
            own_values, own_end = emit(FORMATS[kind]), builder.basic_block
    return _merge(builder, batch_values, batch_end, own_values, own_end)


def _shape(context, builder, ty, value, axis: int):
    arr = context.make_array(ty)(context, builder, value)
    return cgutils.unpack_tuple(builder, arr.shape, ty.ndim)[axis]


@intrinsic(prefer_literal=True)
def row_pair_dots(typingctx, kind, fmt, row0, row1, yb, yd, ys):
    """``(kind, fmt, row0, row1, yb, yd, ys) -> (float32, float32)``: two weight rows of weight
    kind ``kind`` (a kinds.Fmt, a constant of the kernel) in format ``fmt`` (column_format's:
    the kind's own or its batch format) times one activation column quantized to bytes (yb,
    int8), its block scales yd and block sums ys; the two rows' chains side by side.  Only the
    kind's own formats are compiled into a kernel; the format is chosen in the kernel's code
    (an intrinsic, not an overload: numba would compile each overload as a function of its own
    first, seconds per kernel).

    Raw pointers, no bounds checks: it reads nb = yd.size blocks of yb/yd/ys and nb *
    block_bytes bytes of each row; the rows are tensor_rows() views of row_size(K) = nb *
    block_bytes bytes (numpy checked them against the buffer), and the activation has the same
    K (MUL_MAT's shape check, which the RPC server re-runs)."""
    k = Fmt(literal_kind(kind, "row_pair_dots"))

    def codegen(context, builder, signature, args):
        tys, vals = signature.args[2:], args[2:]
        ptrs = [context.make_array(t)(context, builder, a).data for t, a in zip(tys, vals)]
        nb = _shape(context, builder, tys[3], vals[3], 0)
        r0, r1 = _by_format(builder, k, args[1], lambda f: [v[0] for v in _tile_ir(builder, f, ptrs[:2], [ptrs[2:]], nb)])
        return context.make_tuple(builder, signature.return_type, [r0, r1])
    return types.UniTuple(types.float32, 2)(kind, fmt, row0, row1, yb, yd, ys), codegen


def _row_at(context, builder, ty, value, n):
    """IR: a pointer to row n of a 2-d array (its first element), by the array's own stride."""
    arr = context.make_array(ty)(context, builder, value)
    stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
    at = builder.gep(builder.bitcast(arr.data, I8.as_pointer()), [builder.mul(n, stride)])
    return builder.bitcast(at, arr.data.type), arr


@intrinsic(prefer_literal=True)
def tile_dots(typingctx, kind, fmt, n_cols, row0, row1, yb, yd, ys, n0, out, m0, m1):
    """``(kind, fmt, n_cols, row0, row1, yb, yd, ys, n0, out, m0, m1)``: row_pair_dots for
    n_cols (a constant: TILE_WIDE, TILE_MID or TILE_NARROW) columns from n0 at once, all in
    format ``fmt`` (yb int8 [N, k], yd and ys float32 [N, ...]), each product written to
    out[n, m0] / out[n, m1] (float32 [N, M]): _tile_ir's chains, so that a batch's columns
    share each block's unpacking and its load from memory.

    Raw pointers, no bounds checks: qdot.py passes n0 + n_cols <= N columns and m0, m1 < M,
    with the arrays of one product (MUL_MAT's shape checks); nb = yd.shape[1] blocks."""
    k, width = Fmt(literal_kind(kind, "tile_dots")), literal_kind(n_cols, "tile_dots")

    def codegen(context, builder, signature, args):
        tys = signature.args[3:]
        row0, row1, yb, yd, ys, n0, out, m0, m1 = args[3:]
        rows = [context.make_array(t)(context, builder, a).data for t, a in zip(tys[:2], (row0, row1))]
        nb = _shape(context, builder, tys[3], yd, 1)
        cols = [[_row_at(context, builder, tys[i], args[3 + i], builder.add(n0, ir.Constant(I64, c)))[0] for i in (2, 3, 4)]
                for c in range(width)]

        def emit(f):
            results = _tile_ir(builder, f, rows, cols, nb)
            return [results[r][c] for r in range(2) for c in range(width)]

        results = _by_format(builder, k, args[1], emit)
        for c in range(width):
            dst = _row_at(context, builder, tys[6], out, builder.add(n0, ir.Constant(I64, c)))[0]
            for r, m in enumerate((m0, m1)):
                builder.store(results[r * width + c], builder.gep(dst, [m]))
        return context.get_dummy_value()
    return types.void(kind, fmt, n_cols, row0, row1, yb, yd, ys, n0, out, m0, m1), codegen


# by kinds.Fmt, in its order
LEGACY = {Fmt.Q4_0: Legacy(18, 2, False, False, 8, False), Fmt.Q4_1: Legacy(20, 4, True, False, 0, False),
          Fmt.Q5_0: Legacy(22, 6, False, True, 16, False), Fmt.Q5_1: Legacy(24, 8, True, True, 0, False),
          Fmt.Q8_0: Legacy(34, 2, False, False, 0, True)}
# the formats whose products read each activation block's lane sums times -offset (int32 x 8)
# after the values, by their offset: the signed legacy formats (their dots start there; _legacy)
LANE_SUMS = {f: offset for f, blk in LEGACY.items() if (offset := _lane_sums_offset(blk))}
FORMATS = {**{f: _legacy(blk) for f, blk in LEGACY.items()},
           Fmt.Q4_K: _q45_k(five=False), Fmt.Q5_K: _q45_k(five=True), Fmt.Q6_K: _q6_k(),
           Fmt.Q4_K_X8: _q4_k_x8_paired(per_pair=False), Fmt.Q4_K_X8_GEMM: _q4_k_x8_paired(per_pair=True),
           Fmt.Q6_K_TILED: _q6_k_tiled(), Fmt.Q4_K_TILED: _q45_k_tiled(five=False),
           Fmt.Q5_K_TILED: _q45_k_tiled(five=True), Fmt.MXFP4: _mxfp4()}
assert list(FORMATS) == list(Fmt)

# the columns a tile takes at once (fewer take row_pair_dots)
TILE_WIDE, TILE_MID, TILE_NARROW = 8, 4, 2

_jit = njit(inline="always", **KERNEL)


@_jit
def column_format(kind, n, n_cols, tiled_min_cols):
    """The format (a kinds.Fmt) of column n of n_cols for weights in format ``kind``: what
    llama.cpp's kernel for that many columns computes."""
    if kind == Fmt.Q4_K_X8 and n < n_cols - n_cols % 4:  # repacked Q4_K: columns in whole fours (its gemm)
        return Fmt.Q4_K_X8_GEMM
    if n_cols >= tiled_min_cols:  # the other K-quants: its tiled matmul
        if kind == Fmt.Q4_K:
            return Fmt.Q4_K_TILED
        if kind == Fmt.Q5_K:
            return Fmt.Q5_K_TILED
        if kind == Fmt.Q6_K:
            return Fmt.Q6_K_TILED
    return kind
