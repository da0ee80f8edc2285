// The kernels of crates/gds-cuda/kernels compiled as C++ on the CPU (kernels/emu.h), with
// one C entry point per kernel launching it the way the executor does (same grid and
// block shapes). Built into a shared library by tests/emu.rs.
#include "emu.h"
#include "common.cuh"
#include "quant.cu"
#include "ops.cu"

static unsigned cdiv(unsigned a, unsigned b) { return (a + b - 1) / b; }

#define MATVEC_ENTRY(NAME)                                                                  \
    extern "C" void run_matvec_##NAME(const u8* w, const float* x, float* y, int rows,      \
                                      int cols, int ntok) {                                 \
        emu_launch(matvec_##NAME, dim3(cdiv(rows, MATVEC_ROWS)), dim3(WARP, MATVEC_ROWS), w, \
                   x, y, rows, cols, ntok);                                                 \
    }                                                                                       \
    extern "C" void run_dequant_##NAME(const u8* src, float* dst, int nblocks) {            \
        emu_launch(dequant_##NAME, dim3(cdiv(nblocks, BLOCK_THREADS)), dim3(BLOCK_THREADS), \
                   src, dst, nblocks);                                                      \
    }                                                                                       \
    extern "C" void run_dequant16_##NAME(const u8* src, u16* dst, int nblocks) {            \
        emu_launch(dequant16_##NAME, dim3(cdiv(nblocks, BLOCK_THREADS)),                    \
                   dim3(BLOCK_THREADS), src, dst, nblocks);                                 \
    }

MATVEC_ENTRY(q4_0)
MATVEC_ENTRY(q4_1)
MATVEC_ENTRY(q5_0)
MATVEC_ENTRY(q5_1)
MATVEC_ENTRY(q8_0)
MATVEC_ENTRY(q4_k)
MATVEC_ENTRY(q5_k)
MATVEC_ENTRY(q6_k)
MATVEC_ENTRY(mxfp4)
MATVEC_ENTRY(iq4_nl)
MATVEC_ENTRY(iq4_xs)
MATVEC_ENTRY(f16)
MATVEC_ENTRY(bf16)
MATVEC_ENTRY(f32)

extern "C" void run_quantize_q8(const float* x, u8* xq, int nblocks) {
    emu_launch(quantize_q8, dim3(cdiv(nblocks, BLOCK_THREADS / WARP)), dim3(BLOCK_THREADS), x,
               xq, nblocks);
}

// run_matvec_q8_<t>: one matrix; run_matvec_q8x_<t>: up to three in one launch (rows 0 for
// the ones not there), as the executor launches them.
#define MATVEC_Q8_ENTRY(NAME)                                                               \
    extern "C" void run_matvec_q8x_##NAME(const u8* xq, int cols, int ntok, const u8* w0,   \
                                          float* y0, int rows0, const u8* w1, float* y1,    \
                                          int rows1, const u8* w2, float* y2, int rows2) {  \
        unsigned blocks = cdiv(rows0, MMQ8_ROWS) + cdiv(rows1, MMQ8_ROWS) +                 \
                          cdiv(rows2, MMQ8_ROWS);                                           \
        emu_launch(matvec_q8_##NAME, dim3(blocks), dim3(WARP, MMQ8_WARPS), xq, cols, ntok,  \
                   w0, y0, rows0, w1, y1, rows1, w2, y2, rows2);                            \
    }                                                                                       \
    extern "C" void run_matvec_q8_##NAME(const u8* w, const u8* xq, float* y, int rows,     \
                                         int cols, int ntok) {                              \
        run_matvec_q8x_##NAME(xq, cols, ntok, w, y, rows, (const u8*)0, (float*)0, 0,       \
                              (const u8*)0, (float*)0, 0);                                  \
    }

MATVEC_Q8_ENTRY(q4_0)
MATVEC_Q8_ENTRY(q4_1)
MATVEC_Q8_ENTRY(q5_0)
MATVEC_Q8_ENTRY(q5_1)
MATVEC_Q8_ENTRY(q8_0)
MATVEC_Q8_ENTRY(q4_k)
MATVEC_Q8_ENTRY(q5_k)
MATVEC_Q8_ENTRY(q6_k)
MATVEC_Q8_ENTRY(mxfp4)
MATVEC_Q8_ENTRY(iq4_nl)
MATVEC_Q8_ENTRY(iq4_xs)

extern "C" void run_to_f16(const float* x, u16* y, int n) {
    emu_launch(to_f16, dim3(cdiv(n, BLOCK_THREADS)), dim3(BLOCK_THREADS), x, y, n);
}

extern "C" void run_rmsnorm(const float* x, const float* w, float* out, int n, int ntok,
                            float eps) {
    emu_launch(rmsnorm, dim3(ntok), dim3(BLOCK_THREADS), x, w, out, n, eps);
}

extern "C" void run_rmsnorm_q8(const float* x, const float* w, float* out, u8* xq, int n,
                               int ntok, float eps) {
    emu_launch(rmsnorm_q8, dim3(ntok), dim3(BLOCK_THREADS), x, w, out, xq, n, eps);
}

extern "C" void run_rope(float* x, const float* c, const float* s, int n_heads, int head_dim,
                         int half, int neox, const int* pos, int ntok) {
    emu_launch(rope, dim3(ntok), dim3(BLOCK_THREADS), x, c, s, n_heads, head_dim, half, neox,
               pos);
}

// The caches are f32, or f16 where `f16` (kv_store_f16 / attention_f16).
extern "C" void run_kv_store(const float* k, const float* v, void* kc, void* vc, int kv_dim,
                             int ntok, const int* pos, const int* seq, const int* tables,
                             int max_blocks, int block, int ring, int f16) {
    if (f16) {
        emu_launch(kv_store_f16, dim3(ntok), dim3(BLOCK_THREADS), k, v, (u16*)kc, (u16*)vc,
                   kv_dim, pos, seq, tables, max_blocks, block, ring);
    } else {
        emu_launch(kv_store, dim3(ntok), dim3(BLOCK_THREADS), k, v, (float*)kc, (float*)vc,
                   kv_dim, pos, seq, tables, max_blocks, block, ring);
    }
}

// rope_kv: the caches f32, or f16 where `f16`.
extern "C" void run_rope_kv(float* q, float* k, const float* v, void* kc, void* vc,
                            const float* c, const float* s, int n_heads, int n_kv_heads,
                            int head_dim, int half, int neox, int ntok, const int* pos,
                            const int* seq, const int* tables, int max_blocks, int block,
                            int ring, int f16) {
    if (f16) {
        emu_launch(rope_kv_f16, dim3(ntok), dim3(BLOCK_THREADS), q, k, v, (u16*)kc, (u16*)vc, c,
                   s, n_heads, n_kv_heads, head_dim, half, neox, pos, seq, tables, max_blocks,
                   block, ring);
    } else {
        emu_launch(rope_kv, dim3(ntok), dim3(BLOCK_THREADS), q, k, v, (float*)kc, (float*)vc, c,
                   s, n_heads, n_kv_heads, head_dim, half, neox, pos, seq, tables, max_blocks,
                   block, ring);
    }
}

extern "C" void run_attention(const float* q, const void* kc, const void* vc, float* att,
                              float* out, int n_heads, int n_kv_heads, int head_dim, int ntok,
                              const int* pos, const int* seq, const int* tables, int max_blocks,
                              int block, int ring, int n_ctx, float scale, int window,
                              float softcap, const float* sinks, int f16) {
    if (f16) {
        emu_launch(attention_f16, dim3(n_heads, ntok), dim3(BLOCK_THREADS), q, (const u16*)kc,
                   (const u16*)vc, att, out, n_heads, n_kv_heads, head_dim, pos, seq, tables,
                   max_blocks, block, ring, n_ctx, scale, window, softcap, sinks);
    } else {
        emu_launch(attention, dim3(n_heads, ntok), dim3(BLOCK_THREADS), q, (const float*)kc,
                   (const float*)vc, att, out, n_heads, n_kv_heads, head_dim, pos, seq, tables,
                   max_blocks, block, ring, n_ctx, scale, window, softcap, sinks);
    }
}

extern "C" void run_gather_rows(float* dst, const float* src, const int* rows, int n,
                                int nrows) {
    emu_launch(gather_rows, dim3(nrows), dim3(BLOCK_THREADS), dst, src, rows, n);
}

#define GLU_ENTRY(NAME)                                                                     \
    extern "C" void run_##NAME(float* gate, const float* up, int n) {                       \
        emu_launch(NAME, dim3(cdiv(n, BLOCK_THREADS)), dim3(BLOCK_THREADS), gate, up, n);   \
    }                                                                                       \
    extern "C" void run_##NAME##_q8(float* gate, const float* up, u8* xq, int n) {          \
        emu_launch(NAME##_q8, dim3(cdiv(n, BLOCK_THREADS)), dim3(BLOCK_THREADS), gate, up,  \
                   xq, n);                                                                  \
    }

GLU_ENTRY(swiglu)
GLU_ENTRY(swiglu_oai)
GLU_ENTRY(geglu)

extern "C" void run_scatter_add_rows(float* dst, const float* src, const int* rows, int n,
                                     int nrows) {
    emu_launch(scatter_add_rows, dim3(nrows), dim3(BLOCK_THREADS), dst, src, rows, n, nrows);
}

extern "C" void run_add_inplace(float* y, const float* x, int n) {
    emu_launch(add_inplace, dim3(cdiv(n, BLOCK_THREADS)), dim3(BLOCK_THREADS), y, x, n);
}

extern "C" void run_add_rows(float* y, const float* b, int n, int ntok) {
    emu_launch(add_rows, dim3(cdiv(n * ntok, BLOCK_THREADS)), dim3(BLOCK_THREADS), y, b, n, ntok);
}

extern "C" void run_scale_inplace(float* x, float s, int n) {
    emu_launch(scale_inplace, dim3(cdiv(n, BLOCK_THREADS)), dim3(BLOCK_THREADS), x, s, n);
}

extern "C" void run_softcap_inplace(float* x, float cap, int n) {
    emu_launch(softcap_inplace, dim3(cdiv(n, BLOCK_THREADS)), dim3(BLOCK_THREADS), x, cap, n);
}

// run_mmq_<t>: the int8 tensor-core product of a long pass, launched as the executor does.
#define MMQ_ENTRY(NAME)                                                                     \
    extern "C" void run_mmq_##NAME(const u8* xq, int cols, int ntok, const u8* w, float* y, \
                                   int rows) {                                              \
        emu_launch(mmq_##NAME, dim3(cdiv(rows, MMQ_ROWS), cdiv(ntok, MMQ_TOKENS)),          \
                   dim3(WARP * MMQ_WARPS), xq, cols, ntok, w, y, rows);                     \
    }

MMQ_ENTRY(q4_0)
MMQ_ENTRY(q4_1)
MMQ_ENTRY(q5_0)
MMQ_ENTRY(q5_1)
MMQ_ENTRY(q8_0)
MMQ_ENTRY(q4_k)
MMQ_ENTRY(q5_k)
MMQ_ENTRY(q6_k)
MMQ_ENTRY(mxfp4)
MMQ_ENTRY(iq4_nl)
MMQ_ENTRY(iq4_xs)
