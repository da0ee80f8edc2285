// Weights in their on-disk ggml block formats, read in place (zero-copy) from VRAM:
// matrix-vector products (decode) and dequantization to f32 (embedding rows, prefill tiles
// for cuBLAS). Block layouts: SPEC.md section 4.
//
// matvec_<t>(w, x, y, rows, cols, ntok): y[t*rows + r] = sum_k W[r, k] * x[t*cols + k].
// One warp per row (blockDim 32 x MATVEC_ROWS, grid ceil(rows / MATVEC_ROWS)). A block type's
// values are split in PARTS parts of PV values each, and lane i takes parts i, i+32, ... of
// the row: neighbouring lanes read neighbouring bytes of a block and of the next blocks, so
// each load instruction of the warp touches one or two cache lines (one lane per whole block,
// as before 2026-11-27, made every load span the warp's 32 blocks: ~220 G weights/s on an
// H100 whatever the block type; this way 2.1-2.7x that). decp_<t>(block, part, w) decodes a
// part's values once into registers, and the lane dots them with every token it carries. A
// part's values sit in the block as runs of RL consecutive values RS apart, from
// pbase_<t>(part): value k of the part is value pbase + (k / RL) RS + k % RL of the block.
//
// dequant_<t>(src, dst, nblocks): one thread per block, grid ceil(nblocks / BLOCK_THREADS).

// ---- per-block dot products with an f32 vector, and per-block dequantization ----

// Q4_0: d f16, qs[16]; x[j] = ((qs[j] & 15) - 8) d, x[j+16] = ((qs[j] >> 4) - 8) d.
#define Q4_0_QK 32
#define Q4_0_BYTES 18
// Part p (of 4): the bytes qs[4p..4p+4], values 4p..4p+4 and 16+4p..16+4p+4.
__device__ __forceinline__ int pbase_q4_0(int p) { return 4 * p; }
__device__ __forceinline__ void decp_q4_0(const u8* b, int p, float* w) {
    const u8* qs = b + 2 + 4 * p;
    float d = ld_f16(b);
    for (int i = 0; i < 4; i++) {
        w[i] = (float)((qs[i] & 15) - 8) * d;
        w[i + 4] = (float)((qs[i] >> 4) - 8) * d;
    }
}
__device__ __forceinline__ void deq_q4_0(const u8* b, float* y) {
    float d = ld_f16(b);
    const u8* qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

// Q4_1: d f16, m f16, qs[16]; x = q d + m.
#define Q4_1_QK 32
#define Q4_1_BYTES 20
// Parts as Q4_0's.
__device__ __forceinline__ int pbase_q4_1(int p) { return 4 * p; }
__device__ __forceinline__ void decp_q4_1(const u8* b, int p, float* w) {
    const u8* qs = b + 4 + 4 * p;
    float d = ld_f16(b), m = ld_f16(b + 2);
    for (int i = 0; i < 4; i++) {
        w[i] = (float)(qs[i] & 15) * d + m;
        w[i + 4] = (float)(qs[i] >> 4) * d + m;
    }
}
__device__ __forceinline__ void deq_q4_1(const u8* b, float* y) {
    float d = ld_f16(b), m = ld_f16(b + 2);
    const u8* qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 15) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

// Q5_0: d f16, qh u32 (bit j: the fifth bit of value j), qs[16];
// x[j] = ((qs[j] & 15) | bit j << 4) - 16) d, x[j+16] = ((qs[j] >> 4) | bit j+16 << 4) - 16) d.
#define Q5_0_QK 32
#define Q5_0_BYTES 22
// The 5-bit values j and j+16 (0..31) from the high bits at `qh` and the nibbles at `qs`.
__device__ __forceinline__ void q5_pair(const u8* qh4, const u8* qs, int j, int* lo, int* hi) {
    u32 qh = (u32)qh4[0] | ((u32)qh4[1] << 8) | ((u32)qh4[2] << 16) | ((u32)qh4[3] << 24);
    u8 q = qs[j];
    *lo = (int)((q & 15) | (((qh >> j) & 1) << 4));
    *hi = (int)((q >> 4) | (((qh >> (j + 16)) & 1) << 4));
}
// Parts as Q4_0's.
__device__ __forceinline__ int pbase_q5_0(int p) { return 4 * p; }
__device__ __forceinline__ void decp_q5_0(const u8* b, int p, float* w) {
    float d = ld_f16(b);
    for (int i = 0; i < 4; i++) {
        int lo, hi;
        q5_pair(b + 2, b + 6, 4 * p + i, &lo, &hi);
        w[i] = (float)(lo - 16) * d;
        w[i + 4] = (float)(hi - 16) * d;
    }
}
__device__ __forceinline__ void deq_q5_0(const u8* b, float* y) {
    float d = ld_f16(b);
    for (int j = 0; j < 16; j++) {
        int lo, hi;
        q5_pair(b + 2, b + 6, j, &lo, &hi);
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

// Q5_1: d f16, m f16, qh u32, qs[16]; x = q d + m with q the 5-bit value as in Q5_0.
#define Q5_1_QK 32
#define Q5_1_BYTES 24
// Parts as Q4_0's.
__device__ __forceinline__ int pbase_q5_1(int p) { return 4 * p; }
__device__ __forceinline__ void decp_q5_1(const u8* b, int p, float* w) {
    float d = ld_f16(b), m = ld_f16(b + 2);
    for (int i = 0; i < 4; i++) {
        int lo, hi;
        q5_pair(b + 4, b + 8, 4 * p + i, &lo, &hi);
        w[i] = (float)lo * d + m;
        w[i + 4] = (float)hi * d + m;
    }
}
__device__ __forceinline__ void deq_q5_1(const u8* b, float* y) {
    float d = ld_f16(b), m = ld_f16(b + 2);
    for (int j = 0; j < 16; j++) {
        int lo, hi;
        q5_pair(b + 4, b + 8, j, &lo, &hi);
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

// Q8_0: d f16, qs[32] i8; x = q d.
#define Q8_0_QK 32
#define Q8_0_BYTES 34
// Part p (of 4): values 8p..8p+8 (one run).
__device__ __forceinline__ int pbase_q8_0(int p) { return 8 * p; }
__device__ __forceinline__ void decp_q8_0(const u8* b, int p, float* w) {
    const i8* qs = (const i8*)(b + 2) + 8 * p;
    float d = ld_f16(b);
    for (int j = 0; j < 8; j++) w[j] = (float)qs[j] * d;
}
__device__ __forceinline__ void deq_q8_0(const u8* b, float* y) {
    float d = ld_f16(b);
    const i8* qs = (const i8*)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

// Q4_K: d f16, dmin f16, scales[12], qs[128]; 8 groups of 32, x = d sc q - dmin m.
// Q5_K: d f16, dmin f16, scales[12], qh[32], qs[128]; the same with a fifth bit: that of value
// l of group g is qh[l] bit g. One body for both: `qh` is null for Q4_K.
#define Q4_K_QK 256
#define Q4_K_BYTES 144
#define Q5_K_QK 256
#define Q5_K_BYTES 176
// The values l of groups 2c (low nibbles) and 2c + 1 (high nibbles) of a Q4_K/Q5_K block.
__device__ __forceinline__ void q45_k_pair(const u8* qs, const u8* qh, int c, int l, float* lo,
                                           float* hi) {
    u8 q = qs[32 * c + l];
    int h = qh ? qh[l] : 0;
    *lo = (float)((q & 15) | (((h >> (2 * c)) & 1) << 4));
    *hi = (float)((q >> 4) | (((h >> (2 * c + 1)) & 1) << 4));
}
// Part p (of 8): the bytes qs[32c + l] for l in [16h, 16h + 16) (c = p / 2, h = p % 2), the
// values 64c + l (group 2c, low nibbles) and 64c + 32 + l (group 2c + 1, high nibbles).
__device__ __forceinline__ int pbase_q45_k(int p) { return 64 * (p >> 1) + 16 * (p & 1); }
__device__ __forceinline__ void decp_q45_k(const u8* b, const u8* qh, const u8* qs, int p,
                                           float* w) {
    int c = p >> 1, l0 = 16 * (p & 1);
    float sc0, m0, sc1, m1;
    scale_min_k4(2 * c, b + 4, &sc0, &m0);
    scale_min_k4(2 * c + 1, b + 4, &sc1, &m1);
    float d = ld_f16(b), dmin = ld_f16(b + 2);
    float d0 = d * sc0, d1 = d * sc1, o0 = dmin * m0, o1 = dmin * m1;
    for (int i = 0; i < 16; i++) {
        float ql, qh5;
        q45_k_pair(qs, qh, c, l0 + i, &ql, &qh5);
        w[i] = d0 * ql - o0;
        w[i + 16] = d1 * qh5 - o1;
    }
}
__device__ __forceinline__ void deq_q45_k(const u8* b, const u8* qh, const u8* qs, float* y) {
    float d = ld_f16(b), dmin = ld_f16(b + 2);
    const u8* scales = b + 4;
    for (int c = 0; c < 4; c++) {
        float sc0, m0, sc1, m1;
        scale_min_k4(2 * c, scales, &sc0, &m0);
        scale_min_k4(2 * c + 1, scales, &sc1, &m1);
        for (int l = 0; l < 32; l++) {
            float ql, qh5;
            q45_k_pair(qs, qh, c, l, &ql, &qh5);
            y[64 * c + l] = d * sc0 * ql - dmin * m0;
            y[64 * c + 32 + l] = d * sc1 * qh5 - dmin * m1;
        }
    }
}
__device__ __forceinline__ int pbase_q4_k(int p) { return pbase_q45_k(p); }
__device__ __forceinline__ void decp_q4_k(const u8* b, int p, float* w) {
    decp_q45_k(b, nullptr, b + 16, p, w);
}
__device__ __forceinline__ void deq_q4_k(const u8* b, float* y) { deq_q45_k(b, nullptr, b + 16, y); }
__device__ __forceinline__ int pbase_q5_k(int p) { return pbase_q45_k(p); }
__device__ __forceinline__ void decp_q5_k(const u8* b, int p, float* w) {
    decp_q45_k(b, b + 16, b + 48, p, w);
}
__device__ __forceinline__ void deq_q5_k(const u8* b, float* y) { deq_q45_k(b, b + 16, b + 48, y); }

// Q6_K: ql[128], qh[64], scales[16] i8, d f16; 16 groups of 16, x = d sc (q - 32).
#define Q6_K_QK 256
#define Q6_K_BYTES 210
__device__ __forceinline__ void q6_k_quad(const u8* ql, const u8* qh, int l, int* q) {
    q[0] = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
    q[1] = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
    q[2] = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
    q[3] = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
}
// Part p (of 8): half h = p / 4 (128 values), l in [8(p % 4), 8(p % 4) + 8): the values
// 128h + l, + 32, + 64, + 96 (one scale each: l stays within one 16-run).
__device__ __forceinline__ int pbase_q6_k(int p) { return 128 * (p >> 2) + 8 * (p & 3); }
__device__ __forceinline__ void decp_q6_k(const u8* b, int p, float* w) {
    int h = p >> 2, l0 = 8 * (p & 3), is = l0 / 16;
    const u8* ql = b + 64 * h;
    const u8* qh = b + 128 + 32 * h;
    const i8* sc = (const i8*)(b + 192 + 8 * h);
    float d = ld_f16(b + 208);
    float d0 = d * (float)sc[is], d1 = d * (float)sc[is + 2], d2 = d * (float)sc[is + 4],
          d3 = d * (float)sc[is + 6];
    for (int i = 0; i < 8; i++) {
        int q[4];
        q6_k_quad(ql, qh, l0 + i, q);
        w[i] = d0 * (float)q[0];
        w[i + 8] = d1 * (float)q[1];
        w[i + 16] = d2 * (float)q[2];
        w[i + 24] = d3 * (float)q[3];
    }
}
__device__ __forceinline__ void deq_q6_k(const u8* b, float* y) {
    float d = ld_f16(b + 208);
    for (int h = 0; h < 2; h++) {
        const u8* ql = b + 64 * h;
        const u8* qh = b + 128 + 32 * h;
        const i8* sc = (const i8*)(b + 192 + 8 * h);
        float* yh = y + 128 * h;
        for (int l = 0; l < 32; l++) {
            int q[4];
            q6_k_quad(ql, qh, l, q);
            int is = l / 16;
            yh[l] = d * (float)sc[is] * (float)q[0];
            yh[l + 32] = d * (float)sc[is + 2] * (float)q[1];
            yh[l + 64] = d * (float)sc[is + 4] * (float)q[2];
            yh[l + 96] = d * (float)sc[is + 6] * (float)q[3];
        }
    }
}

// ---- kernels over block types ----

// Tokens a matvec lane carries at once: each weight part is read once for up to this many
// tokens (decode steps of several sequences; from L1 for the second and later), instead of
// one walk of the row per token.
#define MATVEC_TOKENS 8

// The warp's sums of `nt` tokens' accumulators, row `row` of each token's output (`y` at the
// chunk's first token). `nt` is the same in every lane, so every lane reaches the shuffles;
// the loop has a constant bound, so it unrolls and `acc` stays in registers.
__device__ __forceinline__ void store_rows(const float* acc, int nt, float* y, int row, int rows) {
    for (int j = 0; j < MATVEC_TOKENS; j++) {
        if (j < nt) {
            float v = warp_sum(acc[j]);
            if (threadIdx.x == 0 && row < rows) y[(unsigned long long)j * rows + row] = v;
        }
    }
}

#define BLOCK_KERNELS(NAME, QK, BYTES, PARTS, PV, RL, RS)                                     \
    extern "C" __global__ void matvec_##NAME(const u8* __restrict__ w,                      \
                                             const float* __restrict__ x,                   \
                                             float* __restrict__ y, int rows, int cols,     \
                                             int ntok) {                                    \
        int row = blockIdx.x * blockDim.y + threadIdx.y;                                    \
        int lane = threadIdx.x;                                                             \
        int nb = cols / QK;                                                                 \
        const u8* wr = w + (unsigned long long)(row < rows ? row : 0) * nb * BYTES;         \
        for (int t0 = 0; t0 < ntok; t0 += MATVEC_TOKENS) {                                  \
            int nt = ntok - t0 < MATVEC_TOKENS ? ntok - t0 : MATVEC_TOKENS;                 \
            float acc[MATVEC_TOKENS];                                                       \
            for (int j = 0; j < MATVEC_TOKENS; j++) acc[j] = 0.0f;                          \
            if (row < rows) {                                                               \
                for (int i = lane; i < nb * PARTS; i += WARP) {                             \
                    int b = i / PARTS, p = i % PARTS;                                       \
                    float wv[PV];                                                           \
                    decp_##NAME(wr + (unsigned long long)b * BYTES, p, wv);                 \
                    const float* xb = x + (unsigned long long)t0 * cols + b * QK + pbase_##NAME(p); \
                    for (int j = 0; j < MATVEC_TOKENS; j++) {                               \
                        if (j < nt) {                                                       \
                            const float* xj = xb + (unsigned long long)j * cols;            \
                            float s = 0.0f;                                                 \
                            for (int k = 0; k < PV; k++) s += wv[k] * xj[(k / RL) * RS + k % RL]; \
                            acc[j] += s;                                                    \
                        }                                                                   \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            store_rows(acc, nt, y + (unsigned long long)t0 * rows, row, rows);               \
        }                                                                                   \
    }                                                                                       \
    extern "C" __global__ void dequant_##NAME(const u8* __restrict__ src,                   \
                                              float* __restrict__ dst, int nblocks) {       \
        int b = blockIdx.x * blockDim.x + threadIdx.x;                                      \
        if (b < nblocks) deq_##NAME(src + (unsigned long long)b * BYTES, dst + (unsigned long long)b * QK); \
    }

// NAME, values per block, bytes per block, PARTS, PV (values per part), RL, RS (see the top)
BLOCK_KERNELS(q4_0, Q4_0_QK, Q4_0_BYTES, 4, 8, 4, 16)
BLOCK_KERNELS(q4_1, Q4_1_QK, Q4_1_BYTES, 4, 8, 4, 16)
BLOCK_KERNELS(q5_0, Q5_0_QK, Q5_0_BYTES, 4, 8, 4, 16)
BLOCK_KERNELS(q5_1, Q5_1_QK, Q5_1_BYTES, 4, 8, 4, 16)
BLOCK_KERNELS(q8_0, Q8_0_QK, Q8_0_BYTES, 4, 8, 8, 8)
BLOCK_KERNELS(q4_k, Q4_K_QK, Q4_K_BYTES, 8, 32, 16, 32)
BLOCK_KERNELS(q5_k, Q5_K_QK, Q5_K_BYTES, 8, 32, 16, 32)
BLOCK_KERNELS(q6_k, Q6_K_QK, Q6_K_BYTES, 8, 32, 8, 32)

// ---- float weights: lanes stride over elements, so each load instruction of a warp reads 32
// neighbouring elements (64 or 128 bytes) of the row and of x. Measured on an H100 (7B F16,
// tg128, 2026-11-27): 92.4 t/s this way; lanes over 8-byte words (4 halves, 4 strided x loads
// per lane) ran at 57.5 t/s, so the access stays per element. Tokens are carried as in the
// block kernels. ----

__device__ __forceinline__ float ld_f32(const u8* p) {
    return __uint_as_float((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}
// bfloat16 is the top half of a binary32: exact by a shift.
__device__ __forceinline__ float ld_bf16(const u8* p) {
    return __uint_as_float((u32)ld_u16(p) << 16);
}

#define FLOAT_KERNELS(NAME, WIDTH, LOAD)                                                    \
    extern "C" __global__ void matvec_##NAME(const u8* __restrict__ w,                      \
                                             const float* __restrict__ x,                   \
                                             float* __restrict__ y, int rows, int cols,     \
                                             int ntok) {                                    \
        int row = blockIdx.x * blockDim.y + threadIdx.y;                                    \
        int lane = threadIdx.x;                                                             \
        const u8* wr = w + (unsigned long long)(row < rows ? row : 0) * cols * WIDTH;       \
        for (int t0 = 0; t0 < ntok; t0 += MATVEC_TOKENS) {                                  \
            int nt = ntok - t0 < MATVEC_TOKENS ? ntok - t0 : MATVEC_TOKENS;                 \
            const float* xt = x + (unsigned long long)t0 * cols;                            \
            float acc[MATVEC_TOKENS];                                                       \
            for (int j = 0; j < MATVEC_TOKENS; j++) acc[j] = 0.0f;                          \
            if (row < rows) {                                                               \
                for (int k = lane; k < cols; k += WARP) {                                   \
                    float f = LOAD(wr + (unsigned long long)k * WIDTH);                     \
                    for (int j = 0; j < MATVEC_TOKENS; j++) {                               \
                        if (j < nt) acc[j] += f * xt[(unsigned long long)j * cols + k];     \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            store_rows(acc, nt, y + (unsigned long long)t0 * rows, row, rows);               \
        }                                                                                   \
    }                                                                                       \
    extern "C" __global__ void dequant_##NAME(const u8* __restrict__ src,                   \
                                              float* __restrict__ dst, int n) {             \
        int i = blockIdx.x * blockDim.x + threadIdx.x;                                      \
        if (i < n) dst[i] = LOAD(src + (unsigned long long)i * WIDTH);                      \
    }

FLOAT_KERNELS(f16, 2, ld_f16)
FLOAT_KERNELS(bf16, 2, ld_bf16)
FLOAT_KERNELS(f32, 4, ld_f32)
