// Weights in their on-disk ggml block formats, read in place (zero-copy) from VRAM:
// matrix-vector products (decode) and dequantization to f32 (embedding rows, prefill tiles
// for cuBLAS). Block layouts: SPEC.md section 4.
//
// matvec_<t>(w, x, y, rows, cols, ntok): y[t*rows + r] = sum_k W[r, k] * x[t*cols + k].
// One warp per row (blockDim 32 x MATVEC_ROWS, grid ceil(rows / MATVEC_ROWS)). A block type's
// values are split in PARTS parts (dotp_<t>(block, x, part): one part's dot product), and
// lane i takes parts i, i+32, ... of the row: neighbouring lanes read neighbouring bytes of a
// block and of the next blocks, so each load instruction of the warp touches one or two cache
// lines (one lane per whole block, as before 2026-11-27, made every load span the warp's 32
// blocks: ~220 G weights/s on an H100 whatever the block type, 4 % of its bandwidth; this way
// 2.1-2.7x that). Tokens are carried MATVEC_TOKENS at a time per lane, each re-decoding the
// part. Decoding a part once into registers for all the carried tokens was tried (030cfc1) and
// measured slower on an H100 on 2026-11-28: 7B Q4_0 tg128 87 vs 89.5 t/s, 1B 344 vs 379, no gain
// in batched decode (bench/runs/2026-11-28-gpu-h100-anchor.md).
//
// dequant_<t>(src, dst, nblocks): one thread per block, grid ceil(nblocks / BLOCK_THREADS);
// each warp's 32 blocks written out together (DEQ_STAGED).
// dequant16_<t>(src, dst, nblocks): the same into f16 (f32_to_f16_sat of each value), the
// tile of an f16 GEMM.

// The body of dequant_<t> / dequant16_<t> (launched one thread per block, BLOCK_THREADS a
// block): each lane decodes its own block into registers, then the warp writes its 32 blocks'
// values out together through shared memory, 32 consecutive values a store (lane l writes
// value l of a run), so each store instruction covers 64 or 128 contiguous bytes. A lane
// writing its own block (QK consecutive values) made every store instruction of the warp
// touch 32 cache lines. On an H200 (2026-12-04) the 7B Q4_0 pp512 took 165 ms a pass, of
// which the f16 GEMMs' arithmetic explains ~20 ms: the rest is mostly writing the 13 GB of
// f16 tiles, i.e. ~100 GB/s, ~2 % of the memory bandwidth (an estimate from the pass times;
// the kernel was not timed on its own). The loops have the same trip
// counts in every thread (a lane past nblocks decodes nothing but still syncs).
// -DDEQ_PER_LANE (GDS_CUDA_DEQ_PER_LANE=1) compiles the former way, each lane writing its own
// block, for the A/B on one binary.
#ifdef DEQ_PER_LANE
#define DEQ_STAGED(QK, BYTES, DEQ, OUT, CONV)                                               \
    int b = blockIdx.x * blockDim.x + threadIdx.x;                                          \
    if (b < nblocks) {                                                                      \
        float v[QK];                                                                        \
        DEQ(src + (unsigned long long)b * BYTES, v);                                        \
        OUT* d = dst + (unsigned long long)b * QK;                                          \
        for (int i = 0; i < QK; i++) d[i] = CONV(v[i]);                                     \
    }
#else
#define DEQ_STAGED(QK, BYTES, DEQ, OUT, CONV)                                               \
    __shared__ float stage[BLOCK_THREADS / WARP][WARP][WARP + 1];                           \
    int b = blockIdx.x * blockDim.x + threadIdx.x;                                          \
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;                                  \
    int first = b - lane;                                                                   \
    float v[QK];                                                                            \
    if (b < nblocks) DEQ(src + (unsigned long long)b * BYTES, v);                           \
    for (int c = 0; c < QK / WARP; c++) {                                                   \
        for (int i = 0; i < WARP; i++) stage[w][lane][i] = v[c * WARP + i];                 \
        __syncthreads();                                                                    \
        for (int k = 0; k < WARP && first + k < nblocks; k++) {                             \
            OUT* d = dst + (unsigned long long)(first + k) * QK + c * WARP;                 \
            d[lane] = CONV(stage[w][k][lane]);                                              \
        }                                                                                   \
        __syncthreads();                                                                    \
    }
#endif

// ---- per-block dot products with an f32 vector, and per-block dequantization ----

// Q4_0: d f16, qs[16]; x[j] = ((qs[j] & 15) - 8) d, x[j+16] = ((qs[j] >> 4) - 8) d.
#define Q4_0_QK 32
#define Q4_0_BYTES 18
// Part p (of 4): the bytes qs[4p..4p+4], values 4p..4p+4 and 16+4p..16+4p+4.
__device__ __forceinline__ float dotp_q4_0(const u8* b, const float* x, int p) {
    const u8* qs = b + 2 + 4 * p;
    const float* xl = x + 4 * p;
    float s = 0.0f;
    for (int i = 0; i < 4; i++) {
        s += (float)((qs[i] & 15) - 8) * xl[i] + (float)((qs[i] >> 4) - 8) * xl[i + 16];
    }
    return ld_f16(b) * s;
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
__device__ __forceinline__ float dotp_q4_1(const u8* b, const float* x, int p) {
    const u8* qs = b + 4 + 4 * p;
    const float* xl = x + 4 * p;
    float s = 0.0f, sx = 0.0f;
    for (int i = 0; i < 4; i++) {
        s += (float)(qs[i] & 15) * xl[i] + (float)(qs[i] >> 4) * xl[i + 16];
        sx += xl[i] + xl[i + 16];
    }
    return ld_f16(b) * s + ld_f16(b + 2) * sx;
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
__device__ __forceinline__ float dotp_q5_0(const u8* b, const float* x, int p) {
    float s = 0.0f;
    for (int j = 4 * p; j < 4 * p + 4; j++) {
        int lo, hi;
        q5_pair(b + 2, b + 6, j, &lo, &hi);
        s += (float)(lo - 16) * x[j] + (float)(hi - 16) * x[j + 16];
    }
    return ld_f16(b) * s;
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
__device__ __forceinline__ float dotp_q5_1(const u8* b, const float* x, int p) {
    float s = 0.0f, sx = 0.0f;
    for (int j = 4 * p; j < 4 * p + 4; j++) {
        int lo, hi;
        q5_pair(b + 4, b + 8, j, &lo, &hi);
        s += (float)lo * x[j] + (float)hi * x[j + 16];
        sx += x[j] + x[j + 16];
    }
    return ld_f16(b) * s + ld_f16(b + 2) * sx;
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
// Part p (of 4): values 8p..8p+8.
__device__ __forceinline__ float dotp_q8_0(const u8* b, const float* x, int p) {
    const i8* qs = (const i8*)(b + 2) + 8 * p;
    const float* xp = x + 8 * p;
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += (float)qs[j] * xp[j];
    return ld_f16(b) * s;
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
__device__ __forceinline__ float dotp_q45_k(const u8* b, const u8* qh, const u8* qs,
                                            const float* x, int p) {
    int c = p >> 1, l0 = 16 * (p & 1);
    float sc0, m0, sc1, m1;
    scale_min_k4(2 * c, b + 4, &sc0, &m0);
    scale_min_k4(2 * c + 1, b + 4, &sc1, &m1);
    float lo = 0.0f, hi = 0.0f, xlo = 0.0f, xhi = 0.0f;
    const float* xc = x + 64 * c;
    for (int l = l0; l < l0 + 16; l++) {
        float ql, qh5;
        q45_k_pair(qs, qh, c, l, &ql, &qh5);
        lo += ql * xc[l];
        hi += qh5 * xc[l + 32];
        xlo += xc[l];
        xhi += xc[l + 32];
    }
    return ld_f16(b) * (sc0 * lo + sc1 * hi) - ld_f16(b + 2) * (m0 * xlo + m1 * xhi);
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
__device__ __forceinline__ float dotp_q4_k(const u8* b, const float* x, int p) {
    return dotp_q45_k(b, nullptr, b + 16, x, p);
}
__device__ __forceinline__ void deq_q4_k(const u8* b, float* y) { deq_q45_k(b, nullptr, b + 16, y); }
__device__ __forceinline__ float dotp_q5_k(const u8* b, const float* x, int p) {
    return dotp_q45_k(b, b + 16, b + 48, x, p);
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
__device__ __forceinline__ float dotp_q6_k(const u8* b, const float* x, int p) {
    int h = p >> 2, l0 = 8 * (p & 3), is = l0 / 16;
    const u8* ql = b + 64 * h;
    const u8* qh = b + 128 + 32 * h;
    const i8* sc = (const i8*)(b + 192 + 8 * h);
    const float* xh = x + 128 * h;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int l = l0; l < l0 + 8; l++) {
        int q[4];
        q6_k_quad(ql, qh, l, q);
        s0 += (float)q[0] * xh[l];
        s1 += (float)q[1] * xh[l + 32];
        s2 += (float)q[2] * xh[l + 64];
        s3 += (float)q[3] * xh[l + 96];
    }
    return ld_f16(b + 208) * ((float)sc[is] * s0 + (float)sc[is + 2] * s1 + (float)sc[is + 4] * s2
                              + (float)sc[is + 6] * s3);
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

// MXFP4 (gpt-oss's experts): e u8 (E8M0), qs[16]; x[j] = 2^(e-128) kv[qs[j] & 15],
// x[j+16] = 2^(e-128) kv[qs[j] >> 4], kv the doubled E2M1 values (ggml's kvalues_mxfp4:
// 0 1 2 3 4 6 8 12, the high bit the sign).
#define MXFP4_QK 32
#define MXFP4_BYTES 17
// ggml's kvalues_mxfp4[q]: |q| 0..3 as is, 4..7 -> 4 6 8 12 (2 or 3, shifted).
__device__ __forceinline__ int mxfp4_int(int q) {
    int m = q & 7;
    int v = m < 4 ? m : (2 | (m & 1)) << ((m >> 1) - 1);
    return (q & 8) ? -v : v;
}
__device__ __forceinline__ float mxfp4_value(int q) { return (float)mxfp4_int(q); }
// The table types' (MXFP4, IQ4_NL, IQ4_XS) 32-value runs: 16 bytes of nibbles, the low ones
// values 0..16, the high ones 16..32, each nibble's value V(nibble). dot_nibbles: bytes
// 0..n of a run against x (values i and 16 + i of byte i); deq_nibbles: the run's values
// times d.
template <float (*V)(int)>
__device__ __forceinline__ float dot_nibbles(const u8* qs, const float* xl, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += V(qs[i] & 15) * xl[i] + V(qs[i] >> 4) * xl[i + 16];
    return s;
}
template <float (*V)(int)>
__device__ __forceinline__ void deq_nibbles(const u8* qs, float d, float* y) {
    for (int j = 0; j < 16; j++) {
        y[j] = d * V(qs[j] & 15);
        y[j + 16] = d * V(qs[j] >> 4);
    }
}
// 2^(e - 128) from bits, as ggml_e8m0_to_fp32_half (subnormal for e 0 and 1).
__device__ __forceinline__ float e8m0_half(u8 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : ((u32)e - 1u) << 23);
}
// Part p (of 4): the bytes qs[4p..4p+4], values 4p..4p+4 and 16+4p..16+4p+4.
__device__ __forceinline__ float dotp_mxfp4(const u8* b, const float* x, int p) {
    return e8m0_half(b[0]) * dot_nibbles<mxfp4_value>(b + 1 + 4 * p, x + 4 * p, 4);
}
__device__ __forceinline__ void deq_mxfp4(const u8* b, float* y) {
    deq_nibbles<mxfp4_value>(b + 1, e8m0_half(b[0]), y);
}

// IQ4_NL: d f16, qs[16]; x[j] = d kv[qs[j] & 15], x[j+16] = d kv[qs[j] >> 4], kv ggml's
// kvalues_iq4nl (non-linear, -127..113). IQ4_XS: d f16, scales_h u16, scales_l[4], qs[128]:
// 8 sub-blocks of 32, sub-block i an IQ4_NL block (nibbles at qs + 16i) of scale
// d * (ls - 32), ls = (4 bits of scales_l[i / 2] at 4 (i % 2)) | (2 bits of scales_h at 2i) << 4.
#define IQ4_NL_QK 32
#define IQ4_NL_BYTES 18
#define IQ4_XS_QK 256
#define IQ4_XS_BYTES 136
__constant__ signed char KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                              1,    13,   25,  38,  53,  69,  89,  113};
__device__ __forceinline__ float iq4_value(int q) { return (float)KVALUES_IQ4NL[q]; }
// Part p (of 4): the bytes qs[4p..4p+4], values 4p..4p+4 and 16+4p..16+4p+4.
__device__ __forceinline__ float dotp_iq4_nl(const u8* b, const float* x, int p) {
    return ld_f16(b) * dot_nibbles<iq4_value>(b + 2 + 4 * p, x + 4 * p, 4);
}
__device__ __forceinline__ void deq_iq4_nl(const u8* b, float* y) {
    deq_nibbles<iq4_value>(b + 2, ld_f16(b), y);
}
// Sub-block i's scale d * (ls - 32), in f32 as gguf-py computes it.
__device__ __forceinline__ float iq4_xs_scale(const u8* b, int i) {
    int lo = (b[4 + i / 2] >> (4 * (i % 2))) & 15;
    int hi = (ld_u16(b + 2) >> (2 * i)) & 3;
    return ld_f16(b) * (float)((lo | (hi << 4)) - 32);
}
// Part p (of 8): sub-block p.
__device__ __forceinline__ float dotp_iq4_xs(const u8* b, const float* x, int p) {
    return iq4_xs_scale(b, p) * dot_nibbles<iq4_value>(b + 8 + 16 * p, x + 32 * p, 16);
}
__device__ __forceinline__ void deq_iq4_xs(const u8* b, float* y) {
    for (int i = 0; i < 8; i++) {
        deq_nibbles<iq4_value>(b + 8 + 16 * i, iq4_xs_scale(b, i), y + 32 * i);
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

#define BLOCK_KERNELS(NAME, QK, BYTES, PARTS, DOTP, DEQ)                                     \
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
                    int b = i / PARTS;                                                      \
                    const u8* blk = wr + (unsigned long long)b * BYTES;                     \
                    const float* xb = x + (unsigned long long)t0 * cols + b * QK;           \
                    for (int j = 0; j < MATVEC_TOKENS; j++) {                               \
                        if (j < nt) acc[j] += DOTP(blk, xb + (unsigned long long)j * cols, i % PARTS); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            store_rows(acc, nt, y + (unsigned long long)t0 * rows, row, rows);               \
        }                                                                                   \
    }                                                                                       \
    extern "C" __global__ void dequant_##NAME(const u8* __restrict__ src,                   \
                                              float* __restrict__ dst, int nblocks) {       \
        DEQ_STAGED(QK, BYTES, DEQ, float, )                                                 \
    }                                                                                       \
    extern "C" __global__ void dequant16_##NAME(const u8* __restrict__ src,                 \
                                                u16* __restrict__ dst, int nblocks) {       \
        DEQ_STAGED(QK, BYTES, DEQ, u16, f32_to_f16_sat)                                     \
    }

BLOCK_KERNELS(q4_0, Q4_0_QK, Q4_0_BYTES, 4, dotp_q4_0, deq_q4_0)
BLOCK_KERNELS(q4_1, Q4_1_QK, Q4_1_BYTES, 4, dotp_q4_1, deq_q4_1)
BLOCK_KERNELS(q5_0, Q5_0_QK, Q5_0_BYTES, 4, dotp_q5_0, deq_q5_0)
BLOCK_KERNELS(q5_1, Q5_1_QK, Q5_1_BYTES, 4, dotp_q5_1, deq_q5_1)
BLOCK_KERNELS(q8_0, Q8_0_QK, Q8_0_BYTES, 4, dotp_q8_0, deq_q8_0)
BLOCK_KERNELS(q4_k, Q4_K_QK, Q4_K_BYTES, 8, dotp_q4_k, deq_q4_k)
BLOCK_KERNELS(q5_k, Q5_K_QK, Q5_K_BYTES, 8, dotp_q5_k, deq_q5_k)
BLOCK_KERNELS(q6_k, Q6_K_QK, Q6_K_BYTES, 8, dotp_q6_k, deq_q6_k)
BLOCK_KERNELS(mxfp4, MXFP4_QK, MXFP4_BYTES, 4, dotp_mxfp4, deq_mxfp4)
BLOCK_KERNELS(iq4_nl, IQ4_NL_QK, IQ4_NL_BYTES, 4, dotp_iq4_nl, deq_iq4_nl)
BLOCK_KERNELS(iq4_xs, IQ4_XS_QK, IQ4_XS_BYTES, 8, dotp_iq4_xs, deq_iq4_xs)

// ---- float weights: lanes stride over elements, so a warp reads 32 neighbours at once, one
// token at a time. Measured on an H100 (7B F16 tg128): this form 92.4 t/s (2026-11-27); lanes
// over 8-byte words 57.5; lanes over elements carrying 8 tokens in an accumulator array 30.5
// (2026-11-28). ----

__device__ __forceinline__ float ld_f32(const u8* p) {
    return __uint_as_float((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}

#define FLOAT_KERNELS(NAME, WIDTH, LOAD)                                                    \
    extern "C" __global__ void matvec_##NAME(const u8* __restrict__ w,                      \
                                             const float* __restrict__ x,                   \
                                             float* __restrict__ y, int rows, int cols,     \
                                             int ntok) {                                    \
        int row = blockIdx.x * blockDim.y + threadIdx.y;                                    \
        int lane = threadIdx.x;                                                             \
        const u8* wr = w + (unsigned long long)(row < rows ? row : 0) * cols * WIDTH;       \
        for (int t = 0; t < ntok; t++) {                                                    \
            const float* xt = x + (unsigned long long)t * cols;                             \
            float acc = 0.0f;                                                               \
            if (row < rows) {                                                               \
                for (int k = lane; k < cols; k += WARP) acc += LOAD(wr + k * WIDTH) * xt[k]; \
            }                                                                               \
            acc = warp_sum(acc);                                                            \
            if (lane == 0 && row < rows) y[(unsigned long long)t * rows + row] = acc;       \
        }                                                                                   \
    }                                                                                       \
    extern "C" __global__ void dequant_##NAME(const u8* __restrict__ src,                   \
                                              float* __restrict__ dst, int n) {             \
        int i = blockIdx.x * blockDim.x + threadIdx.x;                                      \
        if (i < n) dst[i] = LOAD(src + (unsigned long long)i * WIDTH);                      \
    }                                                                                       \
    extern "C" __global__ void dequant16_##NAME(const u8* __restrict__ src,                 \
                                                u16* __restrict__ dst, int n) {             \
        int i = blockIdx.x * blockDim.x + threadIdx.x;                                      \
        if (i < n) dst[i] = f32_to_f16_sat(LOAD(src + (unsigned long long)i * WIDTH));      \
    }

// bfloat16 is the top half of a binary32: exact by a shift.
__device__ __forceinline__ float ld_bf16(const u8* p) {
    return __uint_as_float((u32)ld_u16(p) << 16);
}

FLOAT_KERNELS(f16, 2, ld_f16)
FLOAT_KERNELS(bf16, 2, ld_bf16)
FLOAT_KERNELS(f32, 4, ld_f32)

// ---- int8 products (decode): activations quantized to 8 bits, integer dot products ----
//
// quantize_q8(x, xq, nblocks): the f32 rows at x, 32 values at a time, into blocks of
// Q8A_BYTES: f32 d = max |x| / 127, f32 s = d * sum(q), i8 q[32] = round_ties_even(x / d)
// (gds-kernels' quantize_act_q8_scalar: the same quants and scales, bit for bit). A pass's
// ntok rows of `cols` are ntok * cols / 32 consecutive blocks (token t's at t * cols / 32).
// One warp per block: blockDim BLOCK_THREADS, grid ceil(nblocks / (BLOCK_THREADS / 32)).
//
// matvec_q8_<t>(xq, cols, ntok, w0, y0, rows0, w1, y1, rows1, w2, y2, rows2): for each
// matrix W of w0..w2 (rows1 = rows2 = 0 for one), y[t*rows + r] = sum_k W[r, k] * xq[t][k], the
// weights read in place as 32-bit words (two 16-bit loads where the block is only 2-byte
// aligned: Q4_0, Q8_0, Q6_K) and multiplied with __dp4a. MMQ8_WARPS warps share MMQ8_ROWS
// rows (blockDim 32 x MMQ8_WARPS, grid the matrices' ceil(rows / MMQ8_ROWS) summed): thread
// i of the block takes parts i, i + 32 MMQ8_WARPS, ... of the row (neighbouring threads, neighbouring words), the
// same parts of each of the block's rows (the activation words it loads serve every row),
// and each part's weight words are loaded once into registers for all MATVEC_TOKENS
// carried tokens. The warps' partial sums meet in shared memory. Why 2 rows of 4 warps:
// llama.cpp's MMVQ runs 4 warps on 1 row (1 token) or 2 rows (2+ tokens); 2 rows halve
// the activation loads per weight word at 1 token and still give a 4096-row matrix 2048
// blocks (15 per SM of an H100). Unmeasured on hardware.
//
// vdot_q8_<t>(blk, rs, nr, xa, xs, nt, p, acc): part p of weight block blk and of the blocks
// rs bytes after it in the next rows (nr of the MMQ8_ROWS rows exist; the others reload the
// first, their sums unused), against the activation blocks xa (QK / 32 of them) of nt tokens,
// xs bytes apart: acc[r][j] += row r's product with token j. The weight words go to registers
// first; each activation word is then loaded once for all the rows.

// 32 bits from a 4-byte aligned address.
__device__ __forceinline__ u32 ld_u32_a4(const u8* p) {
    ALIGNED_LOAD(p, 4);
    return *(const u32*)p;
}
// 32 bits from a 2-byte aligned address, as two 16-bit loads.
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    ALIGNED_LOAD(p, 2);
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}
// An activation block's scale, d * sum(q), and quant word k (values 4k..4k+4).
__device__ __forceinline__ float q8a_d(const u8* a) { return __uint_as_float(ld_u32_a4(a)); }
__device__ __forceinline__ float q8a_s(const u8* a) { return __uint_as_float(ld_u32_a4(a + 4)); }
__device__ __forceinline__ int q8a_word(const u8* a, int k) { return (int)ld_u32_a4(a + 8 + 4 * k); }

#define NIBBLES 0x0F0F0F0Fu
#define ONES 0x01010101

extern "C" __global__ void quantize_q8(const float* __restrict__ x, u8* __restrict__ xq,
                                       int nblocks) {
    int kb = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    bool in = kb < nblocks;
    float v = in ? x[(unsigned long long)kb * 32 + lane] : 0.0f;
    // every thread reaches the reductions; only the blocks that exist are written
    q8_store_block(v, xq + (unsigned long long)kb * Q8A_BYTES, in);
}

// The token loop of the 32-value types whose part p (of 2) is, per row, the four words
// l0, l1 (values 8p..8p+8) and h0, h1 (16+8p..16+8p+8) as signed bytes: acc[r][j] +=
// dw[r] d s + cw[r] sx, s the int8 dot product with token j's activation block and sx its
// d * sum (cw: the share of the block's offset or minimum a part carries).
__device__ __forceinline__ void tokens_q8_halves(const int* l0, const int* l1, const int* h0,
                                                 const int* h1, const float* dw,
                                                 const float* cw, const u8* xa,
                                                 unsigned long long xs, int nt, int p,
                                                 float (*acc)[MATVEC_TOKENS]) {
    UNROLL for (int j = 0; j < MATVEC_TOKENS; j++) {
        if (j < nt) {
            const u8* a = xa + j * xs;
            int u0 = q8a_word(a, 2 * p), u1 = q8a_word(a, 2 * p + 1);
            int u2 = q8a_word(a, 4 + 2 * p), u3 = q8a_word(a, 5 + 2 * p);
            float d = q8a_d(a), sx = q8a_s(a);
            UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
                int s = __dp4a(l0[r], u0, 0);
                s = __dp4a(l1[r], u1, s);
                s = __dp4a(h0[r], u2, s);
                s = __dp4a(h1[r], u3, s);
                acc[r][j] += dw[r] * d * (float)s + cw[r] * sx;
            }
        }
    }
}

// Q4_0, part p (of 2): the words qs[8p..8p+4], qs[8p+4..8p+8]: values 8p..8p+8 (low
// nibbles) and 16+8p..16+8p+8 (high). The -8 offset of the block's 32 values comes from
// the activation sum s, half of it in each part.
#define Q4_0_Q8_PARTS 2
__device__ __forceinline__ void vdot_q8_q4_0(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    float dw[MMQ8_ROWS], cw[MMQ8_ROWS];
    int l0[MMQ8_ROWS], l1[MMQ8_ROWS], h0[MMQ8_ROWS], h1[MMQ8_ROWS];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        dw[r] = ld_f16(br);
        cw[r] = -4.0f * dw[r];
        u32 w0 = ld_u32_a2(br + 2 + 8 * p), w1 = ld_u32_a2(br + 6 + 8 * p);
        l0[r] = (int)(w0 & NIBBLES);
        l1[r] = (int)(w1 & NIBBLES);
        h0[r] = (int)((w0 >> 4) & NIBBLES);
        h1[r] = (int)((w1 >> 4) & NIBBLES);
    }
    tokens_q8_halves(l0, l1, h0, h1, dw, cw, xa, xs, nt, p, acc);
}

// Q4_1, part p (of 2): the words of Q4_0's part p (qs at 4: 4-byte aligned, 20-byte blocks),
// no offset; the minimum m times the activations' sum, half of it in each part.
#define Q4_1_Q8_PARTS 2
__device__ __forceinline__ void vdot_q8_q4_1(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    float dw[MMQ8_ROWS], cw[MMQ8_ROWS];
    int l0[MMQ8_ROWS], l1[MMQ8_ROWS], h0[MMQ8_ROWS], h1[MMQ8_ROWS];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        dw[r] = ld_f16(br);
        cw[r] = 0.5f * ld_f16(br + 2);
        u32 w0 = ld_u32_a4(br + 4 + 8 * p), w1 = ld_u32_a4(br + 8 + 8 * p);
        l0[r] = (int)(w0 & NIBBLES);
        l1[r] = (int)(w1 & NIBBLES);
        h0[r] = (int)((w0 >> 4) & NIBBLES);
        h1[r] = (int)((w1 >> 4) & NIBBLES);
    }
    tokens_q8_halves(l0, l1, h0, h1, dw, cw, xa, xs, nt, p, acc);
}

// Bits k..k+3 of a Q5 block's high bits as the fifth bit (0x10) of four bytes.
__device__ __forceinline__ int q5_high4(u32 qh, int k) {
    u32 v = qh >> k;
    return (int)(((v & 1u) << 4) | ((v & 2u) << 11) | ((v & 4u) << 18) | ((v & 8u) << 25));
}

// Q5_0 and Q5_1, part p (of 2): Q4_0's part p of the nibbles (at qs) with the fifth bits of
// its values from qh. Q5_0 (22-byte blocks: 2-byte aligned words) takes 16 off every value:
// 8 activation sums a part; Q5_1 adds its minimum times half the sum a part.
#define Q5_0_Q8_PARTS 2
#define Q5_1_Q8_PARTS 2
__device__ __forceinline__ void vdot_q8_q5(const u8* b, unsigned long long rs, int nr,
                                           const u8* xa, unsigned long long xs, int nt, int p,
                                           float (*acc)[MATVEC_TOKENS], bool q5_1) {
    float dw[MMQ8_ROWS], cw[MMQ8_ROWS];
    int l0[MMQ8_ROWS], l1[MMQ8_ROWS], h0[MMQ8_ROWS], h1[MMQ8_ROWS];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        dw[r] = ld_f16(br);
        // the minimum's half a part (Q5_1), or 16 off each value: 8 sums a part (Q5_0)
        cw[r] = q5_1 ? 0.5f * ld_f16(br + 2) : -8.0f * dw[r];
        const u8* qhp = br + (q5_1 ? 4 : 2);
        const u8* qs = br + (q5_1 ? 8 : 6) + 8 * p;
        u32 qh = q5_1 ? ld_u32_a4(qhp) : ld_u32_a2(qhp);
        u32 w0 = q5_1 ? ld_u32_a4(qs) : ld_u32_a2(qs);
        u32 w1 = q5_1 ? ld_u32_a4(qs + 4) : ld_u32_a2(qs + 4);
        l0[r] = (int)(w0 & NIBBLES) | q5_high4(qh, 8 * p);
        l1[r] = (int)(w1 & NIBBLES) | q5_high4(qh, 8 * p + 4);
        h0[r] = (int)((w0 >> 4) & NIBBLES) | q5_high4(qh, 16 + 8 * p);
        h1[r] = (int)((w1 >> 4) & NIBBLES) | q5_high4(qh, 20 + 8 * p);
    }
    tokens_q8_halves(l0, l1, h0, h1, dw, cw, xa, xs, nt, p, acc);
}
__device__ __forceinline__ void vdot_q8_q5_0(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_q5(b, rs, nr, xa, xs, nt, p, acc, false);
}
__device__ __forceinline__ void vdot_q8_q5_1(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_q5(b, rs, nr, xa, xs, nt, p, acc, true);
}

// The table types (MXFP4, IQ4_NL, IQ4_XS): each nibble's value a signed byte.
#define MXFP4_Q8_PARTS 2
// The values of the nibbles at bit `shift` (0: low, 4: high) of qs[0..4], four signed bytes:
// MXFP4's (mxfp4_int) or, with `iq4`, IQ4_NL's and IQ4_XS's (KVALUES_IQ4NL).
__device__ __forceinline__ int lut_bytes(const u8* qs, int shift, bool iq4) {
    u32 r = 0;
    UNROLL for (int i = 0; i < 4; i++) {
        int n = (qs[i] >> shift) & 15;
        r |= (u32)(u8)(iq4 ? KVALUES_IQ4NL[n] : mxfp4_int(n)) << (8 * i);
    }
    return (int)r;
}
// A table type's part of one row: the values of the nibbles of qs[0..8], low (l0, l1: values
// of qs[0..4], qs[4..8]) and high (h0, h1).
__device__ __forceinline__ void lut_words(const u8* qs, bool iq4, int* l0, int* l1, int* h0,
                                          int* h1) {
    *l0 = lut_bytes(qs, 0, iq4);
    *l1 = lut_bytes(qs + 4, 0, iq4);
    *h0 = lut_bytes(qs, 4, iq4);
    *h1 = lut_bytes(qs + 4, 4, iq4);
}
// The table types' part of each row: its scale `dw` and the words of the nibbles at `qs`
// (MXFP4: E8M0 scale byte, nibbles at 1; IQ4_NL: f16 scale, nibbles at 2; IQ4_XS: sub-block
// `sb`'s scale, its nibbles at 8 + 16 sb), half `h` of the 32 values against the activation
// block at `xa`.
#define LUT_MXFP4 0
#define LUT_IQ4_NL 1
#define LUT_IQ4_XS 2
__device__ __forceinline__ void vdot_q8_lut(const u8* b, unsigned long long rs, int nr,
                                            const u8* xa, unsigned long long xs, int nt, int h,
                                            float (*acc)[MATVEC_TOKENS], int kind, int sb) {
    float dw[MMQ8_ROWS], cw[MMQ8_ROWS];
    int l0[MMQ8_ROWS], l1[MMQ8_ROWS], h0[MMQ8_ROWS], h1[MMQ8_ROWS];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        dw[r] = kind == LUT_MXFP4    ? e8m0_half(br[0])
                : kind == LUT_IQ4_NL ? ld_f16(br)
                                     : iq4_xs_scale(br, sb);
        cw[r] = 0.0f;
        const u8* qs = br + (kind == LUT_MXFP4 ? 1 : kind == LUT_IQ4_NL ? 2 : 8 + 16 * sb);
        lut_words(qs + 8 * h, kind != LUT_MXFP4, &l0[r], &l1[r], &h0[r], &h1[r]);
    }
    tokens_q8_halves(l0, l1, h0, h1, dw, cw, xa, xs, nt, h, acc);
}
// MXFP4, part p (of 2): Q4_0's part p of the nibbles (qs at 1, 17-byte blocks: byte loads),
// each nibble's value (kvalues_mxfp4, -12..12) a signed byte; the block's scale 2^(e - 128).
__device__ __forceinline__ void vdot_q8_mxfp4(const u8* b, unsigned long long rs, int nr,
                                              const u8* xa, unsigned long long xs, int nt, int p,
                                              float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_lut(b, rs, nr, xa, xs, nt, p, acc, LUT_MXFP4, 0);
}
// IQ4_NL, part p (of 2): as MXFP4's (qs at 2, 18-byte blocks), each nibble's value
// kvalues_iq4nl, the block's f16 scale.
#define IQ4_NL_Q8_PARTS 2
__device__ __forceinline__ void vdot_q8_iq4_nl(const u8* b, unsigned long long rs, int nr,
                                               const u8* xa, unsigned long long xs, int nt,
                                               int p, float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_lut(b, rs, nr, xa, xs, nt, p, acc, LUT_IQ4_NL, 0);
}
// IQ4_XS, part p (of 16): half p % 2 of sub-block p / 2 (an IQ4_NL block at qs + 16 (p / 2)
// of scale iq4_xs_scale), against that sub-block's activation block.
#define IQ4_XS_Q8_PARTS 16
__device__ __forceinline__ void vdot_q8_iq4_xs(const u8* b, unsigned long long rs, int nr,
                                               const u8* xa, unsigned long long xs, int nt,
                                               int p, float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_lut(b, rs, nr, xa + (p / 2) * Q8A_BYTES, xs, nt, p % 2, acc, LUT_IQ4_XS, p / 2);
}

// Q8_0, part p (of 4): the words of values 8p..8p+8.
#define Q8_0_Q8_PARTS 4
__device__ __forceinline__ void vdot_q8_q8_0(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    float dw[MMQ8_ROWS];
    int w0[MMQ8_ROWS], w1[MMQ8_ROWS];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        dw[r] = ld_f16(br);
        w0[r] = (int)ld_u32_a2(br + 2 + 8 * p);
        w1[r] = (int)ld_u32_a2(br + 6 + 8 * p);
    }
    UNROLL for (int j = 0; j < MATVEC_TOKENS; j++) {
        if (j < nt) {
            const u8* a = xa + j * xs;
            int u0 = q8a_word(a, 2 * p), u1 = q8a_word(a, 2 * p + 1);
            float d = q8a_d(a);
            UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
                int s = __dp4a(w0[r], u0, 0);
                s = __dp4a(w1[r], u1, s);
                acc[r][j] += dw[r] * d * (float)s;
            }
        }
    }
}

// Q4_K, part p (of 16): c = p / 4, the words qs[32c + o .. 32c + o + 8] (o = 8 (p % 4)):
// values 64c + o.. (group 2c, low nibbles; activation block 2c) and 64c + 32 + o.. (group
// 2c + 1, high nibbles; block 2c + 1). The mins need the partial activation sums, which
// __dp4a with ones gives (once per token for all the rows). Q5_K (`five`): the same with
// qs at 48, and the fifth bits of those values, bits 2c and 2c + 1 of qh[o .. o + 8].
#define Q4_K_Q8_PARTS 16
#define Q5_K_Q8_PARTS 16
__device__ __forceinline__ void vdot_q8_q45_k(const u8* b, unsigned long long rs, int nr,
                                              const u8* xa, unsigned long long xs, int nt,
                                              int p, float (*acc)[MATVEC_TOKENS], bool five) {
    int c = p >> 2, o = 8 * (p & 3);
    float d[MMQ8_ROWS], dmin[MMQ8_ROWS], sc0[MMQ8_ROWS], m0[MMQ8_ROWS], sc1[MMQ8_ROWS],
        m1[MMQ8_ROWS];
    int l0[MMQ8_ROWS], l1[MMQ8_ROWS], h0[MMQ8_ROWS], h1[MMQ8_ROWS];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        scale_min_k4(2 * c, br + 4, &sc0[r], &m0[r]);
        scale_min_k4(2 * c + 1, br + 4, &sc1[r], &m1[r]);
        d[r] = ld_f16(br);
        dmin[r] = ld_f16(br + 2);
        const u8* qs = br + (five ? 48 : 16) + 32 * c + o;
        u32 w0 = ld_u32_a4(qs), w1 = ld_u32_a4(qs + 4);
        l0[r] = (int)(w0 & NIBBLES);
        l1[r] = (int)(w1 & NIBBLES);
        h0[r] = (int)((w0 >> 4) & NIBBLES);
        h1[r] = (int)((w1 >> 4) & NIBBLES);
        if (five) {
            u32 q0 = ld_u32_a4(br + 16 + o), q1 = ld_u32_a4(br + 20 + o);
            l0[r] |= (int)(((q0 >> (2 * c)) & ONES) << 4);
            l1[r] |= (int)(((q1 >> (2 * c)) & ONES) << 4);
            h0[r] |= (int)(((q0 >> (2 * c + 1)) & ONES) << 4);
            h1[r] |= (int)(((q1 >> (2 * c + 1)) & ONES) << 4);
        }
    }
    UNROLL for (int j = 0; j < MATVEC_TOKENS; j++) {
        if (j < nt) {
            const u8* a0 = xa + j * xs + 2 * c * Q8A_BYTES;
            const u8* a1 = a0 + Q8A_BYTES;
            int u00 = q8a_word(a0, o / 4), u01 = q8a_word(a0, o / 4 + 1);
            int u10 = q8a_word(a1, o / 4), u11 = q8a_word(a1, o / 4 + 1);
            int qlo = __dp4a(ONES, u01, __dp4a(ONES, u00, 0));
            int qhi = __dp4a(ONES, u11, __dp4a(ONES, u10, 0));
            float d0 = q8a_d(a0), d1 = q8a_d(a1);
            UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
                int slo = __dp4a(l1[r], u01, __dp4a(l0[r], u00, 0));
                int shi = __dp4a(h1[r], u11, __dp4a(h0[r], u10, 0));
                acc[r][j] += d[r] * (sc0[r] * d0 * (float)slo + sc1[r] * d1 * (float)shi)
                             - dmin[r] * (m0[r] * d0 * (float)qlo + m1[r] * d1 * (float)qhi);
            }
        }
    }
}
__device__ __forceinline__ void vdot_q8_q4_k(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_q45_k(b, rs, nr, xa, xs, nt, p, acc, false);
}
__device__ __forceinline__ void vdot_q8_q5_k(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    vdot_q8_q45_k(b, rs, nr, xa, xs, nt, p, acc, true);
}

// Four bytes 0..63 minus 32 each (signed bytes), without borrows between the bytes.
__device__ __forceinline__ int sub32_bytes(u32 v) {
    return (int)(((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u);
}

// Q6_K, part p (of 16): half h = p / 8 (128 values), l0 = 4 (p % 8): the words ql[64h + l0],
// ql[64h + 32 + l0], qh[32h + l0], giving values 128h + 32k + l0.. for k = 0..3 (activation
// block 4h + k, scale sc[8h + l0 / 16 + 2k]).
#define Q6_K_Q8_PARTS 16
__device__ __forceinline__ void vdot_q8_q6_k(const u8* b, unsigned long long rs, int nr,
                                             const u8* xa, unsigned long long xs, int nt, int p,
                                             float (*acc)[MATVEC_TOKENS]) {
    int h = p >> 3, l0 = 4 * (p & 7), is = (p & 7) >> 2;
    float d[MMQ8_ROWS], s[MMQ8_ROWS][4];
    int v[MMQ8_ROWS][4];
    UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
        const u8* br = b + (r < nr ? r : 0) * rs;
        d[r] = ld_f16(br + 208);
        const i8* sc = (const i8*)(br + 192 + 8 * h);
        u32 qa = ld_u32_a2(br + 64 * h + l0), qb = ld_u32_a2(br + 64 * h + 32 + l0);
        u32 qh = ld_u32_a2(br + 128 + 32 * h + l0);
        v[r][0] = sub32_bytes((qa & NIBBLES) | ((qh << 4) & 0x30303030u));
        v[r][1] = sub32_bytes((qb & NIBBLES) | ((qh << 2) & 0x30303030u));
        v[r][2] = sub32_bytes(((qa >> 4) & NIBBLES) | (qh & 0x30303030u));
        v[r][3] = sub32_bytes(((qb >> 4) & NIBBLES) | ((qh >> 2) & 0x30303030u));
        UNROLL for (int k = 0; k < 4; k++) s[r][k] = (float)sc[is + 2 * k];
    }
    UNROLL for (int j = 0; j < MATVEC_TOKENS; j++) {
        if (j < nt) {
            const u8* a = xa + j * xs + 4 * h * Q8A_BYTES;
            int u[4];
            float dk[4];
            UNROLL for (int k = 0; k < 4; k++) {
                u[k] = q8a_word(a + k * Q8A_BYTES, l0 / 4);
                dk[k] = q8a_d(a + k * Q8A_BYTES);
            }
            UNROLL for (int r = 0; r < MMQ8_ROWS; r++) {
                float t = 0.0f;
                UNROLL for (int k = 0; k < 4; k++) {
                    t += s[r][k] * dk[k] * (float)__dp4a(v[r][k], u[k], 0);
                }
                acc[r][j] += d[r] * t;
            }
        }
    }
}

// The outputs of one matvec_q8 launch: up to three matrices (w0, w1, w2) of the same type
// and width over the same activations (Q, K and V; gate and up), each with its own rows
// and output. The grid is the sum of each one's ceil(rows / MMQ8_ROWS) blocks, in order;
// one of 0 rows has none. One launch instead of three spares two launches and two kernels'
// tails per fused group on a decode step.
#define Q8_KERNEL(NAME, QK, BYTES, PARTS, VDOT)                                             \
    extern "C" __global__ void matvec_q8_##NAME(                                            \
        const u8* __restrict__ xq, int cols, int ntok, const u8* __restrict__ w0,           \
        float* __restrict__ y0, int rows0, const u8* __restrict__ w1,                       \
        float* __restrict__ y1, int rows1, const u8* __restrict__ w2,                       \
        float* __restrict__ y2, int rows2) {                                                \
        __shared__ float part[MMQ8_WARPS][MMQ8_ROWS * MATVEC_TOKENS][WARP];                 \
        int tid = threadIdx.y * WARP + threadIdx.x;                                         \
        /* the block's matrix and its block index in it (the same in the whole block) */   \
        int nb0 = (rows0 + MMQ8_ROWS - 1) / MMQ8_ROWS;                                      \
        int nb1 = (rows1 + MMQ8_ROWS - 1) / MMQ8_ROWS;                                      \
        int sb = blockIdx.x;                                                                \
        const u8* w = w0;                                                                   \
        float* y = y0;                                                                      \
        int rows = rows0;                                                                   \
        if (sb >= nb0 + nb1) {                                                              \
            sb -= nb0 + nb1;                                                                \
            w = w2;                                                                         \
            y = y2;                                                                         \
            rows = rows2;                                                                   \
        } else if (sb >= nb0) {                                                             \
            sb -= nb0;                                                                      \
            w = w1;                                                                         \
            y = y1;                                                                         \
            rows = rows1;                                                                   \
        }                                                                                   \
        int row0 = sb * MMQ8_ROWS;                                                          \
        int nb = cols / QK;                                                                 \
        unsigned long long xs = (unsigned long long)(cols / 32) * Q8A_BYTES;                \
        /* the block's rows that exist (row0 < rows: the segment has ceil(rows / */         \
        /* MMQ8_ROWS) blocks), and the bytes from one row to the next */                   \
        int nr = rows - row0 < MMQ8_ROWS ? rows - row0 : MMQ8_ROWS;                         \
        unsigned long long rs = (unsigned long long)nb * BYTES;                             \
        for (int t0 = 0; t0 < ntok; t0 += MATVEC_TOKENS) {                                  \
            int nt = ntok - t0 < MATVEC_TOKENS ? ntok - t0 : MATVEC_TOKENS;                 \
            float acc[MMQ8_ROWS][MATVEC_TOKENS];                                            \
            UNROLL for (int r = 0; r < MMQ8_ROWS; r++)                                      \
                UNROLL for (int j = 0; j < MATVEC_TOKENS; j++) acc[r][j] = 0.0f;            \
            const u8* xt = xq + t0 * xs;                                                    \
            for (int i = tid; i < nb * PARTS; i += MMQ8_WARPS * WARP) {                     \
                int b = i / PARTS;                                                          \
                const u8* xa = xt + (unsigned long long)b * (QK / 32) * Q8A_BYTES;          \
                const u8* blk = w + ((unsigned long long)row0 * nb + b) * BYTES;            \
                VDOT(blk, rs, nr, xa, xs, nt, i % PARTS, acc);                              \
            }                                                                               \
            UNROLL for (int r = 0; r < MMQ8_ROWS; r++)                                      \
                UNROLL for (int j = 0; j < MATVEC_TOKENS; j++)                              \
                    if (j < nt) part[threadIdx.y][r * MATVEC_TOKENS + j][threadIdx.x] = acc[r][j]; \
            __syncthreads();                                                                \
            /* the nt x MMQ8_ROWS sums, o = r nt + j, spread over the warps; every warp */  \
            /* runs the same number of rounds (the emulation's shuffles are block-wide) */  \
            int nout = MMQ8_ROWS * nt;                                                      \
            for (int o0 = 0; o0 < nout; o0 += MMQ8_WARPS) {                                 \
                int o = o0 + threadIdx.y, r = o / nt, j = o % nt;                           \
                float v = 0.0f;                                                             \
                if (o < nout) {                                                             \
                    UNROLL for (int k = 0; k < MMQ8_WARPS; k++)                             \
                        v += part[k][r * MATVEC_TOKENS + j][threadIdx.x];                   \
                }                                                                           \
                v = warp_sum(v);                                                            \
                if (threadIdx.x == 0 && o < nout && row0 + r < rows)                        \
                    y[(unsigned long long)(t0 + j) * rows + row0 + r] = v;                  \
            }                                                                               \
            __syncthreads();                                                                \
        }                                                                                   \
    }

Q8_KERNEL(q4_0, Q4_0_QK, Q4_0_BYTES, Q4_0_Q8_PARTS, vdot_q8_q4_0)
Q8_KERNEL(q4_1, Q4_1_QK, Q4_1_BYTES, Q4_1_Q8_PARTS, vdot_q8_q4_1)
Q8_KERNEL(q5_0, Q5_0_QK, Q5_0_BYTES, Q5_0_Q8_PARTS, vdot_q8_q5_0)
Q8_KERNEL(q5_1, Q5_1_QK, Q5_1_BYTES, Q5_1_Q8_PARTS, vdot_q8_q5_1)
Q8_KERNEL(q8_0, Q8_0_QK, Q8_0_BYTES, Q8_0_Q8_PARTS, vdot_q8_q8_0)
Q8_KERNEL(q4_k, Q4_K_QK, Q4_K_BYTES, Q4_K_Q8_PARTS, vdot_q8_q4_k)
Q8_KERNEL(q5_k, Q5_K_QK, Q5_K_BYTES, Q5_K_Q8_PARTS, vdot_q8_q5_k)
Q8_KERNEL(q6_k, Q6_K_QK, Q6_K_BYTES, Q6_K_Q8_PARTS, vdot_q8_q6_k)
Q8_KERNEL(mxfp4, MXFP4_QK, MXFP4_BYTES, MXFP4_Q8_PARTS, vdot_q8_mxfp4)
Q8_KERNEL(iq4_nl, IQ4_NL_QK, IQ4_NL_BYTES, IQ4_NL_Q8_PARTS, vdot_q8_iq4_nl)
Q8_KERNEL(iq4_xs, IQ4_XS_QK, IQ4_XS_BYTES, IQ4_XS_Q8_PARTS, vdot_q8_iq4_xs)

// ---- int8 tensor-core products of long passes (mmq_<t>) ----
//
// mmq_<t>(xq, cols, ntok, w, y, rows): y[t*rows + r] = sum_k W[r, k] * x[t*cols + k] over the
// activations quantize_q8 wrote (the 8-bit values matvec_q8_<t> multiplies), for a pass of
// many tokens: instead of dequantizing W into a tile for cuBLAS (every weight written out as
// f16 and read back), each warp multiplies 16 rows of W, decoded into registers as signed
// bytes, with MMQ_NT tiles of 8 tokens on the tensor cores (mma_k32: one 32-value block per
// instruction), and scales the int32 sums by the weight's and the activation's block scales
// as the int8 matvecs do. Grid (ceil(rows / MMQ_ROWS), ceil(ntok / MMQ_TOKENS)), blockDim
// 32 x MMQ_WARPS (one-dimensional). The block's MMQ_TOKENS tokens' activation blocks are
// staged in shared memory MMQ_KC blocks at a time (read once for the block's four warps).
// sm_80 on (GDS_CUDA_MMQ=1 turns it on; src/executor.rs).
//
// Each type's mmq_w_<t>(b, sb, q, lo, hi, s0, s1, cw): of the 32-value block sb of the
// type's block at b (sb = 0 for the 32-value types, 0..7 for the 256-value ones), the values
// 4q..4q+3 (lo) and 16+4q..16+4q+3 (hi) as signed bytes; the scales of values 0..15 (s0) and
// 16..31 (s1) of the int8 sums (the same but for Q6_K, whose 16-value groups have their own:
// its kernel multiplies each half alone, mma_k16); and what multiplies the activation
// block's d * sum(q) (cw: an offset of the values, or the block's minimum).
typedef void (*MmqLoad)(const u8*, int, int, int*, int*, float*, float*, float*);

__device__ __forceinline__ void mmq_w_q4_0(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    u32 w = ld_u32_a2(b + 2 + 4 * q);
    *lo = (int)(w & NIBBLES);
    *hi = (int)((w >> 4) & NIBBLES);
    *s0 = *s1 = ld_f16(b);
    *cw = -8.0f * *s0;
}
__device__ __forceinline__ void mmq_w_q4_1(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    u32 w = ld_u32_a4(b + 4 + 4 * q);
    *lo = (int)(w & NIBBLES);
    *hi = (int)((w >> 4) & NIBBLES);
    *s0 = *s1 = ld_f16(b);
    *cw = ld_f16(b + 2);
}
// Q5_0 (22-byte blocks: 2-byte aligned words; 16 off every value) and Q5_1 (its minimum).
__device__ __forceinline__ void mmq_w_q5_0(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    u32 qh = ld_u32_a2(b + 2), w = ld_u32_a2(b + 6 + 4 * q);
    *lo = (int)(w & NIBBLES) | q5_high4(qh, 4 * q);
    *hi = (int)((w >> 4) & NIBBLES) | q5_high4(qh, 16 + 4 * q);
    *s0 = *s1 = ld_f16(b);
    *cw = -16.0f * *s0;
}
__device__ __forceinline__ void mmq_w_q5_1(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    u32 qh = ld_u32_a4(b + 4), w = ld_u32_a4(b + 8 + 4 * q);
    *lo = (int)(w & NIBBLES) | q5_high4(qh, 4 * q);
    *hi = (int)((w >> 4) & NIBBLES) | q5_high4(qh, 16 + 4 * q);
    *s0 = *s1 = ld_f16(b);
    *cw = ld_f16(b + 2);
}
__device__ __forceinline__ void mmq_w_q8_0(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    *lo = (int)ld_u32_a2(b + 2 + 4 * q);
    *hi = (int)ld_u32_a2(b + 18 + 4 * q);
    *s0 = *s1 = ld_f16(b);
    *cw = 0.0f;
}
// Q4_K and Q5_K (`five`): group sb is the low (even sb) or high (odd) nibbles of
// qs[32 (sb / 2) ..], its 6-bit scale and minimum (scale_min_k4); Q5_K's fifth bits are bit
// sb of qh[0..32].
__device__ __forceinline__ void mmq_w_q45_k(const u8* b, int sb, int q, int* lo, int* hi,
                                            float* s0, float* s1, float* cw, bool five) {
    const u8* qs = b + (five ? 48 : 16) + 32 * (sb >> 1);
    int shift = 4 * (sb & 1);
    *lo = (int)((ld_u32_a4(qs + 4 * q) >> shift) & NIBBLES);
    *hi = (int)((ld_u32_a4(qs + 16 + 4 * q) >> shift) & NIBBLES);
    if (five) {
        *lo |= (int)(((ld_u32_a4(b + 16 + 4 * q) >> sb) & ONES) << 4);
        *hi |= (int)(((ld_u32_a4(b + 32 + 4 * q) >> sb) & ONES) << 4);
    }
    float sc, m;
    scale_min_k4(sb, b + 4, &sc, &m);
    *s0 = *s1 = ld_f16(b) * sc;
    *cw = -ld_f16(b + 2) * m;
}
__device__ __forceinline__ void mmq_w_q4_k(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    mmq_w_q45_k(b, sb, q, lo, hi, s0, s1, cw, false);
}
__device__ __forceinline__ void mmq_w_q5_k(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    mmq_w_q45_k(b, sb, q, lo, hi, s0, s1, cw, true);
}
// Q6_K: group sb = 4h + k holds values 128h + 32k + l (l = 0..31): the nibble at bit 4 (k / 2)
// of ql[64h + 32 (k % 2) + l], bits 2k, 2k + 1 of qh[32h + l] above it, minus 32; the scale
// of l < 16 is sc[8h + 2k], of l >= 16 sc[8h + 2k + 1] (210-byte blocks: 2-byte aligned).
__device__ __forceinline__ void mmq_w_q6_k(const u8* b, int sb, int q, int* lo, int* hi,
                                           float* s0, float* s1, float* cw) {
    int h = sb >> 2, k = sb & 3;
    const u8* ql = b + 64 * h + 32 * (k & 1) + 4 * q;
    const u8* qh = b + 128 + 32 * h + 4 * q;
    int sl = 4 * (k >> 1), sh = 2 * k;
    *lo = sub32_bytes(((ld_u32_a2(ql) >> sl) & NIBBLES) |
                      (((ld_u32_a2(qh) >> sh) & 0x03030303u) << 4));
    *hi = sub32_bytes(((ld_u32_a2(ql + 16) >> sl) & NIBBLES) |
                      (((ld_u32_a2(qh + 16) >> sh) & 0x03030303u) << 4));
    const i8* sc = (const i8*)(b + 192 + 8 * h);
    float d = ld_f16(b + 208);
    *s0 = d * (float)sc[2 * k];
    *s1 = d * (float)sc[2 * k + 1];
    *cw = 0.0f;
}
// The table types: each nibble's value a signed byte (lut_bytes), Q4_0's nibble layout.
__device__ __forceinline__ void mmq_w_mxfp4(const u8* b, int sb, int q, int* lo, int* hi,
                                            float* s0, float* s1, float* cw) {
    *lo = lut_bytes(b + 1 + 4 * q, 0, false);
    *hi = lut_bytes(b + 1 + 4 * q, 4, false);
    *s0 = *s1 = e8m0_half(b[0]);
    *cw = 0.0f;
}
__device__ __forceinline__ void mmq_w_iq4_nl(const u8* b, int sb, int q, int* lo, int* hi,
                                             float* s0, float* s1, float* cw) {
    *lo = lut_bytes(b + 2 + 4 * q, 0, true);
    *hi = lut_bytes(b + 2 + 4 * q, 4, true);
    *s0 = *s1 = ld_f16(b);
    *cw = 0.0f;
}
__device__ __forceinline__ void mmq_w_iq4_xs(const u8* b, int sb, int q, int* lo, int* hi,
                                             float* s0, float* s1, float* cw) {
    *lo = lut_bytes(b + 8 + 16 * sb + 4 * q, 0, true);
    *hi = lut_bytes(b + 8 + 16 * sb + 4 * q, 4, true);
    *s0 = *s1 = iq4_xs_scale(b, sb);
    *cw = 0.0f;
}

// The body of mmq_<t> (above). `xt`: the block's shared tile, MMQ_KC x MMQ_TOKENS activation
// blocks of Q8A_BYTES / 4 words. Rows past `rows` and tokens past `ntok` are computed from
// the last row / token (in bounds) and not written. Every loop has the same trip count in
// every thread of the block (the emulated mma is a block-wide exchange).
template <int QK, int BYTES, MmqLoad LOAD, bool SPLIT>
__device__ __forceinline__ void mmq_tiles(const u8* __restrict__ xq, int cols, int ntok,
                                          const u8* __restrict__ w, float* __restrict__ y,
                                          int rows, int* xt) {
    const int XW = Q8A_BYTES / 4;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int g = lane >> 2, q = lane & 3;
    int nsub = cols / 32;
    unsigned long long xs = (unsigned long long)nsub * Q8A_BYTES;
    unsigned long long rs = (unsigned long long)(cols / QK) * BYTES;
    int ra = blockIdx.x * MMQ_ROWS + warp * 16 + g, rb = ra + 8;
    const u8* wa = w + (unsigned long long)(ra < rows ? ra : rows - 1) * rs;
    const u8* wb = w + (unsigned long long)(rb < rows ? rb : rows - 1) * rs;
    int t0 = blockIdx.y * MMQ_TOKENS;
    float acc[MMQ_NT][4];
    UNROLL for (int n = 0; n < MMQ_NT; n++)
        UNROLL for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    for (int kb0 = 0; kb0 < nsub; kb0 += MMQ_KC) {
        int kc = nsub - kb0 < MMQ_KC ? nsub - kb0 : MMQ_KC;
        __syncthreads();  // every warp is done with the previous chunk's tile
        // token t's kc blocks are kc * XW consecutive words in xq
        for (int i = threadIdx.x; i < MMQ_TOKENS * kc * XW; i += blockDim.x) {
            int t = i / (kc * XW), r = i % (kc * XW);
            int tok = t0 + t < ntok ? t0 + t : ntok - 1;
            const u8* src = xq + (unsigned long long)tok * xs + (unsigned long long)kb0 * Q8A_BYTES;
            xt[(r / XW) * MMQ_TOKENS * XW + t * XW + r % XW] = (int)ld_u32_a4(src + 4 * r);
        }
        __syncthreads();
        for (int c = 0; c < kc; c++) {
            int kb = kb0 + c;
            unsigned long long off = (unsigned long long)(kb / (QK / 32)) * BYTES;
            int sb = kb % (QK / 32);
            int a[4];
            float sa0, sa1, ca, sb0, sb1, cb;
            LOAD(wa + off, sb, q, &a[0], &a[2], &sa0, &sa1, &ca);
            LOAD(wb + off, sb, q, &a[1], &a[3], &sb0, &sb1, &cb);
            const int* xc = xt + c * MMQ_TOKENS * XW;
            UNROLL for (int n = 0; n < MMQ_NT; n++) {
                const int* xb = xc + (8 * n + g) * XW;      // B: token 8n + g
                const int* x0 = xc + (8 * n + 2 * q) * XW;  // c's tokens 8n + 2q, 8n + 2q + 1
                const int* x1 = x0 + XW;
                float d0 = __uint_as_float((u32)x0[0]), d1 = __uint_as_float((u32)x1[0]);
                float m0 = __uint_as_float((u32)x0[1]), m1 = __uint_as_float((u32)x1[1]);
                int lo[4] = {0, 0, 0, 0};
                if (SPLIT) {
                    int hi[4] = {0, 0, 0, 0};
                    mma_k16(lo, a[0], a[1], xb[2 + q]);
                    mma_k16(hi, a[2], a[3], xb[6 + q]);
                    acc[n][0] += d0 * (sa0 * (float)lo[0] + sa1 * (float)hi[0]) + ca * m0;
                    acc[n][1] += d1 * (sa0 * (float)lo[1] + sa1 * (float)hi[1]) + ca * m1;
                    acc[n][2] += d0 * (sb0 * (float)lo[2] + sb1 * (float)hi[2]) + cb * m0;
                    acc[n][3] += d1 * (sb0 * (float)lo[3] + sb1 * (float)hi[3]) + cb * m1;
                } else {
                    mma_k32(lo, a[0], a[1], a[2], a[3], xb[2 + q], xb[6 + q]);
                    acc[n][0] += sa0 * d0 * (float)lo[0] + ca * m0;
                    acc[n][1] += sa0 * d1 * (float)lo[1] + ca * m1;
                    acc[n][2] += sb0 * d0 * (float)lo[2] + cb * m0;
                    acc[n][3] += sb0 * d1 * (float)lo[3] + cb * m1;
                }
            }
        }
    }
    UNROLL for (int n = 0; n < MMQ_NT; n++) {
        int t = t0 + 8 * n + 2 * q;
        UNROLL for (int i = 0; i < 4; i++) {
            int r = i < 2 ? ra : rb, tt = t + (i & 1);
            if (r < rows && tt < ntok) y[(unsigned long long)tt * rows + r] = acc[n][i];
        }
    }
}

#define MMQ_KERNEL(NAME, QK, BYTES, SPLIT)                                                  \
    extern "C" __global__ void mmq_##NAME(const u8* __restrict__ xq, int cols, int ntok,    \
                                          const u8* __restrict__ w, float* __restrict__ y,  \
                                          int rows) {                                       \
        __shared__ int xt[MMQ_KC * MMQ_TOKENS * (Q8A_BYTES / 4)];                           \
        mmq_tiles<QK, BYTES, mmq_w_##NAME, SPLIT>(xq, cols, ntok, w, y, rows, xt);          \
    }

MMQ_KERNEL(q4_0, Q4_0_QK, Q4_0_BYTES, false)
MMQ_KERNEL(q4_1, Q4_1_QK, Q4_1_BYTES, false)
MMQ_KERNEL(q5_0, Q5_0_QK, Q5_0_BYTES, false)
MMQ_KERNEL(q5_1, Q5_1_QK, Q5_1_BYTES, false)
MMQ_KERNEL(q8_0, Q8_0_QK, Q8_0_BYTES, false)
MMQ_KERNEL(q4_k, Q4_K_QK, Q4_K_BYTES, false)
MMQ_KERNEL(q5_k, Q5_K_QK, Q5_K_BYTES, false)
MMQ_KERNEL(q6_k, Q6_K_QK, Q6_K_BYTES, true)
MMQ_KERNEL(mxfp4, MXFP4_QK, MXFP4_BYTES, false)
MMQ_KERNEL(iq4_nl, IQ4_NL_QK, IQ4_NL_BYTES, false)
MMQ_KERNEL(iq4_xs, IQ4_XS_QK, IQ4_XS_BYTES, false)
