// Absorbed MLA attention over the latent cache for XLA:CPU at decode (kernels_pallas/mla_decode/reference.py is
// the oracle): for each query row (b, t) and head h,
//
//   s[h, j] = (q_lat[h] . c[j] + q_pe[h] . kpe[j]) * scale    for the cache slots j <= q_pos[b, t]
//   u[h]    = sum_j softmax_j(s[h, :])[j] c[j]
//
//   KimiMlaDecodeF32, KimiMlaDecodeBF16   the cache (c [B, S, R], kpe [B, S, O]) in float32 / bfloat16 (a bfloat16 is
//                                         widened in registers, exactly); q_lat [B, T, H, R], q_pe [B, T, H, O] and
//                                         u [B, T, H, R] float32, q_pos [B, T] int32; also the log-sum-exp of the
//                                         visible scores, lse [B, T, H] (-inf, and u = 0, where none is visible),
//                                         which merges the partial results of a cache split over devices.
//
// XLA:CPU runs the reference's two cache products one after another on one core (about 10 GB/s of cache). Here
// every query row's visible slots are cut into chunks that the threads claim; a chunk reads its cache rows once for
// the scores of all H heads (the rows of a chunk stay in cache for the weighted sum that follows), keeps its own
// maximum, sum of exponentials and partial u per head, and the chunks of a row are then merged by their softmax
// weights (as a cache split over devices is, kernels_pallas/_dispatch.py Rule.merge). Float32 sums; the result
// differs from the reference's only in the order of the sums (the tests bound it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../_native.h"  // Lanes, Load, Store, Widen, Splat, TreeSum, HasDims, ShareParts

namespace {

using F32x3 = ffi::Buffer<ffi::F32, 3>;
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using Positions = ffi::Buffer<ffi::S32, 2>;
template <ffi::DataType CT>
using Cache = ffi::Buffer<CT, 3>;

// Adds q[g * ld ..] . row over n values into acc[g] for G heads: each load of the row serves G independent sums.
template <int G, typename C>
inline int64_t Dots(const float* q, int64_t ld, const C* row, int64_t n, Lanes* acc) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes r = Load(row + i);
    for (int g = 0; g < G; ++g) acc[g] += Load(q + g * ld + i) * r;
  }
  return i;  // the columns from i on are left to the caller
}

// out[g] = q_lat[g] . c_row + q_pe[g] . kpe_row for G heads: kLanes partial sums over both, a tree, then the tails.
template <int G, typename C>
inline void Scores(const float* ql, int64_t R, const C* crow, const float* qp, int64_t O, const C* krow, float* out) {
  Lanes acc[G] = {};
  const int64_t i = Dots<G>(ql, R, crow, R, acc), k = Dots<G>(qp, O, krow, O, acc);
  for (int g = 0; g < G; ++g) {
    // one tree per head, the simpler form: TreeSums' eight-head form gives the same sums and measured within 2% of
    // it (4096 slots, 8 heads: faster over a bfloat16 cache, slower over a float32 one)
    float sum = TreeSum(acc[g]);
    for (int64_t t = i; t < R; ++t) sum += ql[g * R + t] * Widen(crow[t]);
    for (int64_t t = k; t < O; ++t) sum += qp[g * O + t] * Widen(krow[t]);
    out[g] = sum;
  }
}

// acc[g * R ..] += sum over the chunk's rows j of p[g * ld + j] * rows[j * R ..] for G heads, kLanes columns at a
// time: each load of a row serves G heads, and the sums stay in registers across the rows.
template <int G, typename C>
inline void Weighted(const float* p, int64_t ld, const C* rows, int64_t n, int64_t R, float* acc) {
  int64_t i = 0;
  for (; i + kLanes <= R; i += kLanes) {
    Lanes sum[G];
    for (int g = 0; g < G; ++g) sum[g] = Load(acc + g * R + i);
    for (int64_t j = 0; j < n; ++j) {
      const Lanes r = Load(rows + j * R + i);
      for (int g = 0; g < G; ++g) sum[g] += Splat(p[g * ld + j]) * r;
    }
    for (int g = 0; g < G; ++g) Store(acc + g * R + i, sum[g]);
  }
  for (; i < R; ++i) {
    for (int g = 0; g < G; ++g) {
      for (int64_t j = 0; j < n; ++j) acc[g * R + i] += p[g * ld + j] * Widen(rows[j * R + i]);
    }
  }
}

// f(h0, Group) over the heads in groups of 8, then 4, then 1.
template <typename F>
inline void ByGroups(int64_t H, F f) {
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) f(h, std::integral_constant<int, 8>{});
  for (; h + 4 <= H; h += 4) f(h, std::integral_constant<int, 4>{});
  for (; h < H; ++h) f(h, std::integral_constant<int, 1>{});
}

// out += p * row over n values.
template <typename C>
inline void Axpy(float p, const C* row, float* out, int64_t n) {
  const Lanes pv = Splat(p);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(out + i, Load(out + i) + pv * Load(row + i));
  for (; i < n; ++i) out[i] += p * Widen(row[i]);
}

constexpr int64_t kChunkBytes = 64 << 10;  // cache bytes per chunk: the rows stay in L2 for the second pass

template <typename C>
struct Problem {
  const float *q_lat, *q_pe;
  const C *c, *kpe;
  const int32_t* q_pos;
  float *u, *lse;
  int64_t B, T, H, S, R, O;
  float scale;
  int64_t chunk;  // slots per chunk

  int64_t Visible(int64_t row) const {  // slots 0 .. q_pos
    return std::clamp<int64_t>(static_cast<int64_t>(q_pos[row]) + 1, 0, S);
  }

  // Chunk k of query row `row` (b * T + t): m[h], l[h] and the unnormalised partial u[h] (H x R) into `out`
  // (H * (2 + R) floats: m, then l, then u).
  void Part(int64_t row, int64_t k, float* out, std::vector<float>& scores) const {
    const int64_t b = row / T, j0 = k * chunk, j1 = std::min(Visible(row), j0 + chunk), n = j1 - j0;
    float *m = out, *l = out + H, *acc = out + 2 * H;
    std::fill(acc, acc + H * R, 0.0f);
    if (n <= 0) {
      std::fill(m, m + H, -std::numeric_limits<float>::infinity());
      std::fill(l, l + H, 0.0f);
      return;
    }
    scores.resize(H * n);
    float* sl = scores.data();
    const float *ql = q_lat + row * H * R, *qp = q_pe + row * H * O;
    const C *cb = c + (b * S + j0) * R, *kb = kpe + (b * S + j0) * O;
    float dots[8];
    for (int64_t j = 0; j < n; ++j) {
      ByGroups(H, [&](int64_t h0, auto group) {
        constexpr int G = decltype(group)::value;
        Scores<G>(ql + h0 * R, R, cb + j * R, qp + h0 * O, O, kb + j * O, dots);
        for (int g = 0; g < G; ++g) sl[(h0 + g) * n + j] = dots[g] * scale;
      });
    }
    for (int64_t h = 0; h < H; ++h) {
      float* s = sl + h * n;
      const float top = *std::max_element(s, s + n);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - top));
      m[h] = top;
      l[h] = sum;
    }
    ByGroups(H, [&](int64_t h0, auto group) {
      Weighted<decltype(group)::value>(sl + h0 * n, n, cb, n, R, acc + h0 * R);
    });
  }

  // u of query row `row` from its chunks' partials.
  void Merge(int64_t row, const float* parts, int64_t chunks) const {
    const int64_t stride = H * (2 + R);
    float* ur = u + row * H * R;
    for (int64_t h = 0; h < H; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < chunks; ++k) top = std::max(top, parts[k * stride + h]);
      float* uh = ur + h * R;
      std::fill(uh, uh + R, 0.0f);
      lse[row * H + h] = -std::numeric_limits<float>::infinity();
      if (!std::isfinite(top)) continue;  // no visible slot: zeros and -inf, as the reference's with_lse form
      float total = 0.0f;
      for (int64_t k = 0; k < chunks; ++k) {
        const float* pk = parts + k * stride;
        const float w = std::exp(pk[h] - top);
        if (w == 0.0f) continue;
        total += pk[H + h] * w;
        Axpy(w, pk + 2 * H + h * R, uh, R);
      }
      const float inv = 1.0f / total;
      for (int64_t r = 0; r < R; ++r) uh[r] *= inv;
      lse[row * H + h] = top + std::log(total);
    }
  }
};

template <ffi::DataType CT, typename C>
ffi::Error MlaDecode(ffi::ThreadPool pool, F32x4 q_lat, F32x4 q_pe, Cache<CT> c, Cache<CT> kpe, Positions q_pos,
                     float scale, ffi::Result<F32x4> u, ffi::Result<F32x3> lse) {
  const auto qd = q_lat.dimensions(), cd = c.dimensions();
  const int64_t B = qd[0], T = qd[1], H = qd[2], R = qd[3], S = cd[1], O = q_pe.dimensions()[3];
  if (!HasDims(q_pe.dimensions(), {B, T, H, O}) || !HasDims(cd, {B, S, R}) || !HasDims(kpe.dimensions(), {B, S, O}) ||
      !HasDims(q_pos.dimensions(), {B, T}) || !HasDims(u->dimensions(), {B, T, H, R}) ||
      !HasDims(lse->dimensions(), {B, T, H})) {
    return ffi::Error::InvalidArgument("mla decode: shapes must be q_lat [B, T, H, R], q_pe [B, T, H, O], "
                                       "c [B, S, R], kpe [B, S, O], q_pos [B, T] -> u [B, T, H, R], lse [B, T, H]");
  }
  const int64_t chunk = std::max<int64_t>(16, kChunkBytes / static_cast<int64_t>((R + O) * sizeof(C)));
  const Problem<C> p{q_lat.typed_data(), q_pe.typed_data(), reinterpret_cast<const C*>(c.untyped_data()),
                     reinterpret_cast<const C*>(kpe.untyped_data()), q_pos.typed_data(), u->typed_data(),
                     lse->typed_data(), B, T, H, S, R, O, scale, chunk};
  const int64_t rows = B * T, chunks = std::max<int64_t>(1, (S + chunk - 1) / chunk), parts = rows * chunks;
  const int64_t stride = H * (2 + R);
  std::vector<float> partials(parts * stride);
  float* out = partials.data();
  auto run = [&p, out, chunks, stride](int64_t i, std::vector<float>& scores) {
    p.Part(i / chunks, i % chunks, out + i * stride, scores);
  };
  ShareParts<std::vector<float>>(pool, parts, run);
  for (int64_t row = 0; row < rows; ++row) p.Merge(row, out + row * chunks * stride, chunks);
  return ffi::Error::Success();
}

}  // namespace

#define KIMI_MLA_HANDLER(name, CT, C)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (MlaDecode<CT, C>),               \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<F32x4>()      /* q_lat */      \
                                    .Arg<F32x4>()      /* q_pe */       \
                                    .Arg<Cache<CT>>()  /* c */          \
                                    .Arg<Cache<CT>>()  /* kpe */        \
                                    .Arg<Positions>()  /* q_pos */      \
                                    .Attr<float>("scale")               \
                                    .Ret<F32x4>()      /* u */          \
                                    .Ret<F32x3>())     /* lse */
KIMI_MLA_HANDLER(KimiMlaDecodeF32, ffi::F32, float);
KIMI_MLA_HANDLER(KimiMlaDecodeBF16, ffi::BF16, uint16_t);
