// Kernels for tests/test_cuda_emulator.py: one that is right (a block sum through shared memory,
// a barrier and shuffles of every kind), and one for each mistake the emulator must report.
#include "common.cuh"

// out[blockIdx.x] = sum of the block's slice of x; out_lanes[i] = lane checks of each shuffle kind
extern "C" __global__ void block_sum(const float *x, float *out, int *lane_checks, int n) {
    __shared__ float partial[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float v = i < n ? x[i] : 0.0f;
    v = warp_reduce_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) w += __shfl_down_sync(0xffffffffu, w, offset);
        if (lane == 0) out[blockIdx.x] = w;
    }
    // lane arithmetic of the other shuffles: from lane 3, from lane - 1 (clamped), across segments of 8
    const int from3 = __shfl_sync(0xffffffffu, lane, 3);
    const int up = __shfl_up_sync(0xffffffffu, lane, 1);
    const int seg = __shfl_xor_sync(0xffffffffu, lane, 4, 8);
    lane_checks[i] = (from3 == 3) + 2 * (up == (lane == 0 ? 0 : lane - 1)) + 4 * (seg == (lane ^ 4));
}

// lanes 16..31 leave before the shuffle that names them
extern "C" __global__ void shuffle_after_exit(float *out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = warp_reduce_sum(1.0f);
}

// half a warp waits at a barrier, the other half at a shuffle that names the first half
extern "C" __global__ void barrier_against_shuffle(float *out) {
    if (threadIdx.x < 16) {
        __syncthreads();
        out[threadIdx.x] = 1.0f;
    } else {
        out[threadIdx.x] = warp_reduce_sum(1.0f);
    }
}

// reads the float just past the end of x (n floats)
extern "C" __global__ void read_past_end(const float *x, float *out, int n) {
    out[0] = x[n];
}

// a 32-bit load from an odd address
extern "C" __global__ void misaligned_load(const u8 *x, float *out) {
    out[0] = (float)load_u32(x + 1);
}

// a 64-bit count: a launch that passes 32 bits is wrong
extern "C" __global__ void takes_i64(float *out, i64 n) {
    out[0] = (float)n;
}

extern "C" __global__ void to_half(const float *x, u16 *y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = float_to_half(x[i]);
}
