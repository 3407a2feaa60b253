// Attention over an F16 KV cache (ggml's FLASH_ATTN_EXT) in two launches: the probabilities of
// each query row (scores, softcap, mask, softmax: one thread block per row, its query in shared
// memory), then their weighted sum of V rows (one block per row, threads over the head's
// dimensions, so each V row is read coalesced).  Rows are (token t, head h, sequence i3); head h
// reads KV head h / group (grouped-query attention).
#include "common.cuh"

#define ATTN_MAX_D 512  // head size; pyggml/cuda/ops.py keeps larger heads on the CPU

// p: [rows, n_kv] scratch of the probabilities; q strides: qt (token), qh (head), q3;
// k strides (F16 elements): kj (cache row), kh (kv head), k3; mask rows (F32) ms apart
extern "C" __global__ void attn_probs(const float *q, const u16 *k, const float *mask, float *p, int D, int n_kv,
                                      int n_tokens, int n_head, int group, i64 qt, i64 qh, i64 q3, i64 kj, i64 kh,
                                      i64 k3, i64 ms, float scale, float softcap) {
    __shared__ float qrow[ATTN_MAX_D];
    const i64 r = blockIdx.x;
    const int t = (int)(r % n_tokens), h = (int)(r / n_tokens % n_head), i3 = (int)(r / ((i64)n_tokens * n_head));
    const float *qr = q + t * qt + h * qh + i3 * q3;
    for (int d = threadIdx.x; d < D; d += blockDim.x) qrow[d] = qr[d];
    __syncthreads();
    const u16 *kb = k + (h / group) * kh + i3 * k3;
    float *pr = p + r * n_kv;
    float mx = NEG_INFINITY;
    for (int j = threadIdx.x; j < n_kv; j += blockDim.x) {
        const u16 *kr = kb + j * kj;
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += qrow[d] * half_to_float(kr[d]);
        s = softcap != 0.0f ? tanhf(s * scale / softcap) * softcap : s * scale;
        if (mask) s += mask[t * ms + j];
        pr[j] = s;
        mx = fmaxf(mx, s);
    }
    block_softmax_finish(pr, n_kv, mx);
}

// out[i3, t, h, :] = sum_j p[r, j] * v[j, :]; v strides (F16 elements): vj, vh, v3; out: oh, ot, o3
extern "C" __global__ void attn_output(const float *p, const u16 *v, float *out, int D, int n_kv, int n_tokens,
                                       int n_head, int group, i64 vj, i64 vh, i64 v3, i64 oh, i64 ot, i64 o3) {
    const i64 r = blockIdx.x;
    const int t = (int)(r % n_tokens), h = (int)(r / n_tokens % n_head), i3 = (int)(r / ((i64)n_tokens * n_head));
    const u16 *vb = v + (h / group) * vh + i3 * v3;
    const float *pr = p + r * n_kv;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n_kv; ++j) acc += pr[j] * half_to_float(vb[j * vj + d]);
        out[i3 * o3 + t * ot + h * oh + d] = acc;
    }
}
