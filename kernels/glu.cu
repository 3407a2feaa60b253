// Gated linear units (ggml's GLU: ReGLU, GeGLU, SwiGLU, gpt-oss's SwiGLU-OAI): y = act(a) * b, one thread
// per element.
#include "common.cuh"

#define GLU_REGLU 0   // pyggml.ops.GluOp
#define GLU_GEGLU 1
#define GLU_SWIGLU 2
#define GLU_SWIGLU_OAI 3

static __device__ __forceinline__ float activation(int op, float v) {
    if (op == GLU_REGLU) return fmaxf(v, 0.0f);
    if (op == GLU_GEGLU) return 0.5f * v * (1.0f + tanhf(0.7978845608f * v * (1.0f + 0.044715f * v * v)));  // tanh GELU
    return v / (1.0f + expf(-v));  // SiLU
}

// a, b, y: rows of ne0 (ne1 x ne2 x ne3 rows, each with its own strides)
extern "C" __global__ void glu_f32(const float *a, const float *b, float *y, int ne0, i64 ne1, i64 ne2, i64 nrows,
                                   i64 as1, i64 as2, i64 as3, i64 bs1, i64 bs2, i64 bs3, i64 ys1, i64 ys2, i64 ys3,
                                   int op) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nrows * ne0) return;
    const i64 r = t / ne0, i = t % ne0;
    const float va = a[row_start(r, ne1, ne2, as1, as2, as3) + i], vb = b[row_start(r, ne1, ne2, bs1, bs2, bs3) + i];
    y[row_start(r, ne1, ne2, ys1, ys2, ys3) + i] = activation(op, va) * vb;
}

// gpt-oss's clamped SwiGLU (ggml's swiglu_oai): x = min(a, limit), g = clamp(b, -limit, limit),
// y = x / (1 + exp(-alpha * x)) * (g + 1), each step in float
extern "C" __global__ void swiglu_oai_f32(const float *a, const float *b, float *y, int ne0, i64 ne1, i64 ne2,
                                          i64 nrows, i64 as1, i64 as2, i64 as3, i64 bs1, i64 bs2, i64 bs3, i64 ys1,
                                          i64 ys2, i64 ys3, float alpha, float limit) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nrows * ne0) return;
    const i64 r = t / ne0, i = t % ne0;
    const float x = fminf(a[row_start(r, ne1, ne2, as1, as2, as3) + i], limit);
    const float g = fminf(fmaxf(b[row_start(r, ne1, ne2, bs1, bs2, bs3) + i], -limit), limit);
    const float e = expf(alpha * -x);
    y[row_start(r, ne1, ne2, ys1, ys2, ys3) + i] = x / (1.0f + e) * (g + 1.0f);
}
