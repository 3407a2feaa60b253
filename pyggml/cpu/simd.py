"""The float arithmetic of ggml's x86 SIMD code, reproduced one rounding at a time.

llama.cpp's CPU backend computes sums in a fixed lane order (8 lanes for the quantized dot
products, 16 for F16 and softmax), fuses multiply-adds, and uses its own exp polynomial.  With
activations quantized to 8 bits, a difference in the last bit of one value can flip the rounding
of an activation, and through a model's layers that flips near-tied argmaxes: so the CPU backend
does the same operations in the same order, and its results equal llama.cpp's bit for bit
(tests/models/test_models.py checks this against llama.cpp's outputs).

These helpers are numba functions inlined into the kernels that use them, and pieces of LLVM
IR for the quantized products (blockdot.py), because numba does not vectorize their shape by
itself.  Integer products are exact however they are computed, so ``dot4`` uses the CPU's
integer dot instructions (``vpdpbusd``, or AVX2's ``vpmaddubsw``); every float step keeps ggml's
order.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

f32 = np.float32

# The options of every kernel (numba.njit, numba.cfunc): cached on disk (kernel_cache.py), no
# bounds checks, and numpy's error model.  numba's default model ("python") tests each division
# for a zero divisor to raise ZeroDivisionError: a branch in the loop, which keeps it from
# vectorizing (SiLU's rows ran five times slower than the same code in a parallel loop, which
# numba compiles with numpy's model).  Numpy's model divides as C does (inf, NaN), as ggml does;
# every nonzero divisor gives the same bits either way.
KERNEL = dict(cache=True, boundscheck=False, error_model="numpy")


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
def round_f16(typingctx, v):
    """The float16 value nearest to ``v`` (ties to even, infinity past the largest half), as
    float32: LLVM's ``fptrunc`` to half and ``fpext`` back - vcvtps2ph/vcvtph2ps where the CPU has
    F16C, compiler-rt's exact conversion elsewhere - as ggml's FP32 -> FP16 -> FP32.  (A libm
    frexp/ldexp version cost a call each: 64 per attention row for its query alone.)"""
    if v not in (types.float32, types.float64):
        return None
    sig = types.float32(v)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def f16_bits(typingctx, v):
    """The bits (uint16) of the float16 nearest to the float32 ``v`` (round_f16's rounding)."""
    if v != types.float32:
        return None
    sig = types.uint16(v)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
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


def splat(builder, x, lanes: int = 8):
    """IR: a float as all lanes of a vector (8 unless told)."""
    vec, i32 = ir.VectorType(ir.FloatType(), lanes), ir.IntType(32)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


V16F = ir.VectorType(ir.FloatType(), 16)


def load_halves16(builder, ptr, at):
    """IR: the 16 F16 values (uint16 bits) at element ``at`` of ``ptr`` as float32 (exact)."""
    bits = builder.load(builder.bitcast(builder.gep(ptr, [at]), ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), V16F)


def hsum8_ir(builder, v):
    """IR of ggml's ``hsum_float_8`` over the 8 lanes of v: high half onto low half, then pairs
    (movehl), then the last two."""
    e = [builder.extract_element(v, ir.Constant(ir.IntType(32), i)) for i in range(8)]
    return builder.fadd(builder.fadd(builder.fadd(e[0], e[4]), builder.fadd(e[2], e[6])),
                        builder.fadd(builder.fadd(e[1], e[5]), builder.fadd(e[3], e[7])))


def fold_halves(builder, v, add):
    """IR: the sum of v's elements by folding halves, ``add(high half, low half)`` until one is
    left: GCC's ``_mm512_reduce_add_ps`` order for 16 floats (reduce16), any order for integers."""
    i32 = ir.IntType(32)
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n), list(range(n, 2 * n))))
        v = add(hi, lo)
    return builder.extract_element(v, ir.Constant(i32, 0))


def _f16_dot(n_acc: int):
    """An intrinsic ``(k, q, steps) -> float32``: the dot product of the F16 values k (uint16 bits)
    and the float32 values q over ``steps`` steps of 16 x n_acc elements, in n_acc 16-lane
    accumulators of fused multiply-adds, accumulator a taking elements 16a..16a+15 of each step;
    then (with 4) ``(acc0 + acc2) + (acc1 + acc3)``, and reduce16.  With 4: ggml_vec_dot_f16's
    vector part (AVX-512, its GGML_F16_STEP of 64); with 1: llamafile's tinyBLAS F16 dot.

    In IR because numba left the 64 lanes in memory, a load and a store per element per cell:
    here they stay in four registers.  Raw pointers: it reads k[0:16 n_acc steps] and the same of
    q (nn.py passes steps from q's size, and a cache row of the same size)."""
    def typer(typingctx, k, q, steps):
        return types.float32(k, q, types.intp), codegen

    def codegen(context, builder, signature, args):
        i64, v16f = ir.IntType(64), V16F
        kptr, qptr = (context.make_array(t)(context, builder, a).data for t, a in zip(signature.args[:2], args[:2]))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
        zero = ir.Constant(v16f, [0.0] * 16)
        i, pre, loop, done = loop_begin(builder, args[2], "f16dot")
        accs = [builder.phi(v16f) for _ in range(n_acc)]
        for acc in accs:
            acc.add_incoming(zero, pre)
        base = builder.mul(i, ir.Constant(i64, 16 * n_acc))
        nexts = []
        for a, acc in enumerate(accs):
            at = builder.add(base, ir.Constant(i64, 16 * a))
            qv = builder.load(builder.bitcast(builder.gep(qptr, [at]), v16f.as_pointer()), align=4)
            nexts.append(builder.call(fma, [load_halves16(builder, kptr, at), qv, acc]))
        for acc, nxt in zip(accs, nexts):
            acc.add_incoming(nxt, loop)
        loop_end(builder, i, args[2], loop, done)
        finals = []
        for nxt in nexts:
            phi = builder.phi(v16f)
            phi.add_incoming(zero, pre)
            phi.add_incoming(nxt, loop)
            finals.append(phi)
        v = finals[0] if n_acc == 1 else builder.fadd(builder.fadd(finals[0], finals[2]), builder.fadd(finals[1], finals[3]))
        return fold_halves(builder, v, builder.fadd)
    return intrinsic(typer)


@intrinsic
def f16_axpy16(typingctx, acc, v, p, steps):
    """``acc[i] = fma(float(v[i]), p, acc[i])`` for i < 16 x steps: a row of F16 values (uint16
    bits) times p into float32 accumulators, 16 lanes at a time (attention's V sums).  Raw
    pointers: nn.py passes steps from the row's size, acc at least as long."""
    sig = types.void(acc, v, types.float32, types.intp)

    def codegen(context, builder, signature, args):
        i64, v16f = ir.IntType(64), V16F
        aptr, vptr = (context.make_array(t)(context, builder, a).data for t, a in zip(signature.args[:2], args[:2]))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
        pv = splat(builder, args[2], 16)
        i, pre, loop, done = loop_begin(builder, args[3], "axpy")
        at = builder.mul(i, ir.Constant(i64, 16))
        a_at = builder.bitcast(builder.gep(aptr, [at]), v16f.as_pointer())
        total = builder.call(fma, [load_halves16(builder, vptr, at), pv, builder.load(a_at, align=4)])
        builder.store(total, a_at, align=4)
        loop_end(builder, i, args[3], loop, done)
        return context.get_dummy_value()
    return sig, codegen


def _sum_lanes(n_lanes: int):
    """An intrinsic ``(acc, out, steps)``: out[j] = the sum over lanes of acc [n_lanes, 16 steps]
    column j in ggml's order - with 64 lanes first ``(a[l] + a[l+32]) + (a[l+16] + a[l+48])``
    for l < 16 (ggml_vec_dot_f16's four accumulators), then reduce16's tree over the 16 - and
    acc zeroed for the next row.  Sixteen columns at a time in vector registers (numba's loops
    over a [64, dv] array were most of a decoding step's attention).  Raw pointers: acc
    C-contiguous with rows of 16 x steps floats, out as long."""
    def typer(typingctx, acc, out, steps):
        return types.void(acc, out, types.intp), codegen

    def codegen(context, builder, signature, args):
        i64, v16f = ir.IntType(64), V16F
        aptr, optr = (context.make_array(t)(context, builder, a).data for t, a in zip(signature.args[:2], args[:2]))
        row = builder.mul(args[2], ir.Constant(i64, 16))  # floats per lane
        zero = ir.Constant(v16f, [0.0] * 16)
        jb, pre, loop, done = loop_begin(builder, args[2], "lanes")
        at = builder.mul(jb, ir.Constant(i64, 16))
        ptrs = [builder.bitcast(builder.gep(aptr, [builder.add(at, builder.mul(row, ir.Constant(i64, lane)))]),
                                v16f.as_pointer()) for lane in range(n_lanes)]
        a = [builder.load(p, align=4) for p in ptrs]
        for p in ptrs:
            builder.store(zero, p, align=4)
        if n_lanes == 64:
            a = [builder.fadd(builder.fadd(a[l], a[l + 32]), builder.fadd(a[l + 16], a[l + 48])) for l in range(16)]
        half = 8
        while half:
            a = [builder.fadd(a[l + half], a[l]) for l in range(half)]
            half //= 2
        builder.store(a[0], builder.bitcast(builder.gep(optr, [at]), v16f.as_pointer()), align=4)
        loop_end(builder, jb, args[2], loop, done)
        return context.get_dummy_value()
    return intrinsic(typer)


sum_lanes64 = _sum_lanes(64)
sum_lanes16 = _sum_lanes(16)
f16_dot64 = _f16_dot(4)
f16_dot16 = _f16_dot(1)


# the integer dot instructions the products may use, from most to least capable: AVX-512 VNNI's
# vpdpbusd, AVX2's vpmaddubsw + vpmaddwd (ggml's x86 code without VNNI), or plain vector IR
# that LLVM lowers on any CPU (the same integers, several times the instructions)
DOT_LEVELS = ("vnni", "avx2", "plain")


def integer_dots() -> str:
    """The integer dot instructions (a DOT_LEVELS name) of the CPU numba compiles for, at most
    the level ``PYGGML_DOTS`` names (tests use it to check the other paths' bits on one
    machine, each with a numba cache of its own)."""
    import os

    import llvmlite.binding as llvm
    from numba.core import config
    cap = os.environ.get("PYGGML_DOTS", "vnni")
    if cap not in DOT_LEVELS:
        raise ValueError(f"PYGGML_DOTS={cap!r}: one of {', '.join(DOT_LEVELS)}")
    if config.CPU_NAME and config.CPU_NAME != "host":
        features = {f[1:] for f in (config.CPU_FEATURES or "").split(",") if f.startswith("+")}
    else:
        features = {f for f, on in llvm.get_host_cpu_features().items() if on}
    has = {"vnni": {"avx512vnni", "avx512f", "avx512vl"} <= features, "avx2": "avx2" in features, "plain": True}
    return next(level for level in DOT_LEVELS[DOT_LEVELS.index(cap):] if has[level])


def dot4(builder, wb, yb, signed_weights: bool, level: str, acc=None):
    """IR: the sums of 4 consecutive products ``w[i] * y[i]`` of two byte vectors of 32 or 64
    elements (weights unsigned, or signed; activations signed), as an i32 vector of a quarter
    the length, plus ``acc`` (an i32 vector of that length) if given; exact.  By ``level``
    (integer_dots'): one ``vpdpbusd`` with AVX-512 VNNI, the instruction ggml's own kernels use;
    with AVX2, ggml's ``vpmaddubsw`` (pairs of products summed to 16 bits) and ``vpmaddwd`` (to
    32) per 32 bytes - exact while no pair passes 32767, as with weights of at most 128 (every
    format's, and |w| of signed ones) times activations of at most 127 in magnitude (our
    quantizers'); plain vector IR elsewhere.  Signed weights take ggml's sign trick,
    ``|w| x sign(w) y``, for the unsigned-times-signed instructions."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    n = wb.type.count
    vsum = ir.VectorType(i32, n // 4)
    if level == "vnni":
        if signed_weights:  # |w| (unsigned) x y with w's sign (0 where w is 0)
            zero8 = ir.Constant(ir.VectorType(i8, n), [0] * n)
            negative = builder.icmp_signed("<", wb, zero8)
            yb = builder.select(negative, builder.sub(zero8, yb), yb)
            yb = builder.select(builder.icmp_signed("==", wb, zero8), zero8, yb)
            wb = builder.select(negative, builder.sub(zero8, wb), wb)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vsum, [vsum] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{n * 8}")
        start = ir.Constant(vsum, [0] * (n // 4)) if acc is None else acc
        return builder.call(fn, [start, builder.bitcast(wb, vsum), builder.bitcast(yb, vsum)])
    if level == "avx2":
        v32b, v16s = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
        pairs, quads = _maddubs(builder), _maddwd(builder)
        sign = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32b, [v32b] * 2), "llvm.x86.avx2.psign.b")
        absolute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32b, [v32b, ir.IntType(1)]),
                                                  "llvm.abs.v32i8")
        ones = ir.Constant(v16s, [1] * 16)
        sums = []
        for h in range(n // 32):
            part = ir.Constant(ir.VectorType(i32, 32), list(range(32 * h, 32 * h + 32)))
            w32, y32 = (v if n == 32 else builder.shuffle_vector(v, v, part) for v in (wb, yb))
            if signed_weights:  # ggml's vpsignb and vpabsb (|-128| = 128 as unsigned)
                w32, y32 = builder.call(absolute, [w32, ir.Constant(ir.IntType(1), 0)]), builder.call(sign, [y32, w32])
            sums.append(builder.call(quads, [builder.call(pairs, [w32, y32]), ones]))
        total = sums[0] if n == 32 else builder.shuffle_vector(sums[0], sums[1], ir.Constant(vsum, list(range(16))))
        return total if acc is None else builder.add(total, acc)
    vwide = ir.VectorType(i32, n)
    cv = builder.sext(wb, vwide) if signed_weights else builder.zext(wb, vwide)
    prod = builder.mul(cv, builder.sext(yb, vwide))
    parts = [builder.shuffle_vector(prod, ir.Constant(vwide, ir.Undefined), ir.Constant(vsum, list(range(k, n, 4))))
             for k in range(4)]
    total = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    return total if acc is None else builder.add(total, acc)


def _maddubs(builder):
    """AVX2's vpmaddubsw (unsigned x signed bytes, pairs summed to saturating 16 bits)."""
    v32b, v16s = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16s, [v32b] * 2), "llvm.x86.avx2.pmadd.ub.sw")


def _maddwd(builder):
    """AVX2's vpmaddwd (16-bit lanes multiplied, pairs summed to 32 bits)."""
    v16s, v8i = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i, [v16s] * 2), "llvm.x86.avx2.pmadd.wd")


def scaled_dot4(builder, wb, yb, scales, level: str):
    """IR: dot4(wb, yb) of unsigned weights, each lane times the same lane of ``scales`` (an i32
    vector of a quarter wb's length, of values that fit in 16 bits); exact.  With AVX2 the
    scales take the place of dot4's ones in ``vpmaddwd``: scaled for no instruction more (and
    the per-lane scales are the same for every column a tile multiplies).  So with VNNI too:
    its one ``vpdpbusd`` would then take a vector multiply of 32-bit lanes, more than
    ``vpmaddwd`` costs."""
    if level == "plain":
        return builder.mul(dot4(builder, wb, yb, False, level), scales)
    i16, i32 = ir.IntType(16), ir.IntType(32)
    n = wb.type.count
    pairs, quads = _maddubs(builder), _maddwd(builder)
    narrow = builder.trunc(scales, ir.VectorType(i16, n // 4))
    sums = []
    for h in range(n // 32):
        part = ir.Constant(ir.VectorType(i32, 32), list(range(32 * h, 32 * h + 32)))
        w32, y32 = (v if n == 32 else builder.shuffle_vector(v, v, part) for v in (wb, yb))
        # each 16-bit pair sum of vpmaddubsw times its lane's scale, in both halves of the pair
        lane_scales = builder.shuffle_vector(narrow, narrow, ir.Constant(ir.VectorType(i32, 16),
                                                                         [8 * h + k // 2 for k in range(16)]))
        sums.append(builder.call(quads, [builder.call(pairs, [w32, y32]), lane_scales]))
    return sums[0] if n == 32 else builder.shuffle_vector(sums[0], sums[1], ir.Constant(ir.VectorType(i32, 16),
                                                                                        list(range(16))))


def pair_sums(builder, v):
    """IR: an i32 vector of n -> n / 2 elements: element i the sum of elements 2i and 2i + 1."""
    n = v.type.count
    half = ir.VectorType(ir.IntType(32), n // 2)
    even = builder.shuffle_vector(v, v, ir.Constant(half, list(range(0, n, 2))))
    odd = builder.shuffle_vector(v, v, ir.Constant(half, list(range(1, n, 2))))
    return builder.add(even, odd)


def pair_products(builder, a, b, level: str):
    """IR: pair_sums(a * b) of i32 vectors a and b (values that fit in 16 bits); exact.  One
    ``vpmaddwd`` per 16 lanes with AVX2 (or VNNI)."""
    if level != "plain" and a.type.count == 16:
        v16s = ir.VectorType(ir.IntType(16), 16)
        return builder.call(_maddwd(builder), [builder.trunc(a, v16s), builder.trunc(b, v16s)])
    return pair_sums(builder, builder.mul(a, b))


_jit = njit(inline="always", **KERNEL)


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


# below this magnitude expf_v(x)'s 2**n is a normal float: expf_in_range gives its bits
EXP_RANGE = f32(86.0)


@_jit
def expf_in_range(x):
    """expf_v for |x| <= EXP_RANGE: the same steps without its branches, so that a loop of them
    vectorizes (callers check the range first and take expf_v outside it)."""
    z = fma32(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, f32(1.0)))
    return j * pow2_f32(np.int32(n))


@_jit
def silu_v(x):
    """ggml_v_silu: x / (1 + e**-x) with ggml_v_expf."""
    return x / (f32(1.0) + expf_v(f32(0.0) - x))


# -- calling a compiled C function by its address: no copy of its code in the caller --------------
# numba links a callee's code into every library that calls it and optimizes and compiles it
# again there (a parallel loop's body: twice); a cfunc called through its address is compiled once.

@intrinsic
def address(typingctx, arr):
    """The address of an array's first element, as intp."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))
    return types.intp(arr), codegen


@intrinsic
def pointer(typingctx, at, dtype):
    """An address (intp) as a pointer to ``dtype`` (a numpy scalar type), for numba.carray."""
    target = dtype.instance_type

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_data_type(target).as_pointer())
    return types.CPointer(target)(at, dtype), codegen


@intrinsic
def call_address(typingctx, at, args):
    """Call the C function ``void f(...)`` at address ``at`` with ``args`` (a tuple): integers
    as intp, floats as they are."""
    def codegen(context, builder, signature, values):
        tys = signature.args[1]
        vals = [context.cast(builder, v, t, types.intp) if isinstance(t, types.Integer) else v
                for v, t in zip(cgutils.unpack_tuple(builder, values[1], len(tys)), tys)]
        fnty = ir.FunctionType(ir.VoidType(), [v.type for v in vals])
        builder.call(builder.inttoptr(values[0], fnty.as_pointer()), vals)
        return context.get_dummy_value()
    return types.void(at, args), codegen
