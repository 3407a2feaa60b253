// Element-wise ops: ADD, SUB, MUL, DIV with ggml's broadcasting (src1 repeats along every
// dimension where it is smaller: its index is the output's modulo its size), SCALE
// (x * s + b) and CLAMP.  F32 in and out, any element strides (views work as they are); one thread per
// element.  The residual adds of every layer are these: one launch each, not CuPy's several.
#include "common.cuh"

// the element t of a [ne3, ne2, ne1, ne0] walk, as indices
HD void unravel(i64 t, i64 ne0, i64 ne1, i64 ne2, i64 &i0, i64 &i1, i64 &i2, i64 &i3) {
    i0 = t % ne0;
    t /= ne0;
    i1 = t % ne1;
    t /= ne1;
    i2 = t % ne2;
    i3 = t / ne2;
}

#define BINARY_ADD 0
#define BINARY_SUB 1
#define BINARY_MUL 2
#define BINARY_DIV 3

// out[i] = x[i] op y[i mod y's sizes]; strides are in elements (x: xs*, y: ys*, out: os*)
extern "C" __global__ void binary_f32(const float *x, const float *y, float *out, int op, i64 ne0, i64 ne1, i64 ne2,
                                      i64 ne3, i64 xs0, i64 xs1, i64 xs2, i64 xs3, i64 ye0, i64 ye1, i64 ye2,
                                      i64 ye3, i64 ys0, i64 ys1, i64 ys2, i64 ys3, i64 os0, i64 os1, i64 os2,
                                      i64 os3) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ne0 * ne1 * ne2 * ne3) return;
    i64 i0, i1, i2, i3;
    unravel(t, ne0, ne1, ne2, i0, i1, i2, i3);
    const float a = x[i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3];
    const float b = y[(i0 % ye0) * ys0 + (i1 % ye1) * ys1 + (i2 % ye2) * ys2 + (i3 % ye3) * ys3];
    const float v = op == BINARY_ADD ? a + b : op == BINARY_SUB ? a - b : op == BINARY_MUL ? a * b : a / b;
    out[i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3] = v;
}

// SCALE (op 0): out = x * p + q (ggml_scale_bias; q = 0 for ggml_scale)
// CLAMP (op 1): out = x below p is p, above q is q; NaN stays NaN (as the CPU backend's np.clip)
#define MAP_SCALE 0
#define MAP_CLAMP 1
extern "C" __global__ void map_f32(const float *x, float *out, int op, float p, float q, i64 ne0, i64 ne1, i64 ne2,
                                   i64 ne3, i64 xs0, i64 xs1, i64 xs2, i64 xs3, i64 os0, i64 os1, i64 os2, i64 os3) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ne0 * ne1 * ne2 * ne3) return;
    i64 i0, i1, i2, i3;
    unravel(t, ne0, ne1, ne2, i0, i1, i2, i3);
    const float v = x[i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3];
    out[i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3] = op == MAP_SCALE ? v * p + q : v < p ? p : v > q ? q : v;
}

// ADD_ID (gpt-oss's per-expert biases): out[t, u, :] = a[t, u, :] + b[ids[t, u], :] for token t and
// used slot u; an id outside [0, n_expert) is reported and its row not written
extern "C" __global__ void add_id_f32(const float *a, const float *b, const int *ids, float *out, int *error,
                                      i64 ne0, i64 n_used, i64 n_tokens, i64 n_expert, i64 as1, i64 as2, i64 bs1,
                                      i64 is0, i64 is1, i64 os1, i64 os2) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ne0 * n_used * n_tokens) return;
    const i64 i = t % ne0, u = t / ne0 % n_used, tok = t / (ne0 * n_used);
    const int e = ids[u * is0 + tok * is1];
    if (e < 0 || e >= n_expert) {
        *error = ERROR_ADD_ID_INDEX;
        return;
    }
    out[i + u * os1 + tok * os2] = a[i + u * as1 + tok * as2] + b[i + e * bs1];
}
