// KDA recurrence for XLA:CPU, float32: the token-by-token form of kernels_pallas/kda/reference.py (kda_recurrent).
//
// q, k, a [B, T, H, K], v [B, T, H, U], beta, kq [B, T, H], state [B, H, K, U] -> o [B, T, H, U], new state
// [B, H, K, U] (written over the input state: XLA aliases the two). a = exp(g) and kq = k . (scale q) come from
// XLA, computed as the reference computes them. Per head and token:
//
//   r_k = S^T (a * k),  r_q = S^T (a * scale * q)
//   delta = beta (v - r_k);  o = r_q + kq delta
//   S <- diag(a) S + k delta^T
//
// Column j of S only ever meets column j: r_k[j], r_q[j], delta[j], o[j] and S[:, j] depend on no other column. So
// with several tokens (prefill) the state is cut into blocks of 64 columns (32 KB at K = 128: a core's L1 cache
// holds one), each block runs all T tokens on its own, and the blocks of every (sequence, head) are shared between
// the threads. Token t's update and
// token t + 1's reads share one pass over the block. XLA:CPU runs the same step as a few fused loops per layer and
// token, each over the whole [B, H, K, U] state. Summation over k runs in order k = 0, 1, ..., per column.
// Built and registered by kernels_pallas/_native.py.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../_native.h"  // Lanes, Load, Store, HasDims, ShareParts

namespace {

using F32x4 = ffi::Buffer<ffi::F32, 4>;
using F32x3 = ffi::Buffer<ffi::F32, 3>;

constexpr int64_t kBlock = 4 * kLanes;  // columns per block

// One pass over columns of the state, row by row: token t's update (S <- diag(a) S + k delta^T) and/or token
// t + 1's reads (rk = S^T ak, rq = S^T aq, taken from the updated rows).
struct Pass {
  const float *a, *k, *delta;  // update
  const float *ak, *aq;        // reads
  float *rk, *rq;
};

// Columns [j0, j0 + NB * kLanes): delta and the read accumulators stay in registers.
template <int NB, bool kUpdate, bool kRead>
void Columns(float* __restrict s, int64_t K, int64_t U, int64_t j0, const Pass& p) {
  const float* __restrict a = p.a;
  const float* __restrict k = p.k;
  const float* __restrict ak = p.ak;
  const float* __restrict aq = p.aq;
  Lanes d[NB], acc_k[NB] = {}, acc_q[NB] = {};
  if (kUpdate) {
    for (int b = 0; b < NB; ++b) d[b] = Load(p.delta + j0 + b * kLanes);
  }
  for (int64_t i = 0; i < K; ++i) {
    float* row = s + i * U + j0;
    const float ai = kUpdate ? a[i] : 0.0f, ki = kUpdate ? k[i] : 0.0f;
    const float aki = kRead ? ak[i] : 0.0f, aqi = kRead ? aq[i] : 0.0f;
    for (int b = 0; b < NB; ++b) {
      Lanes x = Load(row + b * kLanes);
      if (kUpdate) {
        x = x * ai + ki * d[b];
        Store(row + b * kLanes, x);
      }
      if (kRead) {
        acc_k[b] += x * aki;
        acc_q[b] += x * aqi;
      }
    }
  }
  if (kRead) {
    for (int b = 0; b < NB; ++b) {
      Store(p.rk + j0 + b * kLanes, acc_k[b]);
      Store(p.rq + j0 + b * kLanes, acc_q[b]);
    }
  }
}

template <bool kUpdate, bool kRead>
void Run(float* s, int64_t K, int64_t U, int64_t j0, int64_t j1, const Pass& p) {
  int64_t j = j0;
  for (; j + 2 * kBlock <= j1; j += 2 * kBlock) Columns<2 * kBlock / kLanes, kUpdate, kRead>(s, K, U, j, p);
  for (; j + kBlock <= j1; j += kBlock) Columns<kBlock / kLanes, kUpdate, kRead>(s, K, U, j, p);
  for (; j + kLanes <= j1; j += kLanes) Columns<1, kUpdate, kRead>(s, K, U, j, p);
  for (; j < j1; ++j) {  // columns past the last full vector
    float acc_k = 0.0f, acc_q = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      float& x = s[i * U + j];
      if (kUpdate) x = x * p.a[i] + p.k[i] * p.delta[j];
      if (kRead) {
        acc_k += x * p.ak[i];
        acc_q += x * p.aq[i];
      }
    }
    if (kRead) p.rk[j] = acc_k, p.rq[j] = acc_q;
  }
}

struct Problem {
  const float *q, *k, *v, *a, *beta, *kq;
  float *state, *o;
  int64_t B, T, H, K, U;
  float scale;

  // Columns per part: with several tokens, blocks that stay in the L1 cache for all of them; a single token (decode)
  // streams each head's state from memory twice (read, then update), whole rows at a time.
  int64_t Width() const { return T > 1 ? std::min(U, kBlock) : U; }
  int64_t Blocks() const { return (U + Width() - 1) / Width(); }
  int64_t Scratch() const { return 2 * K + 3 * Width() + (T > 1 ? K * Width() : 0); }

  // All T tokens of sequence b, head h, on the columns of block c. With several tokens the block is copied into a
  // contiguous buffer first: in place, its rows sit U floats apart and fill only a part of the L1 cache's sets.
  void Part(int64_t b, int64_t h, int64_t c, float* buf) const {
    const int64_t j0 = c * Width(), w = std::min(U, j0 + Width()) - j0;
    float* s = state + (b * H + h) * K * U + j0;
    float *ak = buf, *aq = buf + K, *rk = buf + 2 * K, *rq = rk + Width(), *delta = rq + Width();
    float* blk = s;
    int64_t ld = U;
    if (T > 1) {
      blk = delta + Width(), ld = w;
      for (int64_t i = 0; i < K; ++i) std::copy_n(s + i * U, w, blk + i * w);
    }
    auto row = [&](int64_t t) { return (b * T + t) * H + h; };
    auto prepare = [&](int64_t t) {  // ak = a k_t, aq = a scale q_t
      const float *qt = q + row(t) * K, *kt = k + row(t) * K, *at = a + row(t) * K;
      for (int64_t i = 0; i < K; ++i) {
        ak[i] = kt[i] * at[i];
        aq[i] = (qt[i] * scale) * at[i];
      }
    };
    // A token's inputs sit H rows apart: further than the hardware prefetcher looks ahead.
    auto prefetch = [&](int64_t t) {
      if (t >= T) return;
      const int64_t r = row(t);
      for (int64_t i = 0; i < K; i += 64 / sizeof(float)) {
        __builtin_prefetch(q + r * K + i), __builtin_prefetch(k + r * K + i), __builtin_prefetch(a + r * K + i);
      }
      for (int64_t j = 0; j < w; j += 64 / sizeof(float)) __builtin_prefetch(v + r * U + j0 + j);
    };
    prefetch(1);
    prepare(0);
    Run<false, true>(blk, K, ld, 0, w, Pass{nullptr, nullptr, nullptr, ak, aq, rk, rq});
    for (int64_t t = 0; t < T; ++t) {
      prefetch(t + 2);
      const int64_t r = row(t);
      const float *vt = v + r * U + j0, bt = beta[r], kqt = kq[r];
      float* ot = o + r * U + j0;
      for (int64_t j = 0; j < w; ++j) {
        delta[j] = (vt[j] - rk[j]) * bt;
        ot[j] = rq[j] + delta[j] * kqt;
      }
      const Pass update{a + r * K, k + r * K, delta, ak, aq, rk, rq};
      if (t + 1 < T) {
        prepare(t + 1);
        Run<true, true>(blk, K, ld, 0, w, update);
      } else {
        Run<true, false>(blk, K, ld, 0, w, update);
      }
    }
    if (blk != s) {
      for (int64_t i = 0; i < K; ++i) std::copy_n(blk + i * w, w, s + i * U);
    }
  }
};

ffi::Error KdaRecurrent(ffi::ThreadPool pool, F32x4 q, F32x4 k, F32x4 v, F32x4 a, F32x3 beta, F32x3 kq,
                        F32x4 state, float scale, ffi::Result<F32x4> o, ffi::Result<F32x4> state_out) {
  const auto qd = q.dimensions(), vd = v.dimensions();
  const int64_t B = qd[0], T = qd[1], H = qd[2], K = qd[3], U = vd[3];
  if (!HasDims(k.dimensions(), {B, T, H, K}) || !HasDims(a.dimensions(), {B, T, H, K}) || !HasDims(vd, {B, T, H, U}) ||
      !HasDims(beta.dimensions(), {B, T, H}) || !HasDims(kq.dimensions(), {B, T, H}) ||
      !HasDims(state.dimensions(), {B, H, K, U}) || !HasDims(o->dimensions(), {B, T, H, U}) ||
      !HasDims(state_out->dimensions(), {B, H, K, U})) {
    return ffi::Error::InvalidArgument("kda recurrent: shapes must be q, k, a [B, T, H, K], v [B, T, H, U], "
                                       "beta, kq [B, T, H], state [B, H, K, U]");
  }
  float* s = state_out->typed_data();
  if (s != state.typed_data()) std::copy_n(state.typed_data(), B * H * K * U, s);  // XLA did not alias them
  if (T == 0) return ffi::Error::Success();
  const Problem p{q.typed_data(), k.typed_data(), v.typed_data(), a.typed_data(), beta.typed_data(),
                  kq.typed_data(), s, o->typed_data(), B, T, H, K, U, scale};
  const int64_t blocks = p.Blocks(), parts = B * H * blocks, scratch = p.Scratch();
  auto run = [&p, blocks](int64_t i, float* buf) { p.Part(i / blocks / p.H, i / blocks % p.H, i % blocks, buf); };
  // `p` and `run` live until every claimed part is finished (ShareParts)
  ShareParts<std::vector<float>>(pool, parts, [&run, scratch](int64_t i, std::vector<float>& buf) {
    buf.resize(scratch);
    run(i, buf.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KimiKdaRecurrentF32, KdaRecurrent,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()  // q
                                  .Arg<F32x4>()  // k
                                  .Arg<F32x4>()  // v
                                  .Arg<F32x4>()  // a = exp(g)
                                  .Arg<F32x3>()  // beta
                                  .Arg<F32x3>()  // kq = k . (scale q)
                                  .Arg<F32x4>()  // state
                                  .Attr<float>("scale")
                                  .Ret<F32x4>()   // o
                                  .Ret<F32x4>());  // new state
