// ARGSORT and TOP_K over rows: one thread block per row picks the row's indices one by one,
// each the first element, in the op's order, after the one picked before.  The order is the
// CPU backend's: numbers before NaN, then by value (largest first for TOP_K and a descending
// ARGSORT), then equal values lowest index first - so a pick is a pair (value, index) and
// "after" needs no memory of what was picked.  k picks cost k passes over the row: right for
// the experts' router (a few dozen values) and sampling's top-k (k of about 40 over the
// vocabulary); a full ARGSORT of a long row would want a real sort.
#include "common.cuh"

// does (a, i) come before (b, j)?  j < 0: (b, j) is "nothing yet", which everything precedes
HD bool comes_before(float a, int i, float b, int j, int descending) {
    if (j < 0) return i >= 0;
    if (i < 0) return false;
    const bool a_nan = a != a, b_nan = b != b;
    if (a_nan != b_nan) return b_nan;
    if (!a_nan && a != b) return descending ? a > b : a < b;
    return i < j;
}

// the earliest of the block's (v, i) pairs, in every thread
static __device__ __forceinline__ void block_first(float &v, int &i, int descending) {
    __shared__ float values[32];
    __shared__ int indices[32];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int round = 0; round < 2; ++round) {
#pragma unroll
        for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffff, v, offset, WARP_SIZE);
            const int oi = __shfl_xor_sync(0xffffffff, i, offset, WARP_SIZE);
            if (comes_before(ov, oi, v, i, descending)) {
                v = ov;
                i = oi;
            }
        }
        if (round == 1) break;
        __syncthreads();  // the previous call's readers are done with the shared arrays
        if (lane == 0) {
            values[warp] = v;
            indices[warp] = i;
        }
        __syncthreads();
        const bool has = lane < (int)(blockDim.x / WARP_SIZE);
        v = has ? values[lane] : 0.0f;
        i = has ? indices[lane] : -1;
    }
}

// out[row][0..k) = the indices of the row's first k elements in the order above (k <= ne0)
extern "C" __global__ void argsort_rows_f32(const float *x, int *out, int ne0, int k, i64 ne1, i64 ne2, i64 xs1,
                                            i64 xs2, i64 xs3, i64 os1, i64 os2, i64 os3, int descending) {
    const float *xr = x + row_start(blockIdx.x, ne1, ne2, xs1, xs2, xs3);
    int *yr = out + row_start(blockIdx.x, ne1, ne2, os1, os2, os3);
    float last_v = 0.0f;
    int last_i = -1;  // nothing picked yet
    for (int r = 0; r < k; ++r) {
        float v = 0.0f;
        int i = -1;
        for (int j = threadIdx.x; j < ne0; j += blockDim.x) {
            const float xj = xr[j];
            if ((last_i < 0 || comes_before(last_v, last_i, xj, j, descending)) && comes_before(xj, j, v, i, descending)) {
                v = xj;
                i = j;
            }
        }
        block_first(v, i, descending);
        if (threadIdx.x == 0) yr[r] = i;
        last_v = v;
        last_i = i;
    }
}
