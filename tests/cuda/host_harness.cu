// Host build of the kernels' format decoders (kernels/common.cuh), for tests without a GPU:
// dequantize rows group by group, and the q8_1 x quantized-weight dot product the
// matrix-vector kernel computes, lane order aside.
#include <cmath>
#include <cuda_fp16.h>  // host rounding to F16, as the quantize kernel does on the GPU
#include "common.cuh"

typedef void (*loader_t)(const u8 *, i64, int *, float &, float &);

static loader_t loader(int type) {
    switch (type) {
        case 2: return load_group_q4_0;
        case 3: return load_group_q4_1;
        case 6: return load_group_q5_0;
        case 7: return load_group_q5_1;
        case 8: return load_group_q8_0;
        case 12: return load_group_q4_k;
        case 13: return load_group_q5_k;
        default: return nullptr;
    }
}

static int byte_of(int word, int j) { return (int)(i8)((word >> (8 * j)) & 0xff); }

// one group's 32 values and, with activations xq (32 ints) of scale dx and s = dx * sum(xq),
// the kernel's term a * dx * sum(w * xq) + b * s
static float group(int type, const u8 *row, i64 g, float *out, const int *xq, float dx, float sx) {
    int w[8];
    if (type == 14) {  // Q6_K: two scales per group
        float d;
        int sc[2];
        load_group_q6_k(row, g, w, d, sc);
        int lo = 0, hi = 0;
        for (int i = 0; i < 32; ++i) {
            const int q = byte_of(w[i / 4], i % 4);
            out[i] = d * (float)sc[i / 16] * (float)q;
            (i < 16 ? lo : hi) += q * xq[i];
        }
        return d * dx * (float)(sc[0] * lo + sc[1] * hi);
    }
    float a, b;
    loader(type)(row, g, w, a, b);
    int dot = 0;
    for (int i = 0; i < 32; ++i) {
        const int q = byte_of(w[i / 4], i % 4);
        out[i] = a * (float)q + b;
        dot += q * xq[i];
    }
    return a * dx * (float)dot + b * sx;
}

extern "C" int supported(int type) { return type == 14 || loader(type) != nullptr; }

// rows of `groups` groups each, row_bytes apart -> y [rows, 32 * groups]
extern "C" void dequantize_rows(int type, const u8 *W, i64 rows, i64 groups, i64 row_bytes, float *y) {
    const int zeros[32] = {0};
    for (i64 r = 0; r < rows; ++r)
        for (i64 g = 0; g < groups; ++g) group(type, W + r * row_bytes, g, y + (r * groups + g) * 32, zeros, 0.f, 0.f);
}

// dst[r] = sum over groups of the kernel's per-group term, x quantized to q8_1 as quantize.cu does
extern "C" void mul_mat_vec(int type, const u8 *W, i64 rows, i64 groups, i64 row_bytes, const float *x, float *dst) {
    float tmp[32];
    for (i64 r = 0; r < rows; ++r) {
        float acc = 0.f;
        for (i64 g = 0; g < groups; ++g) {
            float amax = 0.f;
            for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[g * 32 + i]));
            const float d = amax / 127.0f;
            int xq[32], sum = 0;
            for (int i = 0; i < 32; ++i) {
                xq[i] = amax == 0.f ? 0 : (int)rintf(x[g * 32 + i] / d);
                sum += xq[i];
            }
            const float dx = __half2float(__float2half_rn(d));
            const float sx = __half2float(__float2half_rn(d * (float)sum));
            acc += group(type, W + r * row_bytes, g, tmp, xq, dx, sx);
        }
        dst[r] = acc;
    }
}
