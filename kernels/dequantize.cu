// Quantized rows to F16 (tiles of weights for the tensor-core matrix-matrix product through
// cuBLAS) or F32 (GET_ROWS of a quantized embedding).  One thread per group of 32 weights,
// using the same group loaders as the matrix-vector product.
#include "common.cuh"

static __device__ __forceinline__ void store(float *y, float v) { *y = v; }
static __device__ __forceinline__ void store(u16 *y, float v) { *y = float_to_half(v); }  // F16 bits

template <typename T>
static __device__ __forceinline__ void store_group(T *y, const int *w, float a, float b) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = (int)(i8)((w[k] >> (8 * j)) & 0xff);
            store(y + 4 * k + j, a * (float)q + b);
        }
    }
}

// rows: rows of `groups` groups, row_bytes apart in W; y: rows of 32 * groups values, y_stride apart
#define DEFINE_DEQUANT(NAME, LOADER, T)                                                           \
extern "C" __global__ void NAME(const u8 *__restrict__ W, T *__restrict__ y, i64 groups, i64 rows,  \
                                i64 row_bytes, i64 y_stride) {                                     \
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;                                     \
    if (i >= groups * rows) return;                                                               \
    const i64 r = i / groups, g = i % groups;                                                     \
    int w[8];                                                                                     \
    float a, b;                                                                                   \
    LOADER(W + r * row_bytes, g, w, a, b);                                                        \
    store_group(y + r * y_stride + g * QK, w, a, b);                                              \
}

#define DEFINE_DEQUANT_BOTH(TYPE)                                                                 \
    DEFINE_DEQUANT(dequantize_##TYPE##_f16, load_group_##TYPE, u16)                               \
    DEFINE_DEQUANT(dequantize_##TYPE##_f32, load_group_##TYPE, float)

DEFINE_DEQUANT_BOTH(q4_0)
DEFINE_DEQUANT_BOTH(q4_1)
DEFINE_DEQUANT_BOTH(q5_0)
DEFINE_DEQUANT_BOTH(q5_1)
DEFINE_DEQUANT_BOTH(q8_0)
DEFINE_DEQUANT_BOTH(q4_k)
DEFINE_DEQUANT_BOTH(q5_k)

// Q6_K: two scales per group of 32
template <typename T>
static __device__ __forceinline__ void dequant_q6_k(const u8 *W, T *y, i64 groups, i64 rows, i64 row_bytes,
                                                    i64 y_stride) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= groups * rows) return;
    const i64 r = i / groups, g = i % groups;
    int w[8], sc[2];
    float d;
    load_group_q6_k(W + r * row_bytes, g, w, d, sc);
    T *out = y + r * y_stride + g * QK;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = (int)(i8)((w[k] >> (8 * j)) & 0xff);
            store(out + 4 * k + j, d * (float)sc[k / 4] * (float)q);
        }
    }
}

extern "C" __global__ void dequantize_q6_k_f16(const u8 *W, u16 *y, i64 groups, i64 rows, i64 row_bytes,
                                               i64 y_stride) {
    dequant_q6_k(W, y, groups, rows, row_bytes, y_stride);
}

extern "C" __global__ void dequantize_q6_k_f32(const u8 *W, float *y, i64 groups, i64 rows, i64 row_bytes,
                                               i64 y_stride) {
    dequant_q6_k(W, y, groups, rows, row_bytes, y_stride);
}
