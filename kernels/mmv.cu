// Matrix-vector products of plain weights (F32, F16): dst[c, r] = sum_k W[r, k] * x[c, k] for a
// few columns c, in float.  A decode step's F32 and F16 matrices - the experts' router, which
// llama.cpp never quantizes, a model kept in F16 - run this instead of cuBLAS, so that the step
// stays a list of our launches that a CUDA graph can capture (replay.py).  The layout is mmvq's:
// one thread block of four warps per weight row, the row's elements spread over all of its
// threads (adjacent threads, adjacent elements: coalesced loads), the columns in the same pass.
#include "common.cuh"

#define MMV_MAX_COLS 8
#define WARPS 4

template <typename T>
static __device__ __forceinline__ void mul_mat_vec_plain(const T *__restrict__ W, const float *__restrict__ x,
                                                         float *__restrict__ dst, int ncols_w, int nrows,
                                                         i64 row_stride, int ncols, i64 x_stride, i64 dst_stride) {
    const int row = blockIdx.x;
    if (row >= nrows) return;  // the whole block
    const T *wrow = W + row * row_stride;
    float acc[MMV_MAX_COLS];
#pragma unroll
    for (int c = 0; c < MMV_MAX_COLS; ++c) acc[c] = 0.0f;
    for (int k = threadIdx.y * WARP_SIZE + threadIdx.x; k < ncols_w; k += WARPS * WARP_SIZE) {
        const float w = to_f32(wrow[k]);
#pragma unroll
        for (int c = 0; c < MMV_MAX_COLS; ++c) {
            if (c < ncols) acc[c] += w * x[c * x_stride + k];
        }
    }
    block_rows_store<WARPS, MMV_MAX_COLS>(acc, ncols, dst, dst_stride, row);
}

// W: nrows rows of ncols_w elements, row_stride elements apart; x: ncols (<= MMV_MAX_COLS) columns
// of ncols_w floats, x_stride apart; dst: ncols columns of nrows floats, dst_stride apart
extern "C" __global__ void mul_mat_vec_f32(const float *__restrict__ W, const float *__restrict__ x,
                                           float *__restrict__ dst, int ncols_w, int nrows, i64 row_stride,
                                           int ncols, i64 x_stride, i64 dst_stride) {
    mul_mat_vec_plain<float>(W, x, dst, ncols_w, nrows, row_stride, ncols, x_stride, dst_stride);
}

extern "C" __global__ void mul_mat_vec_f16(const u16 *__restrict__ W, const float *__restrict__ x,
                                           float *__restrict__ dst, int ncols_w, int nrows, i64 row_stride,
                                           int ncols, i64 x_stride, i64 dst_stride) {
    mul_mat_vec_plain<u16>(W, x, dst, ncols_w, nrows, row_stride, ncols, x_stride, dst_stride);
}

// MUL_MAT_ID of a few tokens with plain experts, as mmvq.cu's mul_mat_vec_id_* (grid y: the
// (token, slot) pairs; an expert id outside [0, n_expert) reported through *error, its rows not
// read); expert_stride, x_stride in elements; x: the pairs' columns, column t * n_b + e % n_b
#define DEFINE_MMV_ID(NAME, T)                                                                     \
    extern "C" __global__ void NAME(const T *__restrict__ W, const float *__restrict__ x, float *__restrict__ dst, \
                                    const int *ids, int *error, int ncols_w, int nrows, i64 row_stride,          \
                                    i64 expert_stride, int n_expert, int n_used, int n_b, i64 is0, i64 is1,      \
                                    i64 x_stride, i64 ds1, i64 ds2) {                              \
        int t, e;                                                                                  \
        const int expert = pair_expert(ids, error, n_expert, n_used, is0, is1, t, e);              \
        if (expert < 0) return;                                                                    \
        mul_mat_vec_plain<T>(W + expert * expert_stride, x + (i64)(t * n_b + e % n_b) * x_stride,     \
                             dst + e * ds1 + t * ds2, ncols_w, nrows, row_stride, 1, x_stride, 0);    \
    }

DEFINE_MMV_ID(mul_mat_vec_id_f32, float)
DEFINE_MMV_ID(mul_mat_vec_id_f16, u16)
