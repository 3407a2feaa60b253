// Rotary position embedding (ggml's ROPE, with YaRN): one thread per rotated pair.
#include "common.cuh"

// x, y: rows of ne0 (ne1 heads x ne2 tokens x ne3); pos[i2] is token i2's position.  Pair i
// (i < n_dims/2) is (2i, 2i+1) in the normal mode, (i, i + n_dims/2) in the NeoX mode; it turns
// by pos * freq_base^(-2i/n_dims) (/ freq_factors[i]), YaRN-mixed between extrapolation and
// interpolation (freq_scale) when ext_factor != 0.  Elements from n_dims on are copied.
extern "C" __global__ void rope_f32(const float *x, float *y, const int *pos, const float *freq_factors, int ne0,
                                    i64 ne1, i64 ne2, i64 nrows, i64 xs1, i64 xs2, i64 xs3, i64 ys1, i64 ys2,
                                    i64 ys3, int n_dims, int neox, float freq_base, float freq_scale,
                                    float ext_factor, float attn_factor, float corr_low, float corr_high) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, half = ne0 / 2;
    if (t >= nrows * half) return;
    const i64 r = t / half;
    const int i = (int)(t % half);
    const float *xr = x + row_start(r, ne1, ne2, xs1, xs2, xs3);
    float *yr = y + row_start(r, ne1, ne2, ys1, ys2, ys3);
    if (2 * i >= n_dims) {
        yr[2 * i] = xr[2 * i];
        yr[2 * i + 1] = xr[2 * i + 1];
        return;
    }
    float theta_extrap = (float)pos[r / ne1 % ne2] * powf(freq_base, -2.0f * (float)i / (float)n_dims);
    if (freq_factors) theta_extrap /= freq_factors[i];
    float theta = freq_scale * theta_extrap, mscale = attn_factor;
    if (ext_factor != 0.0f) {
        const float ramp = 1.0f - fminf(1.0f, fmaxf(0.0f, ((float)i - corr_low) / fmaxf(0.001f, corr_high - corr_low)));
        const float mix = ramp * ext_factor;
        theta = theta * (1.0f - mix) + theta_extrap * mix;
        mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);
    }
    const float c = cosf(theta) * mscale, s = sinf(theta) * mscale;
    const int a = neox ? i : 2 * i, b = neox ? i + n_dims / 2 : 2 * i + 1;
    const float x0 = xr[a], x1 = xr[b];
    yr[a] = x0 * c - x1 * s;
    yr[b] = x0 * s + x1 * c;
}
