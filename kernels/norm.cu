// RMS norm and layer norm over rows (ggml's RMS_NORM and NORM), and SUM_ROWS: one thread block
// per row.
#include "common.cuh"

// y = x / sqrt(mean(x^2) + eps), row by row, times w (ne0 floats; optional: the MUL by the norm's
// weight that follows an RMS norm, fused; the same roundings as the two ops)
extern "C" __global__ void rms_norm_f32(const float *x, const float *w, float *y, int ne0, i64 ne1, i64 ne2,
                                        i64 xs1, i64 xs2, i64 xs3, i64 ys1, i64 ys2, i64 ys3, float eps) {
    const float *xr = x + row_start(blockIdx.x, ne1, ne2, xs1, xs2, xs3);
    float *yr = y + row_start(blockIdx.x, ne1, ne2, ys1, ys2, ys3);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) sum += xr[i] * xr[i];
    const float scale = rsqrtf(block_reduce_sum(sum) / (float)ne0 + eps);
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

// y = (x - mean) / sqrt(var + eps), row by row
extern "C" __global__ void norm_f32(const float *x, float *y, int ne0, i64 ne1, i64 ne2, i64 xs1, i64 xs2, i64 xs3,
                                    i64 ys1, i64 ys2, i64 ys3, float eps) {
    const float *xr = x + row_start(blockIdx.x, ne1, ne2, xs1, xs2, xs3);
    float *yr = y + row_start(blockIdx.x, ne1, ne2, ys1, ys2, ys3);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) sum += xr[i];
    const float mean = block_reduce_sum(sum) / (float)ne0;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) sq += (xr[i] - mean) * (xr[i] - mean);
    const float scale = rsqrtf(block_reduce_sum(sq) / (float)ne0 + eps);
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = (xr[i] - mean) * scale;
}

// SUM_ROWS: y[row] = the sum of the row (in float; ggml's CPU sums in double, its CUDA in float)
extern "C" __global__ void sum_rows_f32(const float *x, float *y, int ne0, i64 ne1, i64 ne2, i64 xs1, i64 xs2, i64 xs3,
                                        i64 ys1, i64 ys2, i64 ys3) {
    const float *xr = x + row_start(blockIdx.x, ne1, ne2, xs1, xs2, xs3);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) sum += xr[i];
    sum = block_reduce_sum(sum);
    if (threadIdx.x == 0) y[row_start(blockIdx.x, ne1, ne2, ys1, ys2, ys3)] = sum;
}
