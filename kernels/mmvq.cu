// Quantized matrix-vector products: dst[c, r] = sum_k W[r, k] * x[c, k] for a few columns c.
//
// The activations x arrive quantized to q8_1 blocks ({f16 d; f16 s = d * sum(q); i8 q[32]},
// see quantize.cu); the weights are read as stored in the GGUF.  Each group of 32 weights is
// turned into 8 ints of 4 signed bytes and multiplied with the activation's ints by __dp4a, so
// the inner loop is integer work; the group's affine map (value = a * w + b) is applied once:
//     sum_i (a w_i + b) (dx q_i) = a dx sum_i w_i q_i + b s
// One warp per weight row: the lanes take the row's groups in turn (lane, lane + 32, ...), each
// weight byte is read once per launch, and a warp reduction sums the lanes.  All columns
// (tokens, at most MMVQ_MAX_COLS) are done in the same pass over the row.
#include "common.cuh"

#define MMVQ_MAX_COLS 8
#define ROWS_PER_BLOCK 4   // warps per thread block

static __device__ __forceinline__ int dot8(const int *w, const int *q) {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) s = __dp4a(w[k], q[k], s);
    return s;
}

static __device__ __forceinline__ void load_q8_1(const u8 *blk, int *q, float &d, float &s) {
    d = load_f16(blk);
    s = load_f16(blk + 2);
    const int *qi = (const int *)(blk + 4);  // q8_1 blocks are 36 bytes: 4-byte aligned
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = qi[k];
}

#define Q8_1_BYTES 36

// groups: number of 32-element groups per row; row_bytes: stride between weight rows;
// x: ncols columns of q8_1 blocks, x_stride bytes apart; dst: ncols columns of nrows floats.
#define DEFINE_MMVQ(NAME, LOADER)                                                                  \
extern "C" __global__ void NAME(const u8 *__restrict__ W, const u8 *__restrict__ x,                \
                                float *__restrict__ dst, int groups, int nrows, i64 row_bytes,     \
                                int ncols, i64 x_stride, i64 dst_stride) {                         \
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;                                    \
    if (row >= nrows) return;                                                                     \
    const u8 *wrow = W + row * row_bytes;                                                         \
    float acc[MMVQ_MAX_COLS];                                                                     \
    _Pragma("unroll") for (int c = 0; c < MMVQ_MAX_COLS; ++c) acc[c] = 0.0f;                      \
    for (int g = threadIdx.x; g < groups; g += WARP_SIZE) {                                       \
        int w[8];                                                                                 \
        float a, b;                                                                               \
        LOADER(wrow, g, w, a, b);                                                                 \
        _Pragma("unroll") for (int c = 0; c < MMVQ_MAX_COLS; ++c) {                               \
            if (c < ncols) {                                                                      \
                int q[8];                                                                         \
                float dx, sx;                                                                     \
                load_q8_1(x + c * x_stride + (i64)g * Q8_1_BYTES, q, dx, sx);                     \
                acc[c] += a * dx * (float)dot8(w, q) + b * sx;                                    \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("unroll") for (int c = 0; c < MMVQ_MAX_COLS; ++c) {                                   \
        if (c < ncols) {                                                                          \
            const float v = warp_reduce_sum(acc[c]);                                              \
            if (threadIdx.x == 0) dst[c * dst_stride + row] = v;                                  \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_MMVQ(mul_mat_vec_q4_0, load_group_q4_0)
DEFINE_MMVQ(mul_mat_vec_q4_1, load_group_q4_1)
DEFINE_MMVQ(mul_mat_vec_q5_0, load_group_q5_0)
DEFINE_MMVQ(mul_mat_vec_q5_1, load_group_q5_1)
DEFINE_MMVQ(mul_mat_vec_q8_0, load_group_q8_0)
DEFINE_MMVQ(mul_mat_vec_q4_k, load_group_q4_k)
DEFINE_MMVQ(mul_mat_vec_q5_k, load_group_q5_k)

// Q6_K: two scales per group of 32 (one per 16 elements), so two partial integer dots
extern "C" __global__ void mul_mat_vec_q6_k(const u8 *__restrict__ W, const u8 *__restrict__ x,
                                            float *__restrict__ dst, int groups, int nrows, i64 row_bytes,
                                            int ncols, i64 x_stride, i64 dst_stride) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= nrows) return;
    const u8 *wrow = W + row * row_bytes;
    float acc[MMVQ_MAX_COLS];
#pragma unroll
    for (int c = 0; c < MMVQ_MAX_COLS; ++c) acc[c] = 0.0f;
    for (int g = threadIdx.x; g < groups; g += WARP_SIZE) {
        int w[8], sc[2];
        float d;
        load_group_q6_k(wrow, g, w, d, sc);
#pragma unroll
        for (int c = 0; c < MMVQ_MAX_COLS; ++c) {
            if (c < ncols) {
                int q[8];
                float dx, sx;
                load_q8_1(x + c * x_stride + (i64)g * Q8_1_BYTES, q, dx, sx);
                int lo = 0, hi = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    lo = __dp4a(w[k], q[k], lo);
                    hi = __dp4a(w[k + 4], q[k + 4], hi);
                }
                acc[c] += d * dx * (float)(sc[0] * lo + sc[1] * hi);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < MMVQ_MAX_COLS; ++c) {
        if (c < ncols) {
            const float v = warp_reduce_sum(acc[c]);
            if (threadIdx.x == 0) dst[c * dst_stride + row] = v;
        }
    }
}
