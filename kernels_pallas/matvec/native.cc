// Decode-shaped matrix-vector products for XLA:CPU, float32, several in one call.
//
// The arguments come in triples, one per product ("item"): x [S, K], w [E, N, K] (each matrix [out, in], the
// checkpoint layout), ids [S] int32; item i writes result i, out [S, N], with out[s] = w[ids[s]] @ x[s]. A plain
// weight is w [1, N, K] with ids all zero; an expert stack is read in place at the chosen expert's rows, where
// XLA:CPU would copy the expert out first (kernels_pallas/matvec/__init__.py). Built and registered by
// kernels_pallas/_native.py.
//
// At a handful of rows a product streams its weight once, so its speed is memory bandwidth. Launched one by one,
// XLA:CPU's products of 0.5-1 MB reach about half the rate of the large ones (each starts a cold stream and wakes
// the thread pool); here all the items of a call are cut into parts of about kPartBytes that the threads claim
// from one counter, so the stream never stops between items.
//
// Each dot product keeps kLanes partial sums in vector registers, and kRows weight rows share every load of x.
// Summation order: lane j sums the products at k = j, j + kLanes, ...; the lanes are added last, then the tail
// k >= K - K % kLanes. The order does not depend on kRows, the parts or the threads.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Stack = ffi::Buffer<ffi::F32, 3>;
using Ids = ffi::Buffer<ffi::S32, 1>;

constexpr int64_t kLanes = 16;
#ifdef __AVX512F__
constexpr int kRows = 8;  // 8 accumulators + x + loads fit the 32 zmm registers
#else
constexpr int kRows = 4;
#endif

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

struct Item {
  const float* x;
  const float* w;
  const int32_t* ids;
  float* out;
  int64_t S, N, K;

  // Rows [n0, n1) of every slot.
  void Rows(int64_t n0, int64_t n1) const {
    for (int64_t s = 0; s < S; ++s) Matvec(w + (ids[s] * N + n0) * K, x + s * K, out + s * N + n0, n1 - n0, K);
  }
};

struct Part {
  const Item* item;
  int64_t n0, n1;
};

// Work is cut into parts of about this many weight bytes, claimed one at a time by the threads.
constexpr int64_t kPartBytes = 128 << 10;

ffi::Error Invalid(int64_t i, const std::string& what) {
  return ffi::Error::InvalidArgument("matvec group, item " + std::to_string(i) + ": " + what);
}

ffi::Error MatvecGroup(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const int64_t count = static_cast<int64_t>(rets.size());
  if (static_cast<int64_t>(args.size()) != 3 * count) {
    return ffi::Error::InvalidArgument("matvec group: expected three arguments (x, w, ids) per result");
  }
  std::vector<Item> items(count);
  for (int64_t i = 0; i < count; ++i) {
    auto x = args.get<F32Matrix>(3 * i);
    auto w = args.get<F32Stack>(3 * i + 1);
    auto ids = args.get<Ids>(3 * i + 2);
    auto out = rets.get<F32Matrix>(i);
    if (!x || !w || !ids || !out) return Invalid(i, "expected x f32[S, K], w f32[E, N, K], ids s32[S], out f32[S, N]");
    const auto wd = w->dimensions();
    const int64_t E = wd[0], N = wd[1], K = wd[2], S = ids->dimensions()[0];
    if (x->dimensions()[0] != S || x->dimensions()[1] != K || (*out)->dimensions()[0] != S ||
        (*out)->dimensions()[1] != N) {
      return Invalid(i, "shapes must be x [S, K], w [E, N, K], ids [S], out [S, N]");
    }
    const int32_t* id = ids->typed_data();
    for (int64_t s = 0; s < S; ++s) {
      if (id[s] < 0 || id[s] >= E) return Invalid(i, "expert id out of range");
    }
    items[i] = Item{x->typed_data(), w->typed_data(), id, (*out)->typed_data(), S, N, K};
  }
  // Each item's rows are split so that every thread streams its share of each chosen matrix.
  std::vector<Part> parts;
  for (const Item& it : items) {
    const int64_t bytes = it.S * it.N * it.K * int64_t(sizeof(float));
    const int64_t n = std::max<int64_t>(1, std::min(bytes / kPartBytes, it.N / kRows));
    for (int64_t p = 0; p < n; ++p) {
      const int64_t n0 = it.N * p / n / kRows * kRows, n1 = p + 1 == n ? it.N : it.N * (p + 1) / n / kRows * kRows;
      if (n1 > n0) parts.push_back(Part{&it, n0, n1});
    }
  }
  const int64_t total = static_cast<int64_t>(parts.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, total - 1);
  if (helpers <= 0) {
    for (const Part& p : parts) p.item->Rows(p.n0, p.n1);
    return ffi::Error::Success();
  }
  // XLA:CPU runs a step's ops one after another, so the pool's threads are mostly idle here. Parts are claimed
  // from a shared counter by this thread and by helpers scheduled on the pool; this thread never waits for a helper
  // to start (a pool may run a task scheduled from one of its own threads late), only for parts already being
  // computed. The counters are shared with the helpers, which may start after this call has returned: a helper that
  // starts after every part was claimed touches nothing else, and one that claims a part does so while this thread
  // still waits below, so `parts` and `items` are alive.
  struct State {
    explicit State(int64_t n) : parts(n) {}
    const int64_t parts;
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto state = std::make_shared<State>(total);
  const Part* list = parts.data();
  auto work = [list](State& st) {
    for (int64_t p; (p = st.next.fetch_add(1)) < st.parts;) {
      list[p].item->Rows(list[p].n0, list[p].n1);
      st.finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->finished.load(std::memory_order_acquire) < total) {
    std::this_thread::yield();  // a helper descheduled mid-part gets this core back
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KimiMatvecGroupF32, MatvecGroup,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().RemainingArgs().RemainingRets());
