// Quantized matrix-vector products: dst[c, r] = sum_k W[r, k] * x[c, k] for a few columns c.
//
// The activations x arrive quantized to q8_1 blocks ({f16 d; f16 s; i8 q[32]}, see
// quantize.cu); the weights are read as stored in the GGUF.  Weights and activations meet as
// ints of 4 signed bytes multiplied by __dp4a, so the inner loop is integer work, and each
// group's affine map (value = a * w + b) is applied once per part:
//     sum_i (a w_i + b) (dx q_i) = dx (a sum_i w_i q_i + b sum_i q_i)
// with sum_i q_i taken from the quants too (__dp4a by 0x01010101), not from the block's F16
// s = d * sum(q), which is the sum of the block's 32 activations: past 65504 (32 of one sign
// at 2048 are enough; FFN activations reach that) it is inf in F16, and b * inf is NaN.
// One thread block of four warps per weight row, as llama.cpp's mmvq arranges it: a decode
// step's matrices have a few thousand rows, and a warp per row (with a long loop over the
// row) would leave half of the GPU's threads unused and too few loads in flight to stream
// the weights at full bandwidth.  Four lanes share a group of 32 weights (a part each: two
// of its eight ints, see common.cuh), so a warp takes 8 adjacent groups per step, the block
// 32, and their loads are adjacent too; each weight byte is read once per launch.  Shared
// memory, then one warp's shuffles, sum the lanes.  All columns (tokens, at most
// MMVQ_MAX_COLS) are done in the same pass over the row.
#include "common.cuh"

#define MMVQ_MAX_COLS 8
#define WARPS 4            // warps per thread block, all on one row
#define PARTS 4            // lanes per group
#define Q8_1_BYTES 36

// groups: number of 32-element groups per row; row_bytes: stride between weight rows;
// x: ncols columns of q8_1 blocks, x_stride bytes apart; dst: ncols columns of nrows floats.
// MAX_COLS: 1 (a decode step; fewer registers, so more warps fit on a multiprocessor) or
// MMVQ_MAX_COLS (ncols of them computed)
template <void (*load_part)(PART_ARGS), int MAX_COLS>
static __device__ __forceinline__ void mul_mat_vec(const u8 *__restrict__ W, const u8 *__restrict__ x,
                                                   float *__restrict__ dst, int groups, int nrows, i64 row_bytes,
                                                   int ncols, i64 x_stride, i64 dst_stride) {
    const int row = blockIdx.x;
    if (row >= nrows) return;  // the whole block
    const int part = threadIdx.x % PARTS;
    const u8 *wrow = W + row * row_bytes;
    float acc[MAX_COLS];
#pragma unroll
    for (int c = 0; c < MAX_COLS; ++c) acc[c] = 0.0f;
    for (int g = (threadIdx.y * WARP_SIZE + threadIdx.x) / PARTS; g < groups; g += WARPS * WARP_SIZE / PARTS) {
        int lo, hi;
        float a_lo, a_hi, b;
        load_part(wrow, g, part, lo, hi, a_lo, a_hi, b);
#pragma unroll
        for (int c = 0; c < MAX_COLS; ++c) {
            if (c < ncols) {
                const u8 *blk = x + c * x_stride + (i64)g * Q8_1_BYTES;  // 4-byte aligned
                const float dx = load_f16(blk);
                const int q_lo = load_i32_aligned(blk + 4 + 4 * part), q_hi = load_i32_aligned(blk + 20 + 4 * part);
                const int dot_lo = __dp4a(lo, q_lo, 0), dot_hi = __dp4a(hi, q_hi, 0);
                const int sum_q = __dp4a(0x01010101, q_lo, __dp4a(0x01010101, q_hi, 0));
                acc[c] += dx * (a_lo * (float)dot_lo + a_hi * (float)dot_hi + b * (float)sum_q);
            }
        }
    }
    block_rows_store<WARPS, MAX_COLS>(acc, ncols, dst, dst_stride, row);
}

#define DEFINE_MMVQ(TYPE, LOADER)                                                                  \
    extern "C" __global__ void mul_mat_vec_##TYPE(const u8 *__restrict__ W, const u8 *__restrict__ x,  \
                                                  float *__restrict__ dst, int groups, int nrows,      \
                                                  i64 row_bytes, int ncols, i64 x_stride, i64 dst_stride) { \
        mul_mat_vec<LOADER, MMVQ_MAX_COLS>(W, x, dst, groups, nrows, row_bytes, ncols, x_stride, dst_stride); \
    }                                                                                              \
    extern "C" __global__ void mul_mat_vec_##TYPE##_1(const u8 *__restrict__ W, const u8 *__restrict__ x, \
                                                      float *__restrict__ dst, int groups, int nrows,  \
                                                      i64 row_bytes, int ncols, i64 x_stride, i64 dst_stride) { \
        mul_mat_vec<LOADER, 1>(W, x, dst, groups, nrows, row_bytes, 1, x_stride, dst_stride);        \
    }

FOR_EACH_WEIGHT_TYPE(DEFINE_MMVQ)

// MUL_MAT_ID of a few tokens (a decode step's experts): dst[t, e, r] = sum_k W[ids[t, e]][r, k] *
// x[t, e % n_b, k], one launch for every (token, slot) pair (grid y: t * n_used + e), each pair
// the one-column product above on its expert's rows.  ids come from the graph (over RPC, from
// the network): an expert outside [0, n_expert) is reported through *error and its rows are
// not read.  is0/is1: the ids' strides (slot, token); x: the pairs' q8_1 columns, column
// t * n_b + e % n_b; ds1/ds2: dst's strides (slot, token) in floats.
#define DEFINE_MMVQ_ID(TYPE, LOADER)                                                               \
    extern "C" __global__ void mul_mat_vec_id_##TYPE(                                             \
        const u8 *__restrict__ W, const u8 *__restrict__ x, float *__restrict__ dst, const int *ids, int *error,  \
        int groups, int nrows, i64 row_bytes, i64 expert_bytes, int n_expert, int n_used, int n_b, i64 is0,    \
        i64 is1, i64 x_stride, i64 ds1, i64 ds2) {                                                \
        int t, e;                                                                                  \
        const int expert = pair_expert(ids, error, n_expert, n_used, is0, is1, t, e);              \
        if (expert < 0) return;                                                                    \
        mul_mat_vec<LOADER, 1>(W + expert * expert_bytes, x + (i64)(t * n_b + e % n_b) * x_stride,   \
                               dst + e * ds1 + t * ds2, groups, nrows, row_bytes, 1, x_stride, 0);   \
    }

FOR_EACH_WEIGHT_TYPE(DEFINE_MMVQ_ID)
