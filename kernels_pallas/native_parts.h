// Work split for the native CPU kernels (kernels_pallas/<op>/native.cc): ForEachPart(pool, n, body) runs body(i)
// for every i in [0, n) on the calling thread and on helpers scheduled on XLA's CPU thread pool.
//
// XLA:CPU runs a step's ops one after another, so the pool's threads are mostly idle while a kernel runs. Parts are
// claimed from a shared counter; the calling thread never waits for a helper to start (a pool may run a task
// scheduled from one of its own threads late), only for parts already being computed. The counters are shared with
// the helpers, which may start after the call has returned: a helper that starts after every part was claimed
// touches nothing else, and one that claims a part does so while the calling thread still waits, so `body` and
// whatever it refers to are alive.

#ifndef KIMI_JAX_NATIVE_PARTS_H_
#define KIMI_JAX_NATIVE_PARTS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace kimi_jax {

template <typename Body>
void ForEachPart(xla::ffi::ThreadPool& pool, int64_t parts, const Body& body) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, parts - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < parts; ++i) body(i);
    return;
  }
  struct Counters {
    explicit Counters(int64_t n) : parts(n) {}
    const int64_t parts;
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto counters = std::make_shared<Counters>(parts);
  const Body* fn = &body;
  auto work = [fn](Counters& c) {
    for (int64_t i; (i = c.next.fetch_add(1)) < c.parts;) {
      (*fn)(i);
      c.finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([counters, work] { work(*counters); });
  work(*counters);
  while (counters->finished.load(std::memory_order_acquire) < parts) {
    std::this_thread::yield();  // a helper descheduled mid-part gets this core back
  }
}

}  // namespace kimi_jax

#endif  // KIMI_JAX_NATIVE_PARTS_H_
