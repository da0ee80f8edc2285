// Prelude of every GdsLLM kernel program: prepended to each .cu file for NVRTC, and
// included after emu.h when the kernels run on the CPU in tests. No #include here: NVRTC
// has no standard headers, so the kernels use only what this file and emu.h define.
//
// Rules that keep the kernels emulable (kernels/emu.h runs one block at a time, one fiber
// per CUDA thread):
// - __syncthreads() and warp_sum() are reached by every thread of the block, the same
//   number of times (no early return before them; guard the work, not the barrier);
// - __shared__ arrays have a fixed size; blockDim.x is a multiple of 32 (whole warps).
// - f16 is decoded with integer arithmetic (f16_to_f32), so the CPU run tests the exact
//   code the GPU runs.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;

#define WARP 32
// Launch geometry shared with the Rust side (src/kernels.rs mirrors these numbers).
#define MATVEC_ROWS 4      // rows per block of the matvec kernels (blockDim = 32 x 4)
#define BLOCK_THREADS 256  // threads per block of the row-wise kernels

// The int8 matvec kernels (quant.cu, matvec_q8_*): warps per block and rows per block
// (blockDim = 32 x MMQ8_WARPS, grid ceil(rows / MMQ8_ROWS)), and the bytes of one block of
// 32 quantized activations (quantize_q8). src/kernels.rs mirrors these numbers; the shape
// may be given at compile time instead (-DMMQ8_WARPS=8 -DMMQ8_ROWS=1: GDS_CUDA_MMQ8, to
// measure others on one binary).
#ifndef MMQ8_WARPS
#define MMQ8_WARPS 4
#endif
#ifndef MMQ8_ROWS
#define MMQ8_ROWS 2
#endif
#define Q8A_BYTES 40

// The int8 tensor-core products of long passes (quant.cu, mmq_*): warps per block, each
// warp 16 rows of the matrix and MMQ_NT tiles of 8 tokens; a block's tile of activation
// blocks is staged MMQ_KC blocks of 32 values at a time. src/kernels.rs mirrors these.
#define MMQ_WARPS 4
#define MMQ_NT 8
#define MMQ_ROWS (16 * MMQ_WARPS)
#define MMQ_TOKENS (8 * MMQ_NT)
#define MMQ_KC 4

// The warp-wide int8 matrix products of the tensor cores (sm_80 on): c += A B, A 16 x 32
// (m16n8k32) or 16 x 16 (m16n8k16) signed bytes, B 32 x 8 or 16 x 8, c 16 x 8 int32. In
// lane l (g = l / 4, q = l % 4): a0 holds row g, values 4q..4q+3 (k), a1 row g + 8 of the
// same values, a2 and a3 (m16n8k32 only) the same rows' values 16 + 4q..; b0 token (column)
// g's values 4q..4q+3, b1 its values 16 + 4q..; c[0], c[1] row g, tokens 2q and 2q + 1,
// c[2], c[3] row g + 8 (PTX ISA, "Matrix Fragments for mma.m16n8k32" and "for mma.m16n8k16
// with integer type"). Every lane of the warp must reach them. kernels/emu.h has the
// emulation; before sm_80 (no such instruction) they are empty and never launched.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void mma_k32(int* c, int a0, int a1, int a2, int a3, int b0,
                                        int b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ void mma_k16(int* c, int a0, int a1, int b0) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
#endif
}
#endif

// Word loads need their natural alignment on the GPU; the emulation checks it (emu.h).
#ifndef ALIGNED_LOAD
#define ALIGNED_LOAD(p, n)
#endif

// Full unrolling of a loop with a constant bound, where the loop indexes a register array
// (otherwise NVRTC may keep the array in local memory); nothing in the emulation.
#ifndef UNROLL
#define UNROLL _Pragma("unroll")
#endif

// Little-endian loads from byte pointers: block fields are not aligned.
__device__ __forceinline__ u16 ld_u16(const u8* p) { return (u16)(p[0] | (p[1] << 8)); }

// IEEE binary16 -> binary32, exact for every input (subnormals, inf, NaN).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 man = (u32)h & 0x3ffu;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f;  // man * 2^-24
        return sign ? -f : f;
    }
    u32 bits = exp == 31 ? (sign | 0x7f800000u | (man << 13))
                         : (sign | ((exp + 112u) << 23) | (man << 13));
    return __uint_as_float(bits);
}

__device__ __forceinline__ float ld_f16(const u8* p) { return f16_to_f32(ld_u16(p)); }

// binary32 -> binary16, rounding to nearest, ties to even (IEEE's default, as the CPU's
// `half::f16::from_f32` and F16C's vcvtps2ph do): overflow to inf, subnormals rounded,
// NaN kept a NaN (quiet bit set, top payload bits kept). Integer arithmetic only, so the
// emulation runs the GPU's exact code.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 exp = (x >> 23) & 0xffu;
    u32 man = x & 0x7fffffu;
    if (exp == 0xffu) return (u16)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
    int e = (int)exp - 127 + 15;  // the half's biased exponent
    if (e >= 31) return (u16)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (u16)sign;  // below half the smallest subnormal: zero
        u32 m = man | 0x800000u;        // the leading 1 made explicit
        u32 shift = (u32)(14 - e);      // 14..24 bits dropped
        u32 h = m >> shift;
        u32 rest = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
        if (rest > halfway || (rest == halfway && (h & 1u))) h++;
        return (u16)(sign | h);  // a carry into bit 10 makes the smallest normal
    }
    u32 h = ((u32)e << 10) | (man >> 13);
    u32 rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  // a carry may reach inf
    return (u16)(sign | h);
}

// f32_to_f16 with finite values beyond f16's range saturated to +-65504 (the largest half)
// instead of overflowing to inf: the inputs of an f16 GEMM (weights dequantized into its
// tile, activations converted for it), where one outlier must not turn a whole output row
// into inf/NaN. inf and NaN stay what they are.
__device__ __forceinline__ u16 f32_to_f16_sat(float f) {
    u32 x = __float_as_uint(f);
    if (((x >> 23) & 0xffu) != 0xffu && (x & 0x7fffffffu) > 0x477fe000u)  // |f| > 65504
        return (u16)(((x >> 16) & 0x8000u) | 0x7bffu);
    return f32_to_f16(f);
}

// Sum over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reductions over a 1-D block of whole warps; every thread gets the result. `scratch`
// holds one value per warp (up to 32 warps).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += scratch[i];
    return t;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[w] = v;
    __syncthreads();
    float t = scratch[0];
    for (int i = 1; i < nw; i++) t = fmaxf(t, scratch[i]);
    return t;
}

// Q4_K / Q5_K 6-bit scale and min of group j (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// ---- 8-bit activations (quant.cu: quantize_q8, matvec_q8_*; ops.cu: the fused _q8 ops) ----
//
// One warp's 32 values (v in lane i: value i of the block) quantized into the activation
// block at o, as quantize_q8 writes it (a one-dimensional block: lane = threadIdx.x % 32).
// Every lane of the warp reaches the reductions; `in`
// (the same in every lane) says whether the block exists and is written.
__device__ __forceinline__ void q8_store_block(float v, u8* o, bool in) {
    int lane = threadIdx.x % WARP;
    float d = warp_max(fabsf(v)) / 127.0f;
    float id = d == 0.0f ? 0.0f : 1.0f / d;
    float q = rintf(v * id);
    float sum = warp_sum(q);
    if (in) {
        o[8 + lane] = (u8)(int)q;
        if (lane == 0) {
            ALIGNED_LOAD(o, 4);
            ((float*)o)[0] = d;
            ((float*)o)[1] = d * sum;
        }
    }
}
