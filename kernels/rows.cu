// SET_ROWS: rows of x written into rows of y chosen by ids (the KV cache update), converted to
// F16 or kept F32; GET_ROWS of F32 or F16 rows (quantized ones: dequantize.cu).  One thread per
// element.  An index out of range sets *error (common.cuh) for the host to report.
#include "common.cuh"

// x: rows of ne0 (ne1 x ne2 x ne3); ids[i3 / r3, i2 / r2, i1] (strides is1 along i1, is2, is3)
// is the row of y[i3, i2] that x's row (i1, i2, i3) goes to; y has y_rows rows per (i2, i3)
template <typename T>
static __device__ __forceinline__ void set_rows(const float *x, const int *ids, T *y, int *error, int ne0, i64 ne1,
                                                i64 ne2, i64 nrows, i64 xs1, i64 xs2, i64 xs3, i64 is1, i64 is2,
                                                i64 is3, i64 r2, i64 r3, i64 ys1, i64 ys2, i64 ys3, i64 y_rows) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nrows * ne0) return;
    const i64 r = t / ne0, i = t % ne0, i1 = r % ne1, i2 = r / ne1 % ne2, i3 = r / (ne1 * ne2);
    const i64 row = ids[i1 * is1 + (i2 / r2) * is2 + (i3 / r3) * is3];
    if (row < 0 || row >= y_rows) {
        *error = ERROR_SET_ROWS_INDEX;
        return;
    }
    store(y + row * ys1 + i2 * ys2 + i3 * ys3 + i, x[i1 * xs1 + i2 * xs2 + i3 * xs3 + i]);
}

#define DEFINE_SET_ROWS(NAME, T)                                                                   \
    extern "C" __global__ void NAME(const float *x, const int *ids, T *y, int *error, int ne0, i64 ne1, i64 ne2, \
                                    i64 nrows, i64 xs1, i64 xs2, i64 xs3, i64 is1, i64 is2, i64 is3, i64 r2,  \
                                    i64 r3, i64 ys1, i64 ys2, i64 ys3, i64 y_rows) {                 \
        set_rows<T>(x, ids, y, error, ne0, ne1, ne2, nrows, xs1, xs2, xs3, is1, is2, is3, r2, r3, ys1, ys2, ys3, \
                    y_rows);                                                                       \
    }

DEFINE_SET_ROWS(set_rows_f16, u16)
DEFINE_SET_ROWS(set_rows_f32, float)

// GET_ROWS: y[i12, i11, i10] = row ids[i12, i11, i10] of a[i12, i11] (ne0 values, F32 or F16),
// as F32.  ids has strides is0, is1, is2; a has a_rows rows per (i11, i12), strides as1, as2, as3.
template <typename T>
static __device__ __forceinline__ void get_rows(const T *a, const int *ids, float *y, int *error, int ne0, i64 n10,
                                                i64 n11, i64 nrows, i64 as1, i64 as2, i64 as3, i64 is0, i64 is1,
                                                i64 is2, i64 ys1, i64 ys2, i64 ys3, i64 a_rows) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nrows * ne0) return;
    const i64 r = t / ne0, i = t % ne0, i10 = r % n10, i11 = r / n10 % n11, i12 = r / (n10 * n11);
    const i64 row = ids[i10 * is0 + i11 * is1 + i12 * is2];
    if (row < 0 || row >= a_rows) {
        *error = ERROR_GET_ROWS_INDEX;
        return;
    }
    y[i10 * ys1 + i11 * ys2 + i12 * ys3 + i] = to_f32(a[row * as1 + i11 * as2 + i12 * as3 + i]);
}

#define DEFINE_GET_ROWS(NAME, T)                                                                   \
    extern "C" __global__ void NAME(const T *a, const int *ids, float *y, int *error, int ne0, i64 n10, i64 n11, \
                                    i64 nrows, i64 as1, i64 as2, i64 as3, i64 is0, i64 is1, i64 is2, i64 ys1,  \
                                    i64 ys2, i64 ys3, i64 a_rows) {                                \
        get_rows<T>(a, ids, y, error, ne0, n10, n11, nrows, as1, as2, as3, is0, is1, is2, ys1, ys2, ys3, a_rows); \
    }

DEFINE_GET_ROWS(get_rows_f32, float)
DEFINE_GET_ROWS(get_rows_f16, u16)
