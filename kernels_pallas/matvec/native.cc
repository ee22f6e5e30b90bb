// Decode-shaped matrix-vector products for XLA:CPU, several in one call: float32 x, float32 or bfloat16 weights
// (KimiMatvecGroupF32, KimiMatvecGroupBF16), float32 sums and results. A bfloat16 weight is widened to float32 in
// registers as it is loaded (exact), so a bf16 model streams half the bytes of a float32 one.
//
// The arguments come in triples, one per product ("item"): x [M, I], w [E, J, I] (each matrix [out, in], the
// checkpoint layout), ids [M] int32; item i writes result i, out [M, J], with out[m] = w[ids[m]] @ x[m]. A plain
// weight is w [1, J, I] with ids all zero; an expert stack is read in place at the chosen expert's rows, where
// XLA:CPU would copy the expert out first (kernels_pallas/matvec/__init__.py). Built and registered by
// kernels_pallas/_native.py.
//
// At a handful of rows a product streams its weight once, so its speed is memory bandwidth. Launched one by one,
// XLA:CPU's products of 0.5-1 MB reach about half the rate of the large ones (each starts a cold stream and wakes
// the thread pool); here all the items of a call are cut into parts of about kPartBytes that the threads claim
// from one counter, so the stream never stops between items.
//
// Each dot product keeps kLanes partial sums in vector registers, and kRows weight rows share every load of x.
// Summation order: lane l sums the products at i = l, l + kLanes, ...; the lanes are then added as a pairwise tree,
// then the tail i >= I - I % kLanes in order. The order does not depend on kRows, the parts or the threads.

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

// kLanes bfloat16 values widened to float32: a bfloat16 is the high half of the float32 with the same value.
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Lanes Load(const uint16_t* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words w = __builtin_convertvector(h, Words) << 16;
  Lanes v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) {
  const uint32_t w = uint32_t(v) << 16;
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

#if defined(__clang__)
#define KIMI_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KIMI_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, Ints{__VA_ARGS__})
#endif
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

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

// y[r] = w[r, :] . x for r < RowCount (rows I apart); the RowCount accumulators stay in registers.
template <int RowCount, typename W>
inline void DotRows(const W* w, const float* x, float* y, int64_t I) {
  Lanes acc[RowCount] = {};
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes) {
    const Lanes xi = Load(x + i);
    for (int r = 0; r < RowCount; ++r) acc[r] += Load(w + r * I + i) * xi;
  }
  float sums[RowCount];
  if constexpr (RowCount == 8 && kLanes == 16) {
    TreeSum8(acc, sums);
  } else {
    for (int r = 0; r < RowCount; ++r) {
      float lanes[kLanes];
      std::memcpy(lanes, &acc[r], sizeof lanes);
      sums[r] = TreeSum<kLanes>(lanes);
    }
  }
  for (int r = 0; r < RowCount; ++r) {
    float s = sums[r];
    for (int64_t t = i; t < I; ++t) s += Widen(w[r * I + t]) * x[t];
    y[r] = s;
  }
}

// y = w @ x for w [J, I], x [I].
template <typename W>
void Matvec(const W* w, const float* x, float* y, int64_t J, int64_t I) {
  int64_t j = 0;
  for (; j + kRows <= J; j += kRows) DotRows<kRows>(w + j * I, x, y + j, I);
  for (; j < J; ++j) DotRows<1>(w + j * I, x, y + j, I);
}

template <typename W>
struct Item {
  const float* x;
  const W* w;
  const int32_t* ids;
  float* out;
  int64_t M, J, I;

  // Output features [j0, j1) of every row.
  void Rows(int64_t j0, int64_t j1) const {
    for (int64_t m = 0; m < M; ++m) Matvec(w + (ids[m] * J + j0) * I, x + m * I, out + m * J + j0, j1 - j0, I);
  }
};

template <typename W>
struct Part {
  const Item<W>* item;
  int64_t j0, j1;
};

// Work is cut into parts of about this many weight bytes, claimed one at a time by the threads.
constexpr int64_t kPartBytes = 128 << 10;

ffi::Error Invalid(int64_t i, const std::string& what) {
  return ffi::Error::InvalidArgument("matvec group, item " + std::to_string(i) + ": " + what);
}

// WT: the weights' FFI element type; W: how their elements are stored.
template <ffi::DataType WT, typename W>
ffi::Error MatvecGroup(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  using Stack = ffi::Buffer<WT, 3>;
  const int64_t count = static_cast<int64_t>(rets.size());
  if (static_cast<int64_t>(args.size()) != 3 * count) {
    return ffi::Error::InvalidArgument("matvec group: expected three arguments (x, w, ids) per result");
  }
  std::vector<Item<W>> items(count);
  for (int64_t i = 0; i < count; ++i) {
    auto x = args.get<F32Matrix>(3 * i);
    auto w = args.get<Stack>(3 * i + 1);
    auto ids = args.get<Ids>(3 * i + 2);
    auto out = rets.get<F32Matrix>(i);
    if (!x || !w || !ids || !out) {
      return Invalid(i, std::string("expected x f32[M, I], w ") + (WT == ffi::F32 ? "f32" : "bf16") +
                            "[E, J, I], ids s32[M], out f32[M, J]");
    }
    const auto wd = w->dimensions();
    const int64_t E = wd[0], J = wd[1], I = wd[2], M = ids->dimensions()[0];
    if (x->dimensions()[0] != M || x->dimensions()[1] != I || (*out)->dimensions()[0] != M ||
        (*out)->dimensions()[1] != J) {
      return Invalid(i, "shapes must be x [M, I], w [E, J, I], ids [M], out [M, J]");
    }
    const int32_t* id = ids->typed_data();
    for (int64_t m = 0; m < M; ++m) {
      if (id[m] < 0 || id[m] >= E) return Invalid(i, "expert id out of range");
    }
    items[i] = Item<W>{x->typed_data(), reinterpret_cast<const W*>(w->untyped_data()), id, (*out)->typed_data(),
                       M, J, I};
  }
  // Each item's output features are split so that every thread streams its share of each chosen matrix.
  std::vector<Part<W>> parts;
  for (const Item<W>& it : items) {
    const int64_t bytes = it.M * it.J * it.I * int64_t(sizeof(W));
    const int64_t n = std::max<int64_t>(1, std::min(bytes / kPartBytes, it.J / kRows));
    for (int64_t p = 0; p < n; ++p) {
      const int64_t j0 = it.J * p / n / kRows * kRows, j1 = p + 1 == n ? it.J : it.J * (p + 1) / n / kRows * kRows;
      if (j1 > j0) parts.push_back(Part<W>{&it, j0, j1});
    }
  }
  const int64_t total = static_cast<int64_t>(parts.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, total - 1);
  if (helpers <= 0) {
    for (const Part<W>& p : parts) p.item->Rows(p.j0, p.j1);
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
  const Part<W>* list = parts.data();
  auto work = [list](State& st) {
    for (int64_t p; (p = st.next.fetch_add(1)) < st.parts;) {
      list[p].item->Rows(list[p].j0, list[p].j1);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(KimiMatvecGroupF32, (MatvecGroup<ffi::F32, float>),
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KimiMatvecGroupBF16, (MatvecGroup<ffi::BF16, uint16_t>),
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().RemainingArgs().RemainingRets());
