// CPU emulation of the CUDA subset the kernels use, so that the same .cu sources compile as
// C++ and run in tests (crates/gds-cuda/tests/it/emu.rs). Not for speed, but not wasteful: a
// launch runs the blocks one after another, and the threads of a block as cooperative
// fibers on the calling OS thread (a register switch on x86-64, ucontext elsewhere).
// __syncthreads() switches to the next fiber of the block; when every fiber has reached
// it, the first one resumes. So a barrier is a real barrier (no thread passes it before
// all have reached it, and what was written before it is read after it), and the
// kernels' barrier discipline is what makes them run at all: a thread that skips a barrier
// the others reach desynchronises the block.
//
// Emulated: __global__/__device__/__forceinline__, __shared__ (a static local: one copy,
// which is right because only one block runs at a time), threadIdx/blockIdx (set at each
// switch) and blockDim/gridDim, __syncthreads, __shfl_xor_sync on float (a block-wide
// exchange: every thread of the block must reach it, which the kernels guarantee),
// __uint_as_float/__float_as_uint, rsqrtf, __dp4a (int8 dot product of 4 lanes, signed), expf/fmaxf/tanhf/
// fabsf/rintf (from <cmath>; rintf rounds ties to even, as on the GPU). Word loads of the
// int8 kernels are checked for the alignment the GPU requires (ALIGNED_LOAD in common.cuh):
// a misaligned one aborts the test instead of faulting on the device.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __constant__ static
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

static dim3 threadIdx(0, 0, 0);
static dim3 blockIdx(0, 0, 0);
static dim3 blockDim;
static dim3 gridDim;

namespace emu {
// One launch at a time per loaded library: the fibers, blockDim and the shuffle slots are
// global (tests call kernels from several threads, and load one copy of the library per
// core to emulate side by side: tests/it/common/mod.rs).
static std::mutex launch_lock;
static float shuffle_slots[1024];
inline unsigned linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
const size_t FIBER_STACK = 64 * 1024;
// The kernel call of the running launch, for every fiber of the block.
static std::function<void()> body;
static unsigned current;

#if defined(__x86_64__) && defined(__GNUC__)
// x86-64: fibers switch with the few instructions below. swapcontext also saves and
// restores the signal mask, one rt_sigprocmask system call per switch (two per fiber per
// barrier), which was a third of the emulated tests' time, all of it in the kernel.
//
// switch_stack(from, to): pushes the callee-saved registers (the System V ABI's: rbp, rbx,
// r12-r15) on the running stack, stores the stack pointer in *from, loads `to` (a pointer
// stored by an earlier switch, or made by fiber_stack) and pops the other context's
// registers; its `ret` resumes that context. The kernels change neither MXCSR nor the x87
// control word, the other callee-saved state, so they are not switched.
__attribute__((naked, noinline)) static void switch_stack(void** /*from*/, void* /*to*/) {
    __asm__ volatile(
        "pushq %rbp\n\t"
        "pushq %rbx\n\t"
        "pushq %r12\n\t"
        "pushq %r13\n\t"
        "pushq %r14\n\t"
        "pushq %r15\n\t"
        "movq %rsp, (%rdi)\n\t"
        "movq %rsi, %rsp\n\t"
        "popq %r15\n\t"
        "popq %r14\n\t"
        "popq %r13\n\t"
        "popq %r12\n\t"
        "popq %rbx\n\t"
        "popq %rbp\n\t"
        "ret\n\t");
}

struct Fiber {
    void* sp;
    std::vector<char> stack;
    dim3 idx;
    bool done;
};
static void* scheduler_sp;
static std::vector<Fiber> fibers;

// Where a new fiber's first switch returns to: runs the kernel, then goes back to the
// scheduler for good (the fiber is made anew for the next block).
static void fiber_entry() {
    body();
    fibers[current].done = true;
    switch_stack(&fibers[current].sp, scheduler_sp);
    __builtin_unreachable();
}

// A fresh stack for fiber `f` whose first switch enters fiber_entry as a call would: six
// zeroed registers to pop, fiber_entry's address for the `ret`, and below the 16-byte
// aligned top one slot, so that fiber_entry starts with rsp = 8 (mod 16) as the ABI has it.
inline void fiber_start(Fiber& f) {
    f.stack.resize(FIBER_STACK);
    uintptr_t top = (uintptr_t)(f.stack.data() + f.stack.size()) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)&fiber_entry;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    f.sp = sp;
}
inline void fiber_resume(Fiber& f) { switch_stack(&scheduler_sp, f.sp); }
inline void fiber_yield() { switch_stack(&fibers[current].sp, scheduler_sp); }
#else
// Elsewhere: ucontext (one signal-mask system call per switch).
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    dim3 idx;
    bool done;
};
static ucontext_t scheduler;
static std::vector<Fiber> fibers;
static void fiber_main() {
    body();
    fibers[current].done = true;
    // returning resumes the scheduler (uc_link)
}
inline void fiber_start(Fiber& f) {
    f.stack.resize(FIBER_STACK);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, fiber_main, 0);
}
inline void fiber_resume(Fiber& f) { swapcontext(&scheduler, &f.ctx); }
inline void fiber_yield() { swapcontext(&fibers[current].ctx, &scheduler); }
#endif
}  // namespace emu

// The running fiber waits here until every fiber of the block has arrived.
inline void __syncthreads() { emu::fiber_yield(); }

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
    unsigned t = emu::linear_tid();
    emu::shuffle_slots[t] = v;
    __syncthreads();
    float r = emu::shuffle_slots[(t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask)];
    __syncthreads();
    return r;
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// c + the sum of the products of the four signed bytes of a and b.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) {
        c += (int)(signed char)(unsigned char)((unsigned)a >> (8 * i))
             * (int)(signed char)(unsigned char)((unsigned)b >> (8 * i));
    }
    return c;
}

// The tensor cores' warp-wide int8 products (common.cuh documents the fragments): every
// lane leaves its registers in a block-wide slot, all meet at a barrier, each computes its
// own four sums of its warp's fragments, and all meet again before the slots are reused.
namespace emu {
static int mma_slots[1024][6];
// Byte k (0..3) of a register, as the signed value the instruction reads.
inline int sbyte(int r, int k) { return (int)(signed char)(unsigned char)((unsigned)r >> (8 * k)); }
}  // namespace emu
// ksz: 32 (a0..a3, b0, b1) or 16 (a0, a1, b0).
inline void emu_mma_s8(int* c, const int* a, const int* b, int ksz) {
    unsigned t = emu::linear_tid();
    for (int i = 0; i < 4; i++) emu::mma_slots[t][i] = a[i];
    emu::mma_slots[t][4] = b[0];
    emu::mma_slots[t][5] = b[1];
    __syncthreads();
    unsigned w0 = t & ~31u, lane = t & 31u, g = lane >> 2, q = lane & 3u;
    for (int r = 0; r < 4; r++) {
        int row = (int)g + 8 * (r >> 1), col = 2 * (int)q + (r & 1);
        int s = 0;
        for (int k = 0; k < ksz; k++) {
            // A(row, k): lane (row % 8) * 4 + (k % 16) / 4, register (row >= 8) + 2 (k >= 16)
            const int* sa = emu::mma_slots[w0 + (unsigned)((row % 8) * 4 + (k % 16) / 4)];
            int av = emu::sbyte(sa[(row >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0)], k % 4);
            // B(k, col): lane col * 4 + (k % 16) / 4, register 4 + (k >= 16)
            const int* sb = emu::mma_slots[w0 + (unsigned)(col * 4 + (k % 16) / 4)];
            int bv = emu::sbyte(sb[4 + (k >= 16 ? 1 : 0)], k % 4);
            s += av * bv;
        }
        c[r] += s;
    }
    __syncthreads();
}
inline void mma_k32(int* c, int a0, int a1, int a2, int a3, int b0, int b1) {
    int a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    emu_mma_s8(c, a, b, 32);
}
inline void mma_k16(int* c, int a0, int a1, int b0) {
    int a[4] = {a0, a1, 0, 0}, b[2] = {b0, 0};
    emu_mma_s8(c, a, b, 16);
}

#include <cstdio>
#include <cstdlib>
#include <cstdint>
#define UNROLL
#define ALIGNED_LOAD(p, n)                                                                   \
    do {                                                                                    \
        if ((uintptr_t)(p) % (n) != 0) {                                                    \
            std::fprintf(stderr, "misaligned %d-byte load at %p (%s:%d)\n", (int)(n),       \
                         (const void*)(p), __FILE__, __LINE__);                             \
            std::abort();                                                                   \
        }                                                                                   \
    } while (0)

// kernel<<<grid, block>>>(args...), synchronously: for each block, one fiber per thread,
// run in rounds from barrier to barrier (fiber 0 .. n-1 each up to its next barrier, or to
// its end) until all have returned.
template <typename... P, typename... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    std::lock_guard<std::mutex> one_launch(emu::launch_lock);
    gridDim = grid;
    blockDim = block;
    unsigned nt = block.x * block.y * block.z;
    if (emu::fibers.size() < nt) emu::fibers.resize(nt);
    emu::body = [=] { kernel(args...); };
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3(bx, by, bz);
                for (unsigned i = 0; i < nt; i++) {
                    emu::Fiber& f = emu::fibers[i];
                    f.idx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
                    f.done = false;
                    emu::fiber_start(f);
                }
                for (bool running = true; running;) {
                    running = false;
                    for (unsigned i = 0; i < nt; i++) {
                        if (emu::fibers[i].done) continue;
                        emu::current = i;
                        threadIdx = emu::fibers[i].idx;
                        emu::fiber_resume(emu::fibers[i]);
                        running = running || !emu::fibers[i].done;
                    }
                }
            }
}
