// Activations to q8_1 blocks ({f16 d; f16 s; i8 q[32]}, 36 bytes) for the integer matrix-vector
// products: one warp per block of 32 floats, one float per lane.  d = max|x| / 127,
// q = round(x / d), s = d * sum(q) as in llama.cpp's q8_1 (mmvq.cu does not read s: it takes
// sum(q) from the quants, since s overflows F16 for large activations).
#include "common.cuh"

extern "C" __global__ void quantize_q8_1(const float *__restrict__ x, u8 *__restrict__ y, i64 ncols,
                                         i64 x_stride, i64 y_stride, i64 nrows) {
    const i64 groups = ncols / QK;
    const i64 warp = (i64)blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (warp >= groups * nrows) return;
    const i64 r = warp / groups, g = warp % groups;
    const float v = x[r * x_stride + g * QK + lane];
    const float amax = warp_reduce_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
    const float sum = warp_reduce_sum((float)q);
    u8 *blk = y + r * y_stride + g * 36;
    ((i8 *)(blk + 4))[lane] = (i8)q;
    if (lane == 0) {
        const u16 dh = float_to_half(d);
        const u16 sh = float_to_half(d * sum);
        // one aligned 32-bit store (blocks are 36 bytes, 4-byte aligned).  Not four byte stores:
        // on an H200 (NVRTC, CUDA 13) `blk[0] = dh & 0xff` of the asm's 16-bit result stored 0,
        // so every d lost its low mantissa byte; the emulator cannot show such a thing
        *(u32 *)blk = (u32)dh | ((u32)sh << 16);
    }
}
