// CPU emulation of the CUDA subset the kernels use, so that the same .cu sources compile as
// C++ and run in tests (crates/gds-cuda/tests/it/emu.rs). Not for speed, but not wasteful: a
// launch runs the blocks one after another, and the threads of a block as cooperative
// fibers (ucontext) on the calling OS thread. __syncthreads() switches to the next fiber
// of the block; when every fiber has reached it, the first one resumes. So a barrier is a
// real barrier (no thread passes it before all have reached it, and what was written
// before it is read after it), and the kernels' barrier discipline is what makes them run
// at all: a thread that skips a barrier the others reach desynchronises the block.
//
// Emulated: __global__/__device__/__forceinline__, __shared__ (a static local: one copy,
// which is right because only one block runs at a time), threadIdx/blockIdx (set at each
// switch) and blockDim/gridDim, __syncthreads, __shfl_xor_sync on float (a block-wide
// exchange: every thread of the block must reach it, which the kernels guarantee),
// __uint_as_float, rsqrtf, __dp4a (int8 dot product of 4 lanes, signed), expf/fmaxf/tanhf/
// fabsf/rintf (from <cmath>; rintf rounds ties to even, as on the GPU). Word loads of the
// int8 kernels are checked for the alignment the GPU requires (ALIGNED_LOAD in common.cuh):
// a misaligned one aborts the test instead of faulting on the device.
#pragma once
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
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
// One fiber per thread of a block, with its own stack (kept across launches).
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    dim3 idx;
    bool done;
};
const size_t FIBER_STACK = 64 * 1024;
static ucontext_t scheduler;
static std::vector<Fiber> fibers;
static unsigned current;
// The kernel call of the running launch, for every fiber of the block.
static std::function<void()> body;
static void fiber_main() {
    body();
    fibers[current].done = true;
    // returning resumes the scheduler (uc_link)
}
// One launch at a time per process: the fibers, blockDim and the shuffle slots are global
// (tests call kernels from several threads).
static std::mutex launch_lock;
static float shuffle_slots[1024];
inline unsigned linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
}  // namespace emu

// The running fiber waits here until every fiber of the block has arrived.
inline void __syncthreads() { swapcontext(&emu::fibers[emu::current].ctx, &emu::scheduler); }

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

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// c + the sum of the products of the four signed bytes of a and b.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) {
        c += (int)(signed char)(unsigned char)((unsigned)a >> (8 * i))
             * (int)(signed char)(unsigned char)((unsigned)b >> (8 * i));
    }
    return c;
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
                    f.stack.resize(emu::FIBER_STACK);
                    f.idx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
                    f.done = false;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = &emu::scheduler;
                    makecontext(&f.ctx, emu::fiber_main, 0);
                }
                for (bool running = true; running;) {
                    running = false;
                    for (unsigned i = 0; i < nt; i++) {
                        if (emu::fibers[i].done) continue;
                        emu::current = i;
                        threadIdx = emu::fibers[i].idx;
                        swapcontext(&emu::scheduler, &emu::fibers[i].ctx);
                        running = running || !emu::fibers[i].done;
                    }
                }
            }
}
