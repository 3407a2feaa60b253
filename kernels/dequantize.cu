// Quantized rows to F16 (tiles of weights for the tensor-core matrix-matrix product through
// cuBLAS) or F32, and GET_ROWS of quantized rows (an embedding).  One thread per part of a
// group (8 of its 32 weights), with the same part loaders as the matrix-vector product.
#include "common.cuh"

static __device__ __forceinline__ int byte_of(int word, int j) { return (int)(i8)((word >> (8 * j)) & 0xff); }

// part `part` of group g of one quantized row, as 8 values of y_row (a row of 32 * groups values)
template <void (*load_part)(PART_ARGS), typename T>
static __device__ __forceinline__ void dequantize_part(const u8 *row, i64 g, int part, T *y_row) {
    int lo, hi;
    float a_lo, a_hi, b;
    load_part(row, g, part, lo, hi, a_lo, a_hi, b);
    T *out = y_row + g * QK + 4 * part;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        store(out + j, a_lo * (float)byte_of(lo, j) + b);
        store(out + 16 + j, a_hi * (float)byte_of(hi, j) + b);
    }
}

// rows: rows of `groups` groups, row_bytes apart in W; y: rows of 32 * groups values, y_stride apart
template <void (*load_part)(PART_ARGS), typename T>
static __device__ __forceinline__ void dequantize(const u8 *__restrict__ W, T *__restrict__ y, i64 groups, i64 rows,
                                                  i64 row_bytes, i64 y_stride) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= groups * rows * 4) return;
    const i64 r = i / 4 / groups;
    dequantize_part<load_part>(W + r * row_bytes, i / 4 % groups, (int)(i % 4), y + r * y_stride);
}

// GET_ROWS of quantized rows (an embedding): y[i12, i11, i10] = row ids[i12, i11, i10] of
// W[i12, i11] as F32 (rows wb1 bytes apart, batches wb2, wb3; a_rows rows), as rows.cu's get_rows
template <void (*load_part)(PART_ARGS)>
static __device__ __forceinline__ void get_rows_q(const u8 *W, const int *ids, float *y, int *error, i64 groups,
                                                  i64 n10, i64 n11, i64 nrows, i64 wb1, i64 wb2, i64 wb3, i64 is0,
                                                  i64 is1, i64 is2, i64 ys1, i64 ys2, i64 ys3, i64 a_rows) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= groups * nrows * 4) return;
    const i64 r = i / 4 / groups, i10 = r % n10, i11 = r / n10 % n11, i12 = r / (n10 * n11);
    const i64 row = ids[i10 * is0 + i11 * is1 + i12 * is2];
    if (row < 0 || row >= a_rows) {
        *error = ERROR_GET_ROWS_INDEX;
        return;
    }
    dequantize_part<load_part>(W + row * wb1 + i11 * wb2 + i12 * wb3, i / 4 % groups, (int)(i % 4),
                               y + i10 * ys1 + i11 * ys2 + i12 * ys3);
}

#define DEFINE_DEQUANT(TYPE, LOADER)                                                               \
    extern "C" __global__ void dequantize_##TYPE##_f16(const u8 *W, u16 *y, i64 groups, i64 rows,      \
                                                       i64 row_bytes, i64 y_stride) {              \
        dequantize<LOADER, u16>(W, y, groups, rows, row_bytes, y_stride);                          \
    }                                                                                              \
    extern "C" __global__ void dequantize_##TYPE##_f32(const u8 *W, float *y, i64 groups, i64 rows,    \
                                                       i64 row_bytes, i64 y_stride) {              \
        dequantize<LOADER, float>(W, y, groups, rows, row_bytes, y_stride);                        \
    }                                                                                              \
    extern "C" __global__ void get_rows_##TYPE(const u8 *W, const int *ids, float *y, int *error, i64 groups, \
                                               i64 n10, i64 n11, i64 nrows, i64 wb1, i64 wb2, i64 wb3,   \
                                               i64 is0, i64 is1, i64 is2, i64 ys1, i64 ys2, i64 ys3,     \
                                               i64 a_rows) {                                       \
        get_rows_q<LOADER>(W, ids, y, error, groups, n10, n11, nrows, wb1, wb2, wb3, is0, is1, is2, ys1, ys2, ys3, \
                           a_rows);                                                                \
    }

FOR_EACH_WEIGHT_TYPE(DEFINE_DEQUANT)
