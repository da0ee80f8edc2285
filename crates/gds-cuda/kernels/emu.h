// CPU emulation of the CUDA subset the kernels use, so that the same .cu sources compile as
// C++ and run in tests (crates/gds-cuda/tests/emu.rs). Not for speed: a launch runs the
// blocks one after another, and every thread of a block as its own OS thread, so that
// __syncthreads() and warp shuffles are real barriers between concurrently running threads.
//
// Emulated: __global__/__device__/__forceinline__, __shared__ (a static local: one copy,
// which is right because only one block runs at a time), threadIdx/blockIdx (thread-local)
// and blockDim/gridDim, __syncthreads, __shfl_xor_sync on float (a block-wide exchange:
// every thread of the block must reach it, which the kernels guarantee), __uint_as_float,
// rsqrtf, expf/fmaxf (from <cmath>).
#pragma once
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

static thread_local dim3 threadIdx(0, 0, 0);
static thread_local dim3 blockIdx(0, 0, 0);
static dim3 blockDim;
static dim3 gridDim;

namespace emu {
// A reusable barrier for the threads of one block (C++11: no std::barrier needed).
struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    unsigned n = 0, count = 0, generation = 0;
    void wait() {
        std::unique_lock<std::mutex> lock(m);
        unsigned gen = generation;
        if (++count == n) {
            count = 0;
            generation++;
            cv.notify_all();
        } else {
            cv.wait(lock, [&] { return gen != generation; });
        }
    }
};
static Barrier block_barrier;
// One launch at a time per process: blockDim, the barrier and the shuffle slots are global
// (tests call kernels from several threads).
static std::mutex launch_lock;
static float shuffle_slots[1024];
inline unsigned linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier.wait(); }

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

// kernel<<<grid, block>>>(args...), synchronously. One OS thread per thread of a block; the
// same threads run every block in turn, with a barrier between blocks (so a block's
// __shared__ storage is free again before the next one starts).
template <typename... P, typename... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    std::lock_guard<std::mutex> one_launch(emu::launch_lock);
    gridDim = grid;
    blockDim = block;
    unsigned nt = block.x * block.y * block.z;
    emu::block_barrier.n = nt;
    std::vector<std::thread> threads;
    threads.reserve(nt);
    for (unsigned tz = 0; tz < block.z; tz++)
        for (unsigned ty = 0; ty < block.y; ty++)
            for (unsigned tx = 0; tx < block.x; tx++)
                threads.emplace_back([=] {
                    threadIdx = dim3(tx, ty, tz);
                    for (unsigned bz = 0; bz < grid.z; bz++)
                        for (unsigned by = 0; by < grid.y; by++)
                            for (unsigned bx = 0; bx < grid.x; bx++) {
                                blockIdx = dim3(bx, by, bz);
                                kernel(args...);
                                __syncthreads();
                            }
                });
    for (auto& t : threads) t.join();
}
