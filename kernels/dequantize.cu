// Quantized rows to F16 (tiles of weights for the tensor-core matrix-matrix product through
// cuBLAS) or F32 (GET_ROWS of a quantized embedding).  One thread per part of a group (8 of
// its 32 weights), with the same part loaders as the matrix-vector product (common.cuh).
#include "common.cuh"

static __device__ __forceinline__ int byte_of(int word, int j) { return (int)(i8)((word >> (8 * j)) & 0xff); }

// rows: rows of `groups` groups, row_bytes apart in W; y: rows of 32 * groups values, y_stride apart
template <void (*load_part)(PART_ARGS), typename T>
static __device__ __forceinline__ void dequantize(const u8 *__restrict__ W, T *__restrict__ y, i64 groups, i64 rows,
                                                  i64 row_bytes, i64 y_stride) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= groups * rows * 4) return;
    const int part = (int)(i % 4);
    const i64 r = i / 4 / groups, g = i / 4 % groups;
    int lo, hi;
    float a_lo, a_hi, b;
    load_part(W + r * row_bytes, g, part, lo, hi, a_lo, a_hi, b);
    T *out = y + r * y_stride + g * QK + 4 * part;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        store(out + j, a_lo * (float)byte_of(lo, j) + b);
        store(out + 16 + j, a_hi * (float)byte_of(hi, j) + b);
    }
}

#define DEFINE_DEQUANT(TYPE, LOADER)                                                               \
    extern "C" __global__ void dequantize_##TYPE##_f16(const u8 *W, u16 *y, i64 groups, i64 rows,      \
                                                       i64 row_bytes, i64 y_stride) {              \
        dequantize<LOADER, u16>(W, y, groups, rows, row_bytes, y_stride);                          \
    }                                                                                              \
    extern "C" __global__ void dequantize_##TYPE##_f32(const u8 *W, float *y, i64 groups, i64 rows,    \
                                                       i64 row_bytes, i64 y_stride) {              \
        dequantize<LOADER, float>(W, y, groups, rows, row_bytes, y_stride);                        \
    }

FOR_EACH_WEIGHT_TYPE(DEFINE_DEQUANT)
