// The graph's ops (crates/gds-runtime/src/graph) on f32 activations, row by row. The CPU
// backend's formulas (crates/gds-runtime: ops.rs, rope.rs, attention.rs) are the reference.

// out[t, i] = x[t, i] * w[i] / sqrt(mean_i(x[t, i]^2) + eps). Grid: one block per row (a
// token's row, or one head of it for the per-head Q/K norms), BLOCK_THREADS. `out` may be
// `x`: each thread reads and then writes only its own elements, the sum in between.
// 1 / sqrt(mean(x[0..n]^2) + eps), in every thread of the block.
__device__ __forceinline__ float rms_factor(const float* xr, int n, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    return rsqrtf(ss / (float)n + eps);
}

extern "C" __global__ void rmsnorm(const float* x, const float* __restrict__ w, float* out,
                                   int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (unsigned long long)blockIdx.x * n;
    float* yr = out + (unsigned long long)blockIdx.x * n;
    float r = rms_factor(xr, n, eps, scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r * w[i];
}

// rmsnorm, and its output quantized into xq as quantize_q8 would (row t's n / 32 blocks at
// block t * n / 32): the norm and the int8 products' input in one launch. n % 32 == 0, so
// each warp's 32 consecutive elements are one activation block, all there or none. The
// rounds are the same in every thread (the reductions are reached by all).
extern "C" __global__ void rmsnorm_q8(const float* x, const float* __restrict__ w, float* out,
                                      u8* __restrict__ xq, int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (unsigned long long)blockIdx.x * n;
    float* yr = out + (unsigned long long)blockIdx.x * n;
    u8* qr = xq + (unsigned long long)blockIdx.x * (n / 32) * Q8A_BYTES;
    float r = rms_factor(xr, n, eps, scratch);
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        int i = i0 + threadIdx.x;
        bool in = i < n;
        float v = in ? xr[i] * r * w[i] : 0.0f;
        if (in) yr[i] = v;
        q8_store_block(v, qr + (unsigned long long)(i / 32) * Q8A_BYTES, in);
    }
}

// Rotary embedding, in place on x[t, head, head_dim] for token t at position pos[t], of
// the first 2 * half dimensions of each head (partial rotary: the rest pass unchanged).
// neox = 0: ggml's "normal" mode, adjacent pairs (2i, 2i+1) (llama's Q/K rows are stored
// permuted for it); neox = 1: the halves (i, i + half) (Gemma, Qwen, Phi; HF's rotate_half).
// cos/sin tables are [position][half], computed once on the host exactly as the CPU
// RopeTable does (scaling, LongRoPE factors included). Grid ntok, block BLOCK_THREADS.
__device__ __forceinline__ void rope_row(float* __restrict__ xt, const float* __restrict__ c,
                                         const float* __restrict__ s, int n_heads,
                                         int head_dim, int half, int neox) {
    for (int p = threadIdx.x; p < n_heads * half; p += blockDim.x) {
        int h = p / half, i = p % half;
        float* a = xt + h * head_dim + (neox ? i : 2 * i);
        float* b = neox ? a + half : a + 1;
        float x0 = *a, x1 = *b;
        *a = x0 * c[i] - x1 * s[i];
        *b = x0 * s[i] + x1 * c[i];
    }
}

extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, int n_heads, int head_dim,
                                int half, int neox, const int* __restrict__ pos) {
    int t = blockIdx.x;
    rope_row(x + (unsigned long long)t * n_heads * head_dim,
             cos_t + (unsigned long long)pos[t] * half, sin_t + (unsigned long long)pos[t] * half,
             n_heads, head_dim, half, neox);
}

// The KV cache is paged: a layer's keys (and values) are blocks of `block` rows of
// [n_kv_heads * head_dim], and each sequence of the pass has a table of block numbers
// (`tables + seq * max_blocks`, seq = the token's row of the pass's tables). Position p of a
// sequence is row p % block of block table[p / block], or with ring > 0 (a sliding-window
// layer's ring of `ring` blocks per sequence) table[(p / block) % ring]. A single sequence's
// contiguous cache is one block of the whole context (or of the ring's rows, ring = 1).
__device__ __forceinline__ unsigned long long kv_row(const int* table, int p, int block,
                                                     int ring) {
    int i = p / block;
    if (ring > 0) i %= ring;
    return (unsigned long long)table[i] * block + p % block;
}

// A KV cache element: f32 (exact) or IEEE f16 (`--kv-type f16`: half the VRAM and half the
// bytes attention reads; rounded to nearest even as the CPU's f16 cache rounds).
__device__ __forceinline__ float kv_ld(const float* p) { return *p; }
__device__ __forceinline__ float kv_ld(const u16* p) { return f16_to_f32(*p); }
__device__ __forceinline__ void kv_st(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_st(u16* p, float x) { *p = f32_to_f16(x); }

// Stores the pass's new keys and values (k, v: [t][kv_dim]) at their tokens' rows of the
// caches kc, vc. Grid ntok, block BLOCK_THREADS. kv_store: f32 caches; kv_store_f16: f16.
template <typename KV>
__device__ __forceinline__ void kv_store_body(const float* __restrict__ k,
                                              const float* __restrict__ v, KV* __restrict__ kc,
                                              KV* __restrict__ vc, int kv_dim,
                                              const int* __restrict__ pos,
                                              const int* __restrict__ seq,
                                              const int* __restrict__ tables, int max_blocks,
                                              int block, int ring) {
    int t = blockIdx.x;
    unsigned long long row =
        kv_row(tables + (unsigned long long)seq[t] * max_blocks, pos[t], block, ring);
    const float* ks = k + (unsigned long long)t * kv_dim;
    const float* vs = v + (unsigned long long)t * kv_dim;
    KV* kd = kc + row * kv_dim;
    KV* vd = vc + row * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kv_st(kd + i, ks[i]);
        kv_st(vd + i, vs[i]);
    }
}

extern "C" __global__ void kv_store(const float* __restrict__ k, const float* __restrict__ v,
                                    float* __restrict__ kc, float* __restrict__ vc, int kv_dim,
                                    const int* __restrict__ pos, const int* __restrict__ seq,
                                    const int* __restrict__ tables, int max_blocks, int block,
                                    int ring) {
    kv_store_body(k, v, kc, vc, kv_dim, pos, seq, tables, max_blocks, block, ring);
}

extern "C" __global__ void kv_store_f16(const float* __restrict__ k, const float* __restrict__ v,
                                        u16* __restrict__ kc, u16* __restrict__ vc, int kv_dim,
                                        const int* __restrict__ pos, const int* __restrict__ seq,
                                        const int* __restrict__ tables, int max_blocks,
                                        int block, int ring) {
    kv_store_body(k, v, kc, vc, kv_dim, pos, seq, tables, max_blocks, block, ring);
}

// rope of the queries q (n_heads) and the new keys k (n_kv_heads) of token t, then k and v
// stored at the token's cache rows (kv_store): a decode step's three launches in one. The
// barrier orders each thread's RoPE writes before the others read k for the store. Grid
// ntok, block BLOCK_THREADS. rope_kv: f32 caches; rope_kv_f16: f16.
template <typename KV>
__device__ __forceinline__ void rope_kv_body(
    float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v,
    KV* __restrict__ kc, KV* __restrict__ vc, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, int n_heads, int n_kv_heads, int head_dim, int half,
    int neox, const int* __restrict__ pos, const int* __restrict__ seq,
    const int* __restrict__ tables, int max_blocks, int block, int ring) {
    int t = blockIdx.x;
    const float* c = cos_t + (unsigned long long)pos[t] * half;
    const float* s = sin_t + (unsigned long long)pos[t] * half;
    rope_row(q + (unsigned long long)t * n_heads * head_dim, c, s, n_heads, head_dim, half, neox);
    rope_row(k + (unsigned long long)t * n_kv_heads * head_dim, c, s, n_kv_heads, head_dim, half,
             neox);
    __syncthreads();
    kv_store_body(k, v, kc, vc, n_kv_heads * head_dim, pos, seq, tables, max_blocks, block, ring);
}

#define ROPE_KV_KERNEL(NAME, KV)                                                            \
    extern "C" __global__ void NAME(                                                        \
        float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v,          \
        KV* __restrict__ kc, KV* __restrict__ vc, const float* __restrict__ cos_t,          \
        const float* __restrict__ sin_t, int n_heads, int n_kv_heads, int head_dim,         \
        int half, int neox, const int* __restrict__ pos, const int* __restrict__ seq,       \
        const int* __restrict__ tables, int max_blocks, int block, int ring) {              \
        rope_kv_body(q, k, v, kc, vc, cos_t, sin_t, n_heads, n_kv_heads, head_dim, half,    \
                     neox, pos, seq, tables, max_blocks, block, ring);                      \
    }

ROPE_KV_KERNEL(rope_kv, float)
ROPE_KV_KERNEL(rope_kv_f16, u16)

// Causal attention of ntok queries, token t at position pos[t] of sequence seq[t], against
// the paged caches kc, vc (see kv_row) that already hold every position the queries see
// (kv_store ran first). q, out: [t][n_heads * head_dim]. att: scratch of
// [ntok * n_heads][n_ctx], indexed by position. Grouped-query: head h reads kv head
// h / (n_heads / n_kv_heads). Scores are q·k * scale, then softcap * tanh(s / softcap) where
// softcap > 0 (Gemma 2); window > 0: a query at position p sees only keys above p - window
// (sliding-window layers). sinks, where not null (gpt-oss): one more logit per query head,
// sinks[h], in the softmax's maximum and denominator, with no value (the CPU's `merge`).
// Grid (n_heads, ntok), block BLOCK_THREADS. attention: f32 caches; attention_f16: f16
// (each element widened to f32 as it is read; the arithmetic is the same).
template <typename KV>
__device__ __forceinline__ void attention_body(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
    float* __restrict__ att, float* __restrict__ out, int n_heads, int n_kv_heads,
    int head_dim, const int* __restrict__ pos, const int* __restrict__ seq,
    const int* __restrict__ tables, int max_blocks, int block, int ring, int n_ctx,
    float scale, int window, float softcap, const float* __restrict__ sinks) {
    __shared__ float scratch[32];
    int h = blockIdx.x, t = blockIdx.y;
    int kvh = h / (n_heads / n_kv_heads);
    int kv_stride = n_kv_heads * head_dim;
    int n_pos = pos[t] + 1;
    int first = (window > 0 && n_pos > window) ? n_pos - window : 0;
    const int* table = tables + (unsigned long long)seq[t] * max_blocks;
    const float* qh = q + ((unsigned long long)t * n_heads + h) * head_dim;
    float* a = att + ((unsigned long long)t * n_heads + h) * n_ctx;

    float mx = -3.402823466e38f;
    for (int p = first + threadIdx.x; p < n_pos; p += blockDim.x) {
        const KV* kp = kc + kv_row(table, p, block, ring) * kv_stride + kvh * head_dim;
        float s = 0.0f;
        for (int d = 0; d < head_dim; d++) s += qh[d] * kv_ld(kp + d);
        s *= scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        a[p] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, scratch);
    if (sinks) mx = fmaxf(mx, sinks[h]);
    float sum = 0.0f;
    for (int p = first + threadIdx.x; p < n_pos; p += blockDim.x) {
        float e = expf(a[p] - mx);
        a[p] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    if (sinks) sum += expf(sinks[h] - mx);
    float inv = 1.0f / sum;
    __syncthreads();  // every a[p] written before any thread reads them all
    float* oh = out + ((unsigned long long)t * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const KV* vp = vc + kvh * head_dim + d;
        float acc = 0.0f;
        // block by block: one table lookup per block, the positions in order
        for (int p = first; p < n_pos;) {
            unsigned long long row = kv_row(table, p, block, ring);
            int end = p - p % block + block;
            if (end > n_pos) end = n_pos;
            for (; p < end; p++, row++) acc += a[p] * kv_ld(vp + row * kv_stride);
        }
        oh[d] = acc * inv;
    }
}

extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ kc,
                                     const float* __restrict__ vc, float* __restrict__ att,
                                     float* __restrict__ out, int n_heads, int n_kv_heads,
                                     int head_dim, const int* __restrict__ pos,
                                     const int* __restrict__ seq, const int* __restrict__ tables,
                                     int max_blocks, int block, int ring, int n_ctx, float scale,
                                     int window, float softcap, const float* __restrict__ sinks) {
    attention_body(q, kc, vc, att, out, n_heads, n_kv_heads, head_dim, pos, seq, tables,
                   max_blocks, block, ring, n_ctx, scale, window, softcap, sinks);
}

extern "C" __global__ void attention_f16(const float* __restrict__ q, const u16* __restrict__ kc,
                                         const u16* __restrict__ vc, float* __restrict__ att,
                                         float* __restrict__ out, int n_heads, int n_kv_heads,
                                         int head_dim, const int* __restrict__ pos,
                                         const int* __restrict__ seq,
                                         const int* __restrict__ tables, int max_blocks,
                                         int block, int ring, int n_ctx, float scale,
                                         int window, float softcap,
                                         const float* __restrict__ sinks) {
    attention_body(q, kc, vc, att, out, n_heads, n_kv_heads, head_dim, pos, seq, tables,
                   max_blocks, block, ring, n_ctx, scale, window, softcap, sinks);
}

// dst[r, :] = src[rows[r], :] for nrows rows of n floats (the output head's positions of a
// pass). Grid nrows, block BLOCK_THREADS.
extern "C" __global__ void gather_rows(float* __restrict__ dst, const float* __restrict__ src,
                                       const int* __restrict__ rows, int n) {
    int r = blockIdx.x;
    const float* s = src + (unsigned long long)rows[r] * n;
    float* d = dst + (unsigned long long)r * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

// dst[rows[r], :] += w[r] * src[r, :] for nrows rows of n floats: an expert's outputs added
// to its tokens' rows by their router weights (rows, then the weights' f32 bits, in one i32
// array of 2 * nrows). The rows of one launch are distinct tokens. Grid nrows, block
// BLOCK_THREADS.
extern "C" __global__ void scatter_add_rows(float* __restrict__ dst, const float* __restrict__ src,
                                            const int* __restrict__ rows, int n, int nrows) {
    int r = blockIdx.x;
    float w = __uint_as_float((unsigned)rows[nrows + r]);
    float* d = dst + (unsigned long long)rows[r] * n;
    const float* s = src + (unsigned long long)r * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] += w * s[i];
}

// The gated activations, gate[i] = act(gate[i], up[i]):
// - swiglu: silu(g) * u;
// - swiglu_oai: gpt-oss's clamped SwiGLU, g = min(gate, 7), g * sigmoid(1.702 g) *
//   (clamp(up, -7, 7) + 1) (llama.cpp's swiglu_oai);
// - geglu: gelu_tanh(g) * u (GeGLU, Gemma).
__device__ __forceinline__ float act_swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ float act_swiglu_oai(float g, float u) {
    g = fminf(g, 7.0f);
    u = fminf(fmaxf(u, -7.0f), 7.0f);
    return g / (1.0f + expf(-1.702f * g)) * (u + 1.0f);
}
__device__ __forceinline__ float act_geglu(float g, float u) {
    return 0.5f * g * (1.0f + tanhf(0.7978846f * g * (1.0f + 0.044715f * g * g))) * u;
}

// NAME(gate, up, n): the activation over n floats, grid ceil(n / BLOCK_THREADS). NAME_q8(gate,
// up, xq, n): the same, and its output quantized into xq as quantize_q8 would (n % 32 == 0:
// each warp's 32 elements are one activation block, all there or none), the down
// projection's int8 input in the same launch.
#define GLU_KERNELS(NAME, ACT)                                                              \
    extern "C" __global__ void NAME(float* __restrict__ gate, const float* __restrict__ up,  \
                                    int n) {                                                \
        int i = blockIdx.x * blockDim.x + threadIdx.x;                                      \
        if (i < n) gate[i] = ACT(gate[i], up[i]);                                           \
    }                                                                                       \
    extern "C" __global__ void NAME##_q8(float* __restrict__ gate,                          \
                                         const float* __restrict__ up, u8* __restrict__ xq, \
                                         int n) {                                           \
        int i = blockIdx.x * blockDim.x + threadIdx.x;                                      \
        bool in = i < n;                                                                    \
        float v = in ? ACT(gate[i], up[i]) : 0.0f;                                          \
        if (in) gate[i] = v;                                                                \
        q8_store_block(v, xq + (unsigned long long)(i / 32) * Q8A_BYTES, in);               \
    }

GLU_KERNELS(swiglu, act_swiglu)
GLU_KERNELS(swiglu_oai, act_swiglu_oai)
GLU_KERNELS(geglu, act_geglu)

// y[t, i] += b[i] for ntok rows of n (biases). Grid ceil(ntok * n / BLOCK_THREADS).
extern "C" __global__ void add_rows(float* __restrict__ y, const float* __restrict__ b, int n,
                                    int ntok) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)n * ntok) y[i] += b[i % n];
}

// x[i] *= s (Gemma's embedding scale). Grid ceil(n / BLOCK_THREADS).
extern "C" __global__ void scale_inplace(float* __restrict__ x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x[i] = cap * tanh(x[i] / cap) (Gemma 2's final logit cap). Grid ceil(n / BLOCK_THREADS).
extern "C" __global__ void softcap_inplace(float* __restrict__ x, float cap, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// y[i] += x[i] (residual connections). Grid ceil(n / BLOCK_THREADS).
extern "C" __global__ void add_inplace(float* __restrict__ y, const float* __restrict__ x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

// to_f16(x, y, n): y[i] = f32_to_f16_sat(x[i]), an f16 GEMM's activations. Grid
// ceil(n / BLOCK_THREADS), block BLOCK_THREADS.
extern "C" __global__ void to_f16(const float* __restrict__ x, u16* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_f16_sat(x[i]);
}
