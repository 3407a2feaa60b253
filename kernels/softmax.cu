// Masked, scaled softmax over rows (ggml's SOFT_MAX): one thread block per row.
#include "common.cuh"

// y = softmax(x * scale + mask) per row; the mask (optional) is rows of ne0, row i1 for row i1,
// repeated over dims 2 and 3 (m2, m3: its sizes there).  y is the scratch of the passes.
// ``sinks`` (optional, gpt-oss): one logit per i2 (head) that takes its share of the row's sum
// and maximum but has no output of its own (ggml_soft_max_add_sinks).
extern "C" __global__ void soft_max_f32(const float *x, const float *mask, const float *sinks, float *y, int ne0,
                                        i64 ne1, i64 ne2, i64 xs1, i64 xs2, i64 xs3, i64 ms1, i64 ms2, i64 ms3,
                                        i64 m2, i64 m3, i64 ys1, i64 ys2, i64 ys3, float scale) {
    const i64 r = blockIdx.x, i1 = r % ne1, i2 = r / ne1 % ne2, i3 = r / (ne1 * ne2);
    const float *xr = x + i1 * xs1 + i2 * xs2 + i3 * xs3;
    const float *mr = mask ? mask + i1 * ms1 + (i2 % m2) * ms2 + (i3 % m3) * ms3 : nullptr;
    float *yr = y + i1 * ys1 + i2 * ys2 + i3 * ys3;
    float mx = NEG_INFINITY;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i] * scale + (mr ? mr[i] : 0.0f);
        yr[i] = v;
        mx = fmaxf(mx, v);
    }
    if (sinks) {
        block_softmax_finish_sink(yr, ne0, mx, sinks[i2]);
    } else {
        block_softmax_finish(yr, ne0, mx);
    }
}
