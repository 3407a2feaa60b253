// Shared helpers for pyggml's CUDA kernels (compiled at run time by CuPy's RawModule / NVRTC,
// and by nvcc in the test that checks every source for sm_80 and sm_90).
// No headers at all, not even cuda_fp16.h: NVRTC finds none unless a CUDA toolkit is
// installed, so the integer types are our own and half floats are converted with PTX.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// the format decoders run on the host too: a test compiles them into a host library and checks
// them against pyggml's CPU formats, which no GPU is needed for
#define HD static __host__ __device__ __forceinline__

#define WARP_SIZE 32
#define QK 32          // elements per group: the block of the legacy quants, a sub-block of the k-quants
#define QK_K 256       // elements per k-quant super-block

static __device__ __forceinline__ float warp_reduce_sum(float x) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, offset, WARP_SIZE);
    }
    return x;
}

static __device__ __forceinline__ float warp_reduce_max(float x) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset, WARP_SIZE));
    }
    return x;
}

// little-endian loads from byte addresses without alignment assumptions (blocks are 18, 20,
// 22 ... bytes long, so their fields are only 2-byte aligned)
HD float half_to_float(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else  // the host build of the decoders (tests): IEEE binary16 by hand
    const u32 sign = (u32)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    u32 bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int e = -1;
        u32 m = man;
        do { ++e; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((u32)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    union { u32 u; float f; } v;
    v.u = bits;
    return v.f;
#endif
}

HD u16 float_to_half(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else  // host builds (tests, the CPU emulator of the kernels): round to nearest even by hand
    union { float f; u32 u; } v;
    v.f = f;
    const u32 sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (u16)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));  // inf, nan
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // 65520 and up round to infinity
    u32 m, shift;
    if (a >= 0x38800000u) {  // a normal half: rebias the exponent, keep 10 of 23 mantissa bits
        m = a - 0x38000000u;
        shift = 13;
    } else {  // a subnormal half (or zero): the value in units of 2^-24
        m = (a & 0x7fffffu) | 0x800000u;
        shift = 126 - (a >> 23);
        if (shift > 24) return (u16)sign;
    }
    u32 h = m >> shift;
    const u32 rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;  // a carry into the exponent is still right
    return (u16)(sign | h);
#endif
}

HD float load_f16(const u8 *p) {
    return half_to_float((u16)p[0] | ((u16)p[1] << 8));
}

HD u32 load_u32(const u8 *p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// four signed bytes packed into an int, for __dp4a
HD int pack_i8x4(int a, int b, int c, int d) {
    return (a & 0xff) | ((b & 0xff) << 8) | ((c & 0xff) << 16) | ((int)((u32)d << 24));
}

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4)
HD void scale_min_k4(int j, const u8 *q, int &sc, int &mn) {
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One group of 32 weights as 8 ints of 4 signed bytes each, with the affine map back to
// values: value_i = a * w_i + b.  Every weight type provides load_group_<type>(row, g, w, a, b)
// for group g of a row, so the matrix-vector product and dequantization share one definition
// of each format.

// Q4_0: {f16 d; u8 qs[16]}; element i < 16 is qs[i] & 15, element i + 16 is qs[i] >> 4; value d * (q - 8)
HD void load_group_q4_0(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + g * 18;
    a = load_f16(blk);
    b = 0.0f;
    const u8 *qs = blk + 2;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 v = load_u32(qs + 4 * k);
        w[k] = pack_i8x4((v & 15) - 8, ((v >> 8) & 15) - 8, ((v >> 16) & 15) - 8, ((v >> 24) & 15) - 8);
        w[k + 4] = pack_i8x4(((v >> 4) & 15) - 8, ((v >> 12) & 15) - 8, ((v >> 20) & 15) - 8, ((v >> 28) & 15) - 8);
    }
}

// Q4_1: {f16 d; f16 m; u8 qs[16]}; value d * q + m
HD void load_group_q4_1(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + g * 20;
    a = load_f16(blk);
    b = load_f16(blk + 2);
    const u8 *qs = blk + 4;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 v = load_u32(qs + 4 * k);
        w[k] = (int)(v & 0x0F0F0F0Fu);
        w[k + 4] = (int)((v >> 4) & 0x0F0F0F0Fu);
    }
}

// the 32 five-bit values of a Q5 block (low nibbles in qs, fifth bits in qh), minus `zero`
HD void unpack_q5(const u8 *qs, u32 qh, int zero, int *w) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int lo[4], hi[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = 4 * k + j;
            lo[j] = ((qs[i] & 15) | (((qh >> i) & 1) << 4)) - zero;
            hi[j] = ((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - zero;
        }
        w[k] = pack_i8x4(lo[0], lo[1], lo[2], lo[3]);
        w[k + 4] = pack_i8x4(hi[0], hi[1], hi[2], hi[3]);
    }
}

// Q5_0: {f16 d; u32 qh; u8 qs[16]}; bit i of qh is the fifth bit of element i; value d * (q - 16)
HD void load_group_q5_0(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + g * 22;
    a = load_f16(blk);
    b = 0.0f;
    unpack_q5(blk + 6, load_u32(blk + 2), 16, w);
}

// Q5_1: {f16 d; f16 m; u32 qh; u8 qs[16]}; value d * q + m
HD void load_group_q5_1(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + g * 24;
    a = load_f16(blk);
    b = load_f16(blk + 2);
    unpack_q5(blk + 8, load_u32(blk + 4), 0, w);
}

// Q8_0: {f16 d; i8 qs[32]}; value d * q
HD void load_group_q8_0(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + g * 34;
    a = load_f16(blk);
    b = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        w[k] = (int)load_u32(blk + 2 + 4 * k);
    }
}

// the affine map of sub-block s of a Q4_K / Q5_K super-block: value d*sc*q - dmin*mn
HD void k4_affine(const u8 *blk, int s, float &a, float &b) {
    int sc, mn;
    scale_min_k4(s, blk + 4, sc, mn);
    a = load_f16(blk) * (float)sc;
    b = -load_f16(blk + 2) * (float)mn;
}

// Q4_K: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}; sub-block s (32 elements) takes the low
// nibbles of qs[32*(s/2) ...] for even s, the high ones for odd s
HD void load_group_q4_k(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + (g / 8) * 144;
    const int s = (int)(g % 8);
    k4_affine(blk, s, a, b);
    const u8 *qs = blk + 16 + (s / 2) * 32;
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        w[k] = (int)((load_u32(qs + 4 * k) >> shift) & 0x0F0F0F0Fu);
    }
}

// Q5_K: {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}; as Q4_K plus bit s of qh[l]
HD void load_group_q5_k(const u8 *row, i64 g, int *w, float &a, float &b) {
    const u8 *blk = row + (g / 8) * 176;
    const int s = (int)(g % 8);
    k4_affine(blk, s, a, b);
    const u8 *qh = blk + 16;
    const u8 *qs = blk + 48 + (s / 2) * 32;
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int l = 4 * k + j;
            v[j] = ((qs[l] >> shift) & 15) | (((qh[l] >> s) & 1) << 4);
        }
        w[k] = pack_i8x4(v[0], v[1], v[2], v[3]);
    }
}

// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}; a super-block is two halves of 128;
// plane p (32 elements) of half h: low nibble of ql[64h + 32(p%2) + l] (high nibble for p >= 2),
// two bits (2p) of qh[32h + l], scale scales[8h + 2p + l/16]; value d * sc * (q - 32).
// Scales change every 16 elements, so there is no single affine map per group: w holds q - 32,
// d the super-block scale, and sc2 the scales of the group's two halves.
HD void load_group_q6_k(const u8 *row, i64 g, int *w, float &d, int *sc2) {
    const u8 *blk = row + (g / 8) * 210;
    const int s = (int)(g % 8);
    const int h = s / 4, p = s % 4;
    const u8 *ql = blk + 64 * h + 32 * (p % 2);
    const u8 *qh = blk + 128 + 32 * h;
    const i8 *scales = (const i8 *)(blk + 192 + 8 * h + 2 * p);
    const int shift = 4 * (p / 2);
    d = load_f16(blk + 208);
    sc2[0] = scales[0];
    sc2[1] = scales[1];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int l = 4 * k + j;
            v[j] = (((ql[l] >> shift) & 15) | (((qh[l] >> (2 * p)) & 3) << 4)) - 32;
        }
        w[k] = pack_i8x4(v[0], v[1], v[2], v[3]);
    }
}
