// Attention over an F16 KV cache (ggml's FLASH_ATTN_EXT) in two launches, split over the keys
// as flash-decoding does: a decode step has one query row per head (32 for an 8B llama), and
// one thread block per row would leave most of a GPU idle while each walked the whole cache.
//
// attn_split: one block per (query row, chunk of ATTN_SPLIT keys): the chunk's scores (a thread
// per key: scale, softcap, mask), their maximum m and e_j = exp(score_j - m), l = sum e_j, and
// o[d] = sum_j e_j v_j[d] (threads over d, so each V row is read coalesced).
// attn_combine: one block per row: out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s, with
// M the largest m_s (a row whose keys are all masked gives 0).  With ``sinks`` (gpt-oss), head
// h's sink is one more score in M and in the sum, with no value: out = sum_s ... / (... + exp(sink - M)).
// Rows are (token t, head h, sequence i3); head h reads KV head h / group (grouped-query).
#include "common.cuh"

#define ATTN_MAX_D 512  // head size; pyggml/cuda/ops.py keeps larger heads on the CPU
#define ATTN_SPLIT 128  // keys per block of attn_split, which has that many threads

// part: [rows, n_split, 2 + Dv] scratch {m, l, o[Dv]}; q strides: qt (token), qh (head), q3;
// k, v strides (F16 elements): kj, vj (cache row), kh, vh (kv head), k3, v3; mask rows ms apart
extern "C" __global__ void attn_split(const float *q, const u16 *k, const u16 *v, const float *mask, float *part,
                                      int D, int Dv, int n_kv, int n_tokens, int n_head, int group, i64 qt, i64 qh,
                                      i64 q3, i64 kj, i64 kh, i64 k3, i64 vj, i64 vh, i64 v3, i64 ms, float scale,
                                      float softcap) {
    __shared__ float qrow[ATTN_MAX_D];
    __shared__ float e[ATTN_SPLIT];
    const i64 r = blockIdx.x;
    const int t = (int)(r % n_tokens), h = (int)(r / n_tokens % n_head), i3 = (int)(r / ((i64)n_tokens * n_head));
    const int j0 = blockIdx.y * ATTN_SPLIT, n = min(ATTN_SPLIT, n_kv - j0);
    const float *qr = q + t * qt + h * qh + i3 * q3;
    for (int d = threadIdx.x; d < D; d += blockDim.x) qrow[d] = qr[d];
    __syncthreads();
    float s = NEG_INFINITY;
    if ((int)threadIdx.x < n) {
        const u16 *kr = k + (h / group) * kh + i3 * k3 + (i64)(j0 + threadIdx.x) * kj;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qrow[d] * half_to_float(kr[d]);
        s = softcap != 0.0f ? tanhf(dot * scale / softcap) * softcap : dot * scale;
        if (mask) s += mask[t * ms + j0 + threadIdx.x];
    }
    const float m = block_reduce_max(s);
    const float ej = s == NEG_INFINITY ? 0.0f : expf(s - m);  // (m is -inf only if every key is)
    e[threadIdx.x] = ej;
    const float l = block_reduce_sum(ej);  // (its barriers also publish e[])
    float *out = part + (r * gridDim.y + blockIdx.y) * (2 + Dv);
    const u16 *vb = v + (h / group) * vh + i3 * v3 + (i64)j0 * vj;
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) acc += e[j] * half_to_float(vb[j * vj + d]);
        out[2 + d] = acc;
    }
    if (threadIdx.x == 0) {
        out[0] = m;
        out[1] = l;
    }
}

// out[i3, t, h, :] from the row's n_split parts; out strides: oh, ot, o3; sinks: n_head floats or null
extern "C" __global__ void attn_combine(const float *part, const float *sinks, float *out, int Dv, int n_split,
                                        int n_tokens, int n_head, i64 oh, i64 ot, i64 o3) {
    const i64 r = blockIdx.x;
    const int t = (int)(r % n_tokens), h = (int)(r / n_tokens % n_head), i3 = (int)(r / ((i64)n_tokens * n_head));
    const float *pr = part + r * n_split * (2 + Dv);
    const float sink = sinks ? sinks[h] : NEG_INFINITY;
    float M = sink;
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, pr[s * (2 + Dv)]);
    float L = sink != NEG_INFINITY ? expf(sink - M) : 0.0f;
    for (int s = 0; s < n_split; ++s) {
        const float ms = pr[s * (2 + Dv)];
        if (ms != NEG_INFINITY) L += expf(ms - M) * pr[s * (2 + Dv) + 1];
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            const float ms = pr[s * (2 + Dv)];
            if (ms != NEG_INFINITY) acc += expf(ms - M) * pr[s * (2 + Dv) + 2 + d];
        }
        out[i3 * o3 + t * ot + h * oh + d] = acc * inv;
    }
}
