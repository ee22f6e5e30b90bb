// What the native XLA:CPU kernels (kernels_pallas/<op>/native.cc) share: vectors of kLanes floats, their loads
// (float32, and bfloat16 widened exactly), stores and broadcasts, the shuffle macro, the pairwise tree that sums a
// vector's lanes (one order on every instruction set: an AVX2 build gives an AVX-512 build's bits), the check of a
// buffer's shape, and the loop that shares a call's parts among the threads of XLA's pool. Its names live in an
// unnamed namespace that each kernel's own reopens (one translation unit per kernel library).
// kernels_pallas/_native.py builds every kernel with it and keys the build cache on it too.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;

// kLanes floats as one value (GCC/Clang vector extension): one AVX-512 register, two AVX2 ones, four NEON ones.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// A shuffle of the lanes of two kLanes vectors (indices < 2 * kLanes): Clang and GCC spell it differently.
#if defined(__clang__)
#define KIMI_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KIMI_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, Ints{__VA_ARGS__})
#endif

inline Lanes Splat(float v) { return Lanes{} + v; }  // a scalar operand is broadcast

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

// kLanes bfloat16 values widened to float32: a bfloat16 is the high half of the float32 with the same value.
inline Lanes Load(const uint16_t* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words w = __builtin_convertvector(h, Words) << 16;
  Lanes v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) {
  const uint32_t w = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

// The sum of the lanes as a pairwise tree: the two halves added, then the halves of that, ... (a few vector adds;
// adding the lanes one by one took about a tenth of the time of a product over rows of 128-256 floats).
template <int Count>
inline float TreeSum(const float* v) {
  if constexpr (Count == 1) {
    return v[0];
  } else {
    typedef float Part __attribute__((vector_size(Count / 2 * sizeof(float))));
    Part lo, hi;
    std::memcpy(&lo, v, sizeof lo);
    std::memcpy(&hi, v + Count / 2, sizeof hi);
    const Part s = lo + hi;
    float out[Count / 2];
    std::memcpy(out, &s, sizeof s);
    return TreeSum<Count / 2>(out);
  }
}

// The tree sum of one vector's lanes.
inline float TreeSum(Lanes v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof lanes);
  return TreeSum<kLanes>(lanes);
}

// TreeSum of eight accumulators at once (kLanes == 16): the same additions, lane i + lane i + 8, then + 4, + 2,
// + 1, done on vectors that hold two, four, then eight rows' partial sums.
inline void TreeSum8(const Lanes* a, float* y) {
  Lanes u[4], v[2];
  for (int p = 0; p < 4; ++p) {
    const Lanes x = a[2 * p], z = a[2 * p + 1];
    u[p] = KIMI_SHUFFLE(x, z, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           KIMI_SHUFFLE(x, z, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int p = 0; p < 2; ++p) {
    const Lanes x = u[2 * p], z = u[2 * p + 1];
    v[p] = KIMI_SHUFFLE(x, z, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           KIMI_SHUFFLE(x, z, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  const Lanes w = KIMI_SHUFFLE(v[0], v[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                  KIMI_SHUFFLE(v[0], v[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const Lanes t = KIMI_SHUFFLE(w, w, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
                  KIMI_SHUFFLE(w, w, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
  std::memcpy(y, &t, 8 * sizeof(float));
}

// y[r] = the tree sum of acc[r]'s lanes, r < RowCount.
template <int RowCount>
inline void TreeSums(const Lanes* acc, float* y) {
  if constexpr (RowCount == 8 && kLanes == 16) {
    TreeSum8(acc, y);
  } else {
    for (int r = 0; r < RowCount; ++r) {  // not TreeSum(acc[r]): that changed the products' register allocation
      float lanes[kLanes];
      std::memcpy(lanes, &acc[r], sizeof lanes);
      y[r] = TreeSum<kLanes>(lanes);
    }
  }
}

// Whether a buffer's dimensions are exactly `want` (the handlers check every operand's shape before reading it).
inline bool HasDims(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

// work(i, scratch) for every part i < parts, each part once, with a Scratch per thread (value-initialised, reused
// by that thread's parts). XLA:CPU runs a step's ops one after another, so the pool's threads are mostly idle
// during a kernel: parts are claimed from a shared counter by this thread and by helpers scheduled on the pool.
// This thread never waits for a helper to start (a pool may run a task scheduled from one of its own threads
// late), only for parts already being computed. The counters are shared with the helpers, which may start after
// this call has returned: a helper that starts after every part was claimed touches nothing else, and one that
// claims a part does so while this thread still waits below, so `work` and what it refers to are alive.
template <typename Scratch, typename Work>
void ShareParts(xla::ffi::ThreadPool pool, int64_t parts, const Work& work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, parts - 1);
  if (helpers <= 0) {
    Scratch scratch{};
    for (int64_t i = 0; i < parts; ++i) work(i, scratch);
    return;
  }
  struct Shared {
    explicit Shared(int64_t n) : parts(n) {}
    const int64_t parts;
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto shared = std::make_shared<Shared>(parts);
  const Work* body = &work;
  auto loop = [body](Shared& sh) {
    Scratch scratch{};
    for (int64_t i; (i = sh.next.fetch_add(1)) < sh.parts;) {
      (*body)(i, scratch);
      sh.finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([shared, loop] { loop(*shared); });
  loop(*shared);
  while (shared->finished.load(std::memory_order_acquire) < parts) {
    std::this_thread::yield();  // a helper descheduled mid-part gets this core back
  }
}

}  // namespace
