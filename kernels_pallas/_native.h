// What the native XLA:CPU kernels (kernels_pallas/<op>/native.cc) share: vectors of kLanes floats and their loads
// (float32, and bfloat16 widened exactly), and the loop that shares a call's parts among the threads of XLA's pool.
// Its names live in an unnamed namespace that each kernel's own reopens (one translation unit per kernel library).
// kernels_pallas/_native.py builds every kernel with it and keys the build cache on it too.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace {

constexpr int64_t kLanes = 16;

// kLanes floats as one value (GCC/Clang vector extension): one AVX-512 register, two AVX2 ones, four NEON ones.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

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
