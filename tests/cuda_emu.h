// A CPU emulator for ssmc's generated CUDA C, used by tests/test_cuda_codegen.py to check the
// kernels' numerics without a GPU. Compiled with g++ -std=c++20 -DSSMC_EMULATE -include this.
//
// Blocks run one after another; the threads of a block are OS threads, __syncthreads is a
// barrier of the block, __shfl_up_sync a barrier-synchronised exchange within a warp of 32
// (the kernels call it with all lanes active), the named barriers (bar.sync / bar.arrive with an id
// and a thread count) counters that release a phase at the count. __shared__ is `static` (one
// block at a time).
// bf16/fp16 are bit-exact software types with round-to-nearest-even conversions; the SFU exp2
// is exp2f. What it cannot show: timing, memory-model subtleties, register/resource limits.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define __constant__ static const

struct ssmc_dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local ssmc_dim3 threadIdx, blockIdx;
inline ssmc_dim3 blockDim, gridDim;

namespace ssmc_emu {
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<unsigned char> dyn_smem;
inline std::vector<double> shfl_buf;   // one slot per thread of the block (values fit a double)
inline std::vector<std::uint32_t> mma_buf;   // six words per thread: its mma fragments

// The 16 named barriers of a block: arrivals in the current phase and the phase number.
struct Named {
  std::mutex m;
  std::condition_variable cv;
  unsigned arrived = 0, phase = 0;
};
inline Named named[16];

// One thread arrives at barrier `id` of `count` threads; `wait`: until the phase completes.
inline void named_barrier(int id, int count, bool wait) {
  Named& b = named[id];
  std::unique_lock<std::mutex> lock(b.m);
  const unsigned phase = b.phase;
  if (++b.arrived == unsigned(count)) {
    b.arrived = 0;
    ++b.phase;
    b.cv.notify_all();
  } else if (wait) {
    b.cv.wait(lock, [&] { return b.phase != phase; });
  }
}
inline void named_sync(int id, int count) { named_barrier(id, count, true); }
inline void named_arrive(int id, int count) { named_barrier(id, count, false); }
inline int named_left = 0;       // named barriers some block left with a phase not completed

inline void launch(unsigned grid, unsigned block, unsigned smem, const std::function<void()>& body) {
  blockDim.x = block;
  gridDim.x = grid;
  dyn_smem.assign(smem + 16, 0xcd);
  shfl_buf.assign(block, 0.0);
  mma_buf.assign(6 * std::size_t(block), 0u);
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> bar(block);
    block_barrier = &bar;
    for (Named& n : named) n.arrived = 0;
    warp_barriers.clear();
    for (unsigned w = 0; w < (block + 31) / 32; ++w)
      warp_barriers.emplace_back(new std::barrier<>(std::min(32u, block - 32 * w)));
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t)
      threads.emplace_back([&, t, b] {
        threadIdx.x = t;
        blockIdx.x = b;
        body();
      });
    for (auto& th : threads) th.join();
    for (Named& n : named) named_left += n.arrived != 0;
  }
}
}  // namespace ssmc_emu

inline void __syncthreads() { ssmc_emu::block_barrier->arrive_and_wait(); }

namespace ssmc_emu {
// every lane of the warp publishes v, then reads lane `src`'s value (its own when src < 0)
template <typename T>
inline T warp_exchange(T v, int src) {
  const unsigned t = threadIdx.x;
  auto& bar = *warp_barriers[t / 32];
  shfl_buf[t] = static_cast<double>(v);
  bar.arrive_and_wait();
  const T out = src < 0 ? v : static_cast<T>(shfl_buf[(t & ~31u) + unsigned(src)]);
  bar.arrive_and_wait();
  return out;
}
}  // namespace ssmc_emu

template <typename T>
inline T __shfl_up_sync(unsigned, T v, int delta) {
  const int lane = int(threadIdx.x & 31);
  return ssmc_emu::warp_exchange(v, lane >= delta ? lane - delta : -1);
}

template <typename T>
inline T __shfl_sync(unsigned, T v, int src) { return ssmc_emu::warp_exchange(v, src); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return ssmc_emu::warp_exchange(v, int(threadIdx.x & 31) ^ mask);
}

namespace ssmc_emu {
// mma.sync.m16n8k8 tf32 of a warp: every lane publishes its fragments (A: a0 (row g, col q), a1 (g + 8, q),
// a2 (g, q + 4), a3 (g + 8, q + 4); B: b0 (row q, col g), b1 (q + 4, g); g = lane / 4, q = lane % 4), then
// adds its four accumulators (rows g, g + 8 at columns 2q, 2q + 1) from the warp's A and B. The operands'
// low 13 bits are dropped (tf32), the products summed in double, the sum added to c in fp32.
inline void mma_m16n8k8_tf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, int b0, int b1) {
  const unsigned t = threadIdx.x, base = t & ~31u, lane = t & 31u;
  auto& bar = *warp_barriers[t / 32];
  std::uint32_t* mine = &mma_buf[6 * t];
  mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = std::uint32_t(b0); mine[5] = std::uint32_t(b1);
  bar.arrive_and_wait();
  auto tf32 = [](std::uint32_t u) { u &= 0xffffe000u; float f; std::memcpy(&f, &u, 4); return double(f); };
  auto A = [&](unsigned row, unsigned k) {       // the lane holding A[row][k] and its register
    const unsigned l = (row % 8) * 4 + k % 4;
    return tf32(mma_buf[6 * (base + l) + (row >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]);
  };
  auto B = [&](unsigned k, unsigned col) {
    const unsigned l = col * 4 + k % 4;
    return tf32(mma_buf[6 * (base + l) + 4 + (k >= 4 ? 1 : 0)]);
  };
  const unsigned g = lane / 4, q = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
    double s = 0;
    for (unsigned k = 0; k < 8; ++k) s += A(row, k) * B(k, col);
    out[i] = c[i] + float(s);
  }
  bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}
}  // namespace ssmc_emu

inline void __syncwarp(unsigned = 0xffffffffu) { ssmc_emu::warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

#define SSMC_DYNAMIC_SMEM(T, name) \
  T* name = reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(ssmc_emu::dyn_smem.data()) + 15) & ~std::uintptr_t(15))

struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::exp2; using std::expm1; using std::log1p; using std::trunc;

// -- 16-bit float types ---------------------------------------------------------------------
struct __nv_bfloat16 { std::uint16_t bits; };
struct __half { std::uint16_t bits; };

inline float __bfloat162float(__nv_bfloat16 h) { return __int_as_float(int(std::uint32_t(h.bits) << 16)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  std::uint32_t u = std::uint32_t(__float_as_int(f));
  if ((u & 0x7fffffffu) > 0x7f800000u) return {std::uint16_t((u >> 16) | 0x40)};   // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {std::uint16_t(u >> 16)};
}
inline float __half2float(__half h) {
  const std::uint32_t s = (h.bits & 0x8000u) << 16, e = (h.bits >> 10) & 0x1fu, m = h.bits & 0x3ffu;
  std::uint32_t u;
  if (e == 0) {
    if (m == 0) u = s;
    else {   // subnormal
      float f = std::ldexp(float(m), -24);
      return s ? -f : f;
    }
  } else if (e == 31) u = s | 0x7f800000u | (m << 13);
  else u = s | ((e + 112u) << 23) | (m << 13);
  return __int_as_float(int(u));
}
inline __half __float2half_rn(float f) {
  const std::uint32_t u = std::uint32_t(__float_as_int(f));
  const std::uint16_t s = std::uint16_t((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return {std::uint16_t(s | 0x7e00u)};
  if (a >= 65520.0f) return {std::uint16_t(s | 0x7c00u)};
  if (a < 6.103515625e-05f) {   // subnormal half: multiples of 2^-24, round to nearest even
    const float q = std::nearbyint(a * 16777216.0f);
    return {std::uint16_t(s | std::uint16_t(q))};
  }
  int ex;
  const float fr = std::frexp(a, &ex);            // a = fr * 2^ex, fr in [0.5, 1)
  float mant = std::nearbyint((fr * 2.0f - 1.0f) * 1024.0f);
  int e = ex - 1 + 15;
  if (mant >= 1024.0f) { mant = 0.0f; ++e; }
  if (e >= 31) return {std::uint16_t(s | 0x7c00u)};
  return {std::uint16_t(s | (e << 10) | int(mant))};
}

// How many named barriers blocks have left with arrivals of an unfinished phase since the library
// was loaded (a kernel whose arrivals and waits do not pair up).
extern "C" int ssmc_emu_named_left() { return ssmc_emu::named_left; }
