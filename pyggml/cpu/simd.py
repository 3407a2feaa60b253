"""The float arithmetic of ggml's x86 SIMD code, reproduced one rounding at a time.

llama.cpp's CPU backend computes sums in a fixed lane order (8 lanes for the quantized dot
products, 16 for F16 and softmax), fuses multiply-adds, and uses its own exp polynomial.  With
activations quantized to 8 bits, a difference in the last bit of one value can flip the rounding
of an activation, and through a model's layers that flips near-tied argmaxes: so the CPU backend
does the same operations in the same order, and its results equal llama.cpp's bit for bit
(tests/test_models.py checks this against llama.cpp's outputs).

These helpers are numba functions inlined into the kernels that use them; the vector loops
(``lane_chain8``, ``lane_dots``, ``block_dots_2x2``) are written as LLVM IR intrinsics, because
numba does not vectorize their shape by itself.  Integer products are exact however they are
computed, so ``lane_dots`` may use ``vpdpbusd``; every float step keeps ggml's order.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

f32 = np.float32


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with a single rounding (``llvm.fma.f32``: one instruction where the CPU has FMA,
    the C library's exact ``fmaf`` where it does not)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3),
                                            "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def half_to_float(typingctx, bits):
    """The float32 value of the IEEE half whose bits are ``bits`` (uint16): LLVM's ``fpext half``,
    one ``vcvtph2ps`` for 16 values where the CPU has F16C; exact, as ggml's F16 -> F32."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def pow2_f32(typingctx, n):
    """2**n as float32 for -126 <= n <= 127 (int32 n), from its exponent bits."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return sig, codegen


def loop_begin(builder, n, name: str):
    """Open ``for i in range(n)`` (skipped when n <= 0) as one basic block; returns (i, pre,
    loop, done) with the builder in the loop body.  More phis may follow i's at once."""
    i64 = ir.IntType(64)
    pre = builder.basic_block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), pre)
    return i, pre, loop, done


def loop_end(builder, i, n, loop, done) -> None:
    """Close the loop loop_begin opened; the builder continues after it."""
    i_next = builder.add(i, ir.Constant(ir.IntType(64), 1))
    i.add_incoming(i_next, loop)
    builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
    builder.position_at_end(done)


def splat8(builder, x):
    """IR: a float as all 8 lanes of a vector."""
    v8, i32 = ir.VectorType(ir.FloatType(), 8), ir.IntType(32)
    one = builder.insert_element(ir.Constant(v8, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(v8, ir.Undefined), ir.Constant(ir.VectorType(i32, 8), [0] * 8))


def hsum8_ir(builder, v):
    """IR of ``hsum8`` over the 8 lanes of v, in its order."""
    e = [builder.extract_element(v, ir.Constant(ir.IntType(32), i)) for i in range(8)]
    return builder.fadd(builder.fadd(builder.fadd(e[0], e[4]), builder.fadd(e[2], e[6])),
                        builder.fadd(builder.fadd(e[1], e[5]), builder.fadd(e[3], e[7])))


def _lane_chains(context, builder, s_rows, wd_rows, yd_ptr, nb):
    """IR of ``len(s_rows)`` independent 8-lane chains over the same activation scales:
    ``acc_r[0:8] = fma(wd_r[b] * yd[b], S_r[8b:8b+8], acc_r)`` for b < nb; each then ``hsum8``."""
    f32t, i64 = ir.FloatType(), ir.IntType(64)
    v8 = ir.VectorType(f32t, 8)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8] * 3), "llvm.fma.v8f32")
    zero = ir.Constant(v8, [0.0] * 8)
    b, pre, loop, done = loop_begin(builder, nb, "lanes")
    accs = [builder.phi(v8) for _ in s_rows]  # phis first in the block
    for acc in accs:
        acc.add_incoming(zero, pre)
    y = builder.load(builder.gep(yd_ptr, [b]))
    nexts = []
    for s_ptr, wd_ptr, acc in zip(s_rows, wd_rows, accs):
        splat = splat8(builder, builder.fmul(builder.load(builder.gep(wd_ptr, [b])), y))
        lanes = builder.load(builder.bitcast(builder.gep(s_ptr, [builder.mul(b, ir.Constant(i64, 8))]), v8.as_pointer()),
                             align=4)
        nexts.append(builder.call(fma, [splat, lanes, acc]))
    for acc, nacc in zip(accs, nexts):
        acc.add_incoming(nacc, loop)
    loop_end(builder, b, nb, loop, done)
    results = [builder.phi(v8) for _ in nexts]
    for res, nacc in zip(results, nexts):
        res.add_incoming(zero, pre)
        res.add_incoming(nacc, loop)
    return [hsum8_ir(builder, res) for res in results]


@intrinsic
def lane_chain8(typingctx, S, wd, yd, nb):
    """The 8-lane accumulation of ggml's quantized dot products, as one vector loop:
    ``acc[0:8] = fma(wd[b] * yd[b], S[8b:8b+8], acc)`` for b < nb, then ``hsum8(acc)``.

    Written in LLVM IR because numba does not vectorize the 8 scalar chains (its SLP
    vectorizer is off) and they were most of a decoding step's matrix products.

    Raw pointers, no bounds checks (numba's cannot see into IR): it reads S[0:8nb], wd[0:nb]
    and yd[0:nb].  qdot.py passes nb = wd.size, the row's blocks, with S of k64/4 >= 8 * nb
    lane sums and yd of the activation's blocks (the same K: MUL_MAT's shape check)."""
    sig = types.float32(S, wd, yd, types.intp)

    def codegen(context, builder, signature, args):
        s_ptr, wd_ptr, yd_ptr = (context.make_array(t)(context, builder, a).data
                                 for t, a in zip(signature.args[:3], args[:3]))
        return _lane_chains(context, builder, [s_ptr], [wd_ptr], yd_ptr, args[3])[0]
    return sig, codegen


def target_has_vnni() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI (vpdpbusd, on 512- and 256-bit vectors:
    with AVX-512 VL, which every VNNI CPU has); PYGGML_NO_VNNI=1 says no
    (tests use it to check the portable path, with a numba cache of their own)."""
    import os

    import llvmlite.binding as llvm
    from numba.core import config
    if os.environ.get("PYGGML_NO_VNNI") == "1":
        return False
    if config.CPU_NAME and config.CPU_NAME != "host":
        return all(f"+{f}" in (config.CPU_FEATURES or "") for f in ("avx512vnni", "avx512vl"))
    features = llvm.get_host_cpu_features()
    return all(features.get(f) for f in ("avx512vnni", "avx512f", "avx512vl"))


def dot4(builder, wb, yb, signed_weights: bool, vnni: bool):
    """IR: the sums of 4 consecutive products ``w[i] * y[i]`` of two byte vectors of 32 or 64
    elements (weights unsigned, or signed; activations signed), as an i32 vector of a quarter
    the length; exact.  One ``vpdpbusd`` with AVX-512 VNNI (the instruction ggml's own kernels
    use), with ggml's sign trick for signed weights (|w| x sign(w) y); plain vector IR that LLVM
    lowers anywhere else."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    n = wb.type.count
    vsum = ir.VectorType(i32, n // 4)
    if vnni:
        zero8 = ir.Constant(ir.VectorType(i8, n), [0] * n)
        if signed_weights:  # |w| (unsigned) x y with w's sign (0 where w is 0)
            negative = builder.icmp_signed("<", wb, zero8)
            yb = builder.select(negative, builder.sub(zero8, yb), yb)
            yb = builder.select(builder.icmp_signed("==", wb, zero8), zero8, yb)
            wb = builder.select(negative, builder.sub(zero8, wb), wb)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vsum, [vsum] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{n * 8}")
        return builder.call(fn, [ir.Constant(vsum, [0] * (n // 4)), builder.bitcast(wb, vsum), builder.bitcast(yb, vsum)])
    vwide = ir.VectorType(i32, n)
    cv = builder.sext(wb, vwide) if signed_weights else builder.zext(wb, vwide)
    prod = builder.mul(cv, builder.sext(yb, vwide))
    parts = [builder.shuffle_vector(prod, ir.Constant(vwide, ir.Undefined), ir.Constant(vsum, list(range(k, n, 4))))
             for k in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _lane_dots(signed_weights: bool):
    """out[16g:16g+16] = float(sum of 4 consecutive products w[i] * y[i]) for g < n64: 8-bit
    weights (unsigned, or signed) times signed 8-bit activations, 64 at a time, exact (dot4).

    Raw pointers: reads codes[0:64 n64] and y[0:64 n64], writes out[0:16 n64].  qdot.py passes
    n64 = codes.size // 64 with codes and y both padded to k64 bytes and out of k64 / 4 floats."""
    def typer(typingctx, codes, y, out, n64):
        return types.void(codes, y, out, types.intp), _codegen
    vnni = target_has_vnni()

    def _codegen(context, builder, signature, args):
        i8, i64, f32t = ir.IntType(8), ir.IntType(64), ir.FloatType()
        v16f, v64b = ir.VectorType(f32t, 16), ir.VectorType(i8, 64)
        c_ptr, y_ptr, o_ptr = (context.make_array(t)(context, builder, a).data
                               for t, a in zip(signature.args[:3], args[:3]))
        n = args[3]
        g, _, loop, done = loop_begin(builder, n, "dots")
        at = builder.mul(g, ir.Constant(i64, 64))
        wb = builder.load(builder.bitcast(builder.gep(c_ptr, [at]), v64b.as_pointer()), align=1)
        yb = builder.load(builder.bitcast(builder.gep(y_ptr, [at]), v64b.as_pointer()), align=1)
        sums = dot4(builder, wb, yb, signed_weights, vnni)
        dst = builder.bitcast(builder.gep(o_ptr, [builder.mul(g, ir.Constant(i64, 16))]), v16f.as_pointer())
        builder.store(builder.sitofp(sums, v16f), dst, align=4)
        loop_end(builder, g, n, loop, done)
        return context.get_dummy_value()
    return intrinsic(typer)


lane_dots = _lane_dots(signed_weights=False)
lane_dots_signed = _lane_dots(signed_weights=True)


def _block_dots_2x2(signed_weights: bool, with_min: bool):
    """The dot products of two unpacked weight rows with two activation columns, each as ggml's
    32-element block dot computes it, in one loop over the blocks: per block b the 8 lane sums
    of a row and a column (dot4 over its 32 bytes: lane l sums elements 4l..4l+3) go straight
    into that pair's chain ``acc = fma(wd[b] * yd[b], float(sums), acc)``, and with the minimum
    ``summs = fma(wm[b], ys[b], summs)`` beside it; the result is ``hsum8(acc) + summs``.  The
    same float steps as lane_dots + lane_chain8, without the lane sums' trip through memory,
    and four independent chains in flight.

    ``block_dots_2x2(codes, wd, wm, yb, yd, ys, n0, n1, nb)``: codes int8 [2, k64], wd and wm
    float32 [2, nb], yb int8 [N, k64], yd and ys float32 [N, nb] (C-contiguous); returns the
    products of (row 0, column n0), (row 1, n0), (row 0, n1), (row 1, n1).  Raw pointers, no bounds
    checks: qdot.py passes nb = K / 32 blocks and columns n0, n1 < N."""
    def typer(typingctx, codes, wd, wm, yb, yd, ys, n0, n1, nb):
        return types.UniTuple(types.float32, 4)(codes, wd, wm, yb, yd, ys, types.intp, types.intp, types.intp), \
            _codegen
    vnni = target_has_vnni()

    def _codegen(context, builder, signature, args):
        i8, i64, f32t = ir.IntType(8), ir.IntType(64), ir.FloatType()
        v8, v32b = ir.VectorType(f32t, 8), ir.VectorType(i8, 32)
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:6], args[:6])]
        codes, wd, wm, yb, yd, ys = arrays
        n0, n1, nb = args[6:9]
        k64 = builder.extract_value(codes.shape, 1)
        rows = [(builder.gep(codes.data, [builder.mul(ir.Constant(i64, r), k64)]),
                 builder.gep(wd.data, [builder.mul(ir.Constant(i64, r), nb)]),
                 builder.gep(wm.data, [builder.mul(ir.Constant(i64, r), nb)])) for r in range(2)]
        cols = [(builder.gep(yb.data, [builder.mul(n, k64)]), builder.gep(yd.data, [builder.mul(n, nb)]),
                 builder.gep(ys.data, [builder.mul(n, nb)])) for n in (n0, n1)]
        fma_v = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8] * 3), "llvm.fma.v8f32")
        fma_s = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32t, [f32t] * 3), "llvm.fma.f32")
        zero_v, zero_s = ir.Constant(v8, [0.0] * 8), ir.Constant(f32t, 0.0)
        pairs = [(r, c) for c in range(2) for r in range(2)]
        b, pre, loop, done = loop_begin(builder, nb, "blocks")
        accs = [builder.phi(v8) for _ in pairs]
        mins = [builder.phi(f32t) for _ in pairs]
        for phi, zero in zip(accs + mins, [zero_v] * 4 + [zero_s] * 4):
            phi.add_incoming(zero, pre)
        at = builder.mul(b, ir.Constant(i64, 32))
        wbs = [builder.load(builder.bitcast(builder.gep(r[0], [at]), v32b.as_pointer()), align=1) for r in rows]
        ybs = [builder.load(builder.bitcast(builder.gep(c[0], [at]), v32b.as_pointer()), align=1) for c in cols]
        wds = [builder.load(builder.gep(r[1], [b])) for r in rows]
        yds = [builder.load(builder.gep(c[1], [b])) for c in cols]
        next_accs, next_mins = [], []
        for (r, c), acc, summs in zip(pairs, accs, mins):
            sums = builder.sitofp(dot4(builder, wbs[r], ybs[c], signed_weights, vnni), v8)
            next_accs.append(builder.call(fma_v, [splat8(builder, builder.fmul(wds[r], yds[c])), sums, acc]))
            if with_min:
                wm_b = builder.load(builder.gep(rows[r][2], [b]))
                ys_b = builder.load(builder.gep(cols[c][2], [b]))
                next_mins.append(builder.call(fma_s, [wm_b, ys_b, summs]))
            else:
                next_mins.append(summs)
        for phi, nxt in zip(accs + mins, next_accs + next_mins):
            phi.add_incoming(nxt, loop)
        loop_end(builder, b, nb, loop, done)
        final_accs = [builder.phi(v8) for _ in pairs]  # the phis first in the block
        final_mins = [builder.phi(f32t) for _ in pairs] if with_min else []
        for phi, nacc in zip(final_accs, next_accs):
            phi.add_incoming(zero_v, pre)
            phi.add_incoming(nacc, loop)
        for phi, nmin in zip(final_mins, next_mins):
            phi.add_incoming(zero_s, pre)
            phi.add_incoming(nmin, loop)
        results = [hsum8_ir(builder, acc) for acc in final_accs]
        if with_min:
            results = [builder.fadd(total, summs) for total, summs in zip(results, final_mins)]
        return context.make_tuple(builder, signature.return_type, results)
    return intrinsic(typer)


# the 32-element formats: signed weights without a minimum (Q4_0, Q5_0, Q8_0), unsigned with one (Q4_1, Q5_1)
block_dots_2x2_signed = _block_dots_2x2(True, False)
block_dots_2x2_min = _block_dots_2x2(False, True)


_jit = njit(cache=True, inline="always")


@_jit
def hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    """ggml's ``hsum_float_8``: high half onto low half, then pairs (movehl), then the last two."""
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@_jit
def reduce16(v, o):
    """GCC's ``_mm512_reduce_add_ps`` of v[o:o+16]: halves folded 256 -> 128 -> 64 -> 32 bits."""
    t0 = v[o + 8] + v[o + 0]
    t1 = v[o + 9] + v[o + 1]
    t2 = v[o + 10] + v[o + 2]
    t3 = v[o + 11] + v[o + 3]
    t4 = v[o + 12] + v[o + 4]
    t5 = v[o + 13] + v[o + 5]
    t6 = v[o + 14] + v[o + 6]
    t7 = v[o + 15] + v[o + 7]
    u0, u1, u2, u3 = t4 + t0, t5 + t1, t6 + t2, t7 + t3
    w0, w1 = u0 + u2, u1 + u3
    return w0 + w1


# ggml_v_expf's constants (an ARM optimized-routines polynomial), all exact float32 values
_SHIFT = f32(float.fromhex("0x1.8p23"))
_LOG2E = f32(float.fromhex("0x1.715476p+0"))
_LN2_HI = f32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = f32(float.fromhex("0x1.7f7d1cp-20"))
_C1 = f32(float.fromhex("0x1.ffffecp-1"))
_C2 = f32(float.fromhex("0x1.fffdb6p-2"))
_C3 = f32(float.fromhex("0x1.555e66p-3"))
_C4 = f32(float.fromhex("0x1.573e2ep-5"))
_C5 = f32(float.fromhex("0x1.0e4020p-7"))


@_jit
def expf_v(x):
    """One lane of ggml_v_expf (AVX-512): e**x to within 1.5 ulp, the same bits as llama.cpp."""
    z = fma32(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, f32(1.0)))
    if abs(n) > f32(192.0):
        return f32(0.0) if n <= f32(0.0) else f32(np.inf)
    # scalef: j * 2**n with one rounding.  j is within [2**-0.5, 2**0.5], so for -125 <= n <= 127
    # the result is a normal float and multiplying by 2**n (built from its bits) is exact
    if f32(-125.0) <= n <= f32(127.0):
        return j * pow2_f32(np.int32(n))
    return f32(math.ldexp(np.float64(j), np.int64(n)))


@_jit
def silu_v(x):
    """ggml_v_silu: x / (1 + e**-x) with ggml_v_expf."""
    return x / (f32(1.0) + expf_v(f32(0.0) - x))
