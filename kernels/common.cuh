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

// host and device: the CUDA emulator (tests/cuda/) builds the kernels as host C++
#define HD static __host__ __device__ __forceinline__

#define WARP_SIZE 32
#define QK 32          // elements per group: the block of the legacy quants, a sub-block of the k-quants
#define QK_K 256       // elements per k-quant super-block
#define NEG_INFINITY __int_as_float(0xff800000)

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

// a value stored as F32, or as F16 bits, and read back as F32
static __device__ __forceinline__ void store(float *y, float v) { *y = v; }
static __device__ __forceinline__ void store(u16 *y, float v) { *y = float_to_half(v); }
HD float to_f32(float v) { return v; }
HD float to_f32(u16 h) { return half_to_float(h); }

// What a kernel writes into the graph's error flag (pyggml/cuda/kernels.py check_errors names it):
// indices come from the graph's data (over RPC, from the network), so one out of range is
// reported, and the row it names is neither read nor written.
#define ERROR_SET_ROWS_INDEX 1
#define ERROR_GET_ROWS_INDEX 2
#define ERROR_MUL_MAT_ID_INDEX 3
#define ERROR_ADD_ID_INDEX 4

// a sum or maximum over a thread block (blockDim.x a multiple of 32); every thread gets it
static __device__ __forceinline__ float block_reduce(float x, bool is_max) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    x = is_max ? warp_reduce_max(x) : warp_reduce_sum(x);
    __syncthreads();  // the previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    const float none = is_max ? NEG_INFINITY : 0.0f;
    x = lane < (int)(blockDim.x / WARP_SIZE) ? partial[lane] : none;
    return is_max ? warp_reduce_max(x) : warp_reduce_sum(x);
}

static __device__ __forceinline__ float block_reduce_sum(float x) { return block_reduce(x, false); }
static __device__ __forceinline__ float block_reduce_max(float x) { return block_reduce(x, true); }

// MUL_MAT_ID's matrix-vector launches (mmvq.cu, mmv.cu) run a row of blocks per (token t, slot
// e) pair, grid y = t * n_used + e: the pair's expert, ids[e * is0 + t * is1], or -1 for an id
// outside [0, n_expert) - reported through *error, and the block then reads no weight (all of
// its threads read the same id, so the whole block returns together)
static __device__ __forceinline__ int pair_expert(const int *ids, int *error, int n_expert, int n_used, i64 is0,
                                                  i64 is1, int &t, int &e) {
    t = blockIdx.y / n_used;
    e = blockIdx.y % n_used;
    const int expert = ids[e * is0 + t * is1];
    if (expert >= 0 && expert < n_expert) return expert;
    if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) *error = ERROR_MUL_MAT_ID_INDEX;
    return -1;
}

// The end of a matrix-vector product by a thread block of WARPS warps on one row (mmvq.cu,
// mmv.cu): warps 1.. hand their lanes' column sums to warp 0 through shared memory, which
// reduces them all with one set of shuffles (as llama.cpp's mmvq does) and writes each
// column's sum to dst[c * dst_stride + row].  Every thread of the block calls it.
template <int WARPS, int MAX_COLS>
static __device__ __forceinline__ void block_rows_store(const float (&acc)[MAX_COLS], int ncols, float *dst,
                                                        i64 dst_stride, int row) {
    __shared__ float partial[WARPS - 1][MAX_COLS][WARP_SIZE];
    if (threadIdx.y > 0) {
#pragma unroll
        for (int c = 0; c < MAX_COLS; ++c) partial[threadIdx.y - 1][c][threadIdx.x] = acc[c];
    }
    __syncthreads();
    if (threadIdx.y > 0) return;
#pragma unroll
    for (int c = 0; c < MAX_COLS; ++c) {
        if (c < ncols) {
            float v = acc[c];
#pragma unroll
            for (int w = 0; w < WARPS - 1; ++w) v += partial[w][c][threadIdx.x];
            v = warp_reduce_sum(v);
            if (threadIdx.x == 0) dst[c * dst_stride + row] = v;
        }
    }
}

// The end of a softmax over row[0..n) by a thread block whose threads wrote the scores at
// j = threadIdx.x, threadIdx.x + blockDim.x, ... and kept their maximum: exp(s - max) / sum, in place.
static __device__ __forceinline__ void block_softmax_finish(float *row, int n, float local_max) {
    const float mx = block_reduce_max(local_max);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    const float inv = 1.0f / block_reduce_sum(sum);
    for (int j = threadIdx.x; j < n; j += blockDim.x) row[j] *= inv;
}

// block_softmax_finish with an attention sink: ``sink`` counts in the maximum and the sum (its
// own exp), and has no output of its own
static __device__ __forceinline__ void block_softmax_finish_sink(float *row, int n, float local_max, float sink) {
    const float mx = fmaxf(block_reduce_max(local_max), sink);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    const float inv = 1.0f / (block_reduce_sum(sum) + expf(sink - mx));
    for (int j = threadIdx.x; j < n; j += blockDim.x) row[j] *= inv;
}

// The ops' kernels see a tensor as rows of ne0 contiguous elements; row r of ne1 x ne2 x ne3
// rows starts at i1*s1 + i2*s2 + i3*s3 elements (any strides: views work as they are).
HD i64 row_start(i64 r, i64 ne1, i64 ne2, i64 s1, i64 s2, i64 s3) {
    return (r % ne1) * s1 + (r / ne1 % ne2) * s2 + (r / (ne1 * ne2)) * s3;
}

// Loads of little-endian fields.  Blocks are 18, 20, 22 ... bytes long, so a field is only
// known to be 2-byte aligned: 32-bit values are read as two 16-bit halves (a misaligned load
// is a fatal error on a GPU; the emulator's builds trap on one, PYGGML_CHECK_ALIGNMENT).
HD u16 load_u16(const u8 *p) {
#if !defined(__CUDA_ARCH__) && defined(PYGGML_CHECK_ALIGNMENT)
    if ((unsigned long long)p & 1) __builtin_trap();
#endif
    return *(const u16 *)p;
}

HD float load_f16(const u8 *p) { return half_to_float(load_u16(p)); }

HD u32 load_u32(const u8 *p) { return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16); }

HD int load_i32_aligned(const u8 *p) {  // a field known to be 4-byte aligned (q8_1 quants)
#if !defined(__CUDA_ARCH__) && defined(PYGGML_CHECK_ALIGNMENT)
    if ((unsigned long long)p & 3) __builtin_trap();
#endif
    return *(const int *)p;
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

// The weight formats.  A group is 32 weights (a block of the legacy quants, a sub-block of the
// k-quants) seen as 8 ints of 4 signed bytes, int k holding elements 4k..4k+3.  A group is read
// in 4 parts: part p is ints p and p + 4 (elements 4p..4p+3 and 16+4p..16+4p+3), so that four
// lanes share a group and their loads of its bytes are adjacent.  Every format provides
//     load_part_<type>(row, g, p, lo, hi, a_lo, a_hi, b)
// for part p of group g of a row: the two ints, and the affine maps back to values,
// value = a_lo * w + b for the bytes of lo and a_hi * w + b for those of hi (the two scales
// differ only for Q6_K, whose scales change every 16 elements).  The matrix-vector product and
// dequantization share these, so each format is defined once.

#define PART_ARGS const u8 *row, i64 g, int p, int &lo, int &hi, float &a_lo, float &a_hi, float &b

HD int nibbles_minus(u32 v, int shift, int zero) {  // bytes ((v >> shift) & 15) - zero
    return pack_i8x4(((v >> shift) & 15) - zero, ((v >> (shift + 8)) & 15) - zero, ((v >> (shift + 16)) & 15) - zero,
                     ((v >> (shift + 24)) & 15) - zero);
}

// Q4_0: {f16 d; u8 qs[16]}; element i < 16 is qs[i] & 15, element i + 16 is qs[i] >> 4; value d * (q - 8)
HD void load_part_q4_0(PART_ARGS) {
    const u8 *blk = row + g * 18;
    const u32 v = load_u32(blk + 2 + 4 * p);
    lo = nibbles_minus(v, 0, 8);
    hi = nibbles_minus(v, 4, 8);
    a_lo = a_hi = load_f16(blk);
    b = 0.0f;
}

// Q4_1: {f16 d; f16 m; u8 qs[16]}; value d * q + m
HD void load_part_q4_1(PART_ARGS) {
    const u8 *blk = row + g * 20;
    const u32 v = load_u32(blk + 4 + 4 * p);
    lo = (int)(v & 0x0F0F0F0Fu);
    hi = (int)((v >> 4) & 0x0F0F0F0Fu);
    a_lo = a_hi = load_f16(blk);
    b = load_f16(blk + 2);
}

// part p of a Q5 block's 32 five-bit values (low nibbles in qs, fifth bits in qh), minus `zero`
HD void unpack_q5_part(const u8 *qs, u32 qh, int p, int zero, int &lo, int &hi) {
    const u32 v = load_u32(qs + 4 * p);
    int l[4], h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = 4 * p + j;
        l[j] = (((v >> (8 * j)) & 15) | (((qh >> i) & 1) << 4)) - zero;
        h[j] = (((v >> (8 * j + 4)) & 15) | (((qh >> (i + 16)) & 1) << 4)) - zero;
    }
    lo = pack_i8x4(l[0], l[1], l[2], l[3]);
    hi = pack_i8x4(h[0], h[1], h[2], h[3]);
}

// Q5_0: {f16 d; u32 qh; u8 qs[16]}; bit i of qh is the fifth bit of element i; value d * (q - 16)
HD void load_part_q5_0(PART_ARGS) {
    const u8 *blk = row + g * 22;
    unpack_q5_part(blk + 6, load_u32(blk + 2), p, 16, lo, hi);
    a_lo = a_hi = load_f16(blk);
    b = 0.0f;
}

// Q5_1: {f16 d; f16 m; u32 qh; u8 qs[16]}; value d * q + m
HD void load_part_q5_1(PART_ARGS) {
    const u8 *blk = row + g * 24;
    unpack_q5_part(blk + 8, load_u32(blk + 4), p, 0, lo, hi);
    a_lo = a_hi = load_f16(blk);
    b = load_f16(blk + 2);
}

// Q8_0: {f16 d; i8 qs[32]}; value d * q
HD void load_part_q8_0(PART_ARGS) {
    const u8 *blk = row + g * 34;
    lo = (int)load_u32(blk + 2 + 4 * p);
    hi = (int)load_u32(blk + 18 + 4 * p);
    a_lo = a_hi = load_f16(blk);
    b = 0.0f;
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
HD void load_part_q4_k(PART_ARGS) {
    const u8 *blk = row + (g / 8) * 144;
    const int s = (int)(g % 8), shift = 4 * (s & 1);
    const u8 *qs = blk + 16 + (s / 2) * 32;
    lo = (int)((load_u32(qs + 4 * p) >> shift) & 0x0F0F0F0Fu);
    hi = (int)((load_u32(qs + 16 + 4 * p) >> shift) & 0x0F0F0F0Fu);
    k4_affine(blk, s, a_lo, b);
    a_hi = a_lo;
}

// Q5_K: {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}; as Q4_K plus bit s of qh[l]
HD int q5_k_bytes(u32 qs, u32 qh, int shift, int s) {
    return pack_i8x4(((qs >> shift) & 15) | (((qh >> s) & 1) << 4), ((qs >> (shift + 8)) & 15) | (((qh >> (s + 8)) & 1) << 4),
                     ((qs >> (shift + 16)) & 15) | (((qh >> (s + 16)) & 1) << 4),
                     ((qs >> (shift + 24)) & 15) | (((qh >> (s + 24)) & 1) << 4));
}

HD void load_part_q5_k(PART_ARGS) {
    const u8 *blk = row + (g / 8) * 176;
    const int s = (int)(g % 8), shift = 4 * (s & 1);
    const u8 *qh = blk + 16, *qs = blk + 48 + (s / 2) * 32;
    lo = q5_k_bytes(load_u32(qs + 4 * p), load_u32(qh + 4 * p), shift, s);
    hi = q5_k_bytes(load_u32(qs + 16 + 4 * p), load_u32(qh + 16 + 4 * p), shift, s);
    k4_affine(blk, s, a_lo, b);
    a_hi = a_lo;
}

// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}; a super-block is two halves of 128;
// plane n (32 elements) of half h: low nibble of ql[64h + 32(n%2) + l] (high nibble for n >= 2),
// two bits (2n) of qh[32h + l], scale scales[8h + 2n + l/16]; value d * sc * (q - 32)
HD int q6_k_bytes(u32 ql, u32 qh, int shift, int n) {
    return pack_i8x4((((ql >> shift) & 15) | (((qh >> (2 * n)) & 3) << 4)) - 32,
                     (((ql >> (shift + 8)) & 15) | (((qh >> (2 * n + 8)) & 3) << 4)) - 32,
                     (((ql >> (shift + 16)) & 15) | (((qh >> (2 * n + 16)) & 3) << 4)) - 32,
                     (((ql >> (shift + 24)) & 15) | (((qh >> (2 * n + 24)) & 3) << 4)) - 32);
}

HD void load_part_q6_k(PART_ARGS) {
    const u8 *blk = row + (g / 8) * 210;
    const int s = (int)(g % 8), h = s / 4, n = s % 4, shift = 4 * (n / 2);
    const u8 *ql = blk + 64 * h + 32 * (n % 2), *qh = blk + 128 + 32 * h;
    lo = q6_k_bytes(load_u32(ql + 4 * p), load_u32(qh + 4 * p), shift, n);
    hi = q6_k_bytes(load_u32(ql + 16 + 4 * p), load_u32(qh + 16 + 4 * p), shift, n);
    const i8 *scales = (const i8 *)(blk + 192 + 8 * h + 2 * n);
    const float d = load_f16(blk + 208);
    a_lo = d * (float)scales[0];
    a_hi = d * (float)scales[1];
    b = 0.0f;
}

// MXFP4 (gpt-oss): {u8 e; u8 qs[16]}, 17 bytes, so only byte loads are safe.  Element i < 16
// is nibble qs[i] & 15, element i + 16 is qs[i] >> 4; a nibble is an E2M1 value, doubled to an
// integer (ggml's kvalues_mxfp4: 0 1 2 3 4 6 8 12, the high bit its sign), and the scale is
// the E8M0 exponent halved to match, 2^(e - 128) (ggml_e8m0_to_fp32_half)
HD u32 load_u32_bytes(const u8 *p) { return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24); }

// CUDA's __byte_perm: byte n of the result is byte (s >> 4n) & 7 of the eight bytes y:x
HD u32 byte_perm(u32 x, u32 y, u32 s) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const unsigned long long xy = (unsigned long long)y << 32 | x;
    u32 r = 0;
    for (int n = 0; n < 4; ++n) r |= (u32)((xy >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
#endif
}

// the 4-bit codes in the low nibbles of x's four bytes, looked up in a table of 16 bytes (t0..t3,
// four to a word): the code's low 3 bits pick a byte of t0:t1 and of t2:t3, its high bit which
// (ggml's get_int_from_table_16, four codes at a time)
HD int table16_bytes(u32 x, u32 t0, u32 t1, u32 t2, u32 t3) {
    const u32 c = x | (x >> 4);
    const u32 s = (c & 0xff) | ((c >> 8) & 0xff00);  // code j in nibble j
    const u32 lo = byte_perm(t0, t1, s), hi = byte_perm(t2, t3, s);
    return (int)byte_perm(lo, hi, 0x3210u | ((s & 0x8888u) >> 1));
}

// the doubled E2M1 values 0 1 2 3 4 6 8 12, then their negatives (-0 is 0)
#define E2M1_TABLE 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu

HD float e8m0_half(u8 e) {
    union { u32 u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (u32)(e - 1) << 23;
    return v.f;
}

HD void load_part_mxfp4(PART_ARGS) {
    const u8 *blk = row + g * 17;
    const u32 v = load_u32_bytes(blk + 1 + 4 * p);
    lo = table16_bytes(v & 0x0F0F0F0Fu, E2M1_TABLE);
    hi = table16_bytes((v >> 4) & 0x0F0F0F0Fu, E2M1_TABLE);
    a_lo = a_hi = e8m0_half(blk[0]);
    b = 0.0f;
}

// the weight types, for kernels instantiated once per type: X(name, loader)
#define FOR_EACH_WEIGHT_TYPE(X)                                                                   \
    X(q4_0, load_part_q4_0) X(q4_1, load_part_q4_1) X(q5_0, load_part_q5_0) X(q5_1, load_part_q5_1)  \
    X(q8_0, load_part_q8_0) X(q4_k, load_part_q4_k) X(q5_k, load_part_q5_k) X(q6_k, load_part_q6_k)  \
    X(mxfp4, load_part_mxfp4)
