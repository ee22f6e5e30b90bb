// Decode-shaped expert matmul for XLA:CPU, float32: out[s, :] = w[ids[s]] @ x[s].
//
// x [S, K], w [E, N, K] (each expert [out, in], the checkpoint layout), ids [S] int32 -> out [S, N].
// The chosen expert's rows are read where they lie in the stacked array; XLA:CPU would copy them out first
// (kernels_pallas/moe_gmm/reference.py). Built and registered by kernels_pallas/_native.py.
//
// Each dot product keeps kLanes partial sums in vector registers, and kRows weight rows share every load of x.
// Summation order: lane j sums the products at k = j, j + kLanes, ...; the lanes are added last, then the tail
// k >= K - K % kLanes.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Stack = ffi::Buffer<ffi::F32, 3>;
using Ids = ffi::Buffer<ffi::S32, 1>;

constexpr int64_t kLanes = 16;
constexpr int kRows = 4;

// kLanes floats as one value (GCC/Clang vector extension): one AVX-512 register, two AVX2 ones, four NEON ones.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

// y[r] = w[r, :] . x for r < R (rows K apart); the R accumulators stay in registers.
template <int R>
inline void DotRows(const float* w, const float* x, float* y, int64_t K) {
  Lanes acc[R] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const Lanes xk = Load(x + k);
    for (int r = 0; r < R; ++r) acc[r] += Load(w + r * K + k) * xk;
  }
  for (int r = 0; r < R; ++r) {
    float s = 0.0f;
    for (int j = 0; j < kLanes; ++j) s += acc[r][j];
    for (int64_t t = k; t < K; ++t) s += w[r * K + t] * x[t];
    y[r] = s;
  }
}

void Matvec(const float* w, const float* x, float* y, int64_t N, int64_t K) {
  int64_t n = 0;
  for (; n + kRows <= N; n += kRows) DotRows<kRows>(w + n * K, x, y + n, K);
  for (; n < N; ++n) DotRows<1>(w + n * K, x, y + n, K);
}

// Work is cut into parts of about this many weight bytes, claimed one at a time by the threads.
constexpr int64_t kPartBytes = 128 << 10;

ffi::Error GatherMatvec(ffi::ThreadPool pool, F32Matrix x, F32Stack w, Ids ids, ffi::Result<F32Matrix> out) {
  const auto wd = w.dimensions();
  const int64_t E = wd[0], N = wd[1], K = wd[2];
  const int64_t S = ids.dimensions()[0];
  if (x.dimensions()[0] != S || x.dimensions()[1] != K || out->dimensions()[0] != S || out->dimensions()[1] != N) {
    return ffi::Error::InvalidArgument("gather_matvec: shapes must be x [S, K], w [E, N, K], ids [S], out [S, N]");
  }
  const int32_t* id = ids.typed_data();
  for (int64_t s = 0; s < S; ++s) {
    if (id[s] < 0 || id[s] >= E) return ffi::Error::InvalidArgument("gather_matvec: expert id out of range");
  }
  // Rows [n0, n1) of every slot; the parts split the rows so that each thread streams its share of every expert.
  auto rows = [&](int64_t n0, int64_t n1) {
    for (int64_t s = 0; s < S; ++s) {
      Matvec(w.typed_data() + (id[s] * N + n0) * K, x.typed_data() + s * K, out->typed_data() + s * N + n0,
             n1 - n0, K);
    }
  };
  const int64_t parts = std::max<int64_t>(1, std::min(S * N * K * int64_t(sizeof(float)) / kPartBytes, N / kRows));
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, parts - 1);
  if (helpers <= 0) {
    rows(0, N);
    return ffi::Error::Success();
  }
  // XLA:CPU runs a step's ops one after another, so the pool's threads are mostly idle here. Parts are claimed
  // from a shared counter by this thread and by helpers scheduled on the pool; this thread never waits for a helper
  // to start (a pool may run a task scheduled from one of its own threads late), only for parts already being
  // computed. The state is shared with the helpers, which may start after this call has returned.
  struct State {
    explicit State(int64_t n) : parts(n) {}
    const int64_t parts;
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto bound = [&](int64_t p) { return p == parts ? N : N * p / parts / kRows * kRows; };
  // A helper that starts after every part was claimed touches nothing but the state; one that claims a part does
  // so while this thread still waits below, so the references in `rows` are alive.
  auto state = std::make_shared<State>(parts);
  auto work = [&rows, &bound](State& st) {
    for (int64_t p; (p = st.next.fetch_add(1)) < st.parts;) {
      rows(bound(p), bound(p + 1));
      st.finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->finished.load(std::memory_order_acquire) < parts) {
    std::this_thread::yield();  // a helper descheduled mid-part gets this core back
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KimiGatherMatvecF32, GatherMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Stack>()
                                  .Arg<Ids>()
                                  .Ret<F32Matrix>());
