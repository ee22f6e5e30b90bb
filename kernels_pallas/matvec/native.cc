// Decode-shaped matrix-vector products for XLA:CPU, several in one call: float32 x, float32 sums and results, and
// weights read in their stored format, one format per call:
//
//   KimiMatvecGroupF32, KimiMatvecGroupBF16  float32 / bfloat16 w (a bfloat16 is widened in registers, exactly)
//   KimiMatvecGroupI8                        int8 q with a float32 scale per output row (W = q * scale)
//   KimiMatvecGroupI4, KimiMatvecGroupI4Z    int4 nibble pairs, a float32 scale per group of g input columns
//                                            (W = q * scale), and for I4Z an int8 zero point per group
//                                            (W = (q - zero) * scale)
//   KimiMatvecGroupNF4                       NF4 nibble pairs, a float32 absmax per group (W = NF4[code] * absmax)
//   KimiMatvecGroupMXFP4                     MXFP4 (K3's routed experts): E2M1 nibble pairs, an E8M0 byte per 32
//                                            columns (W = E2M1[code] * 2^(byte - 127))
//
// (kernels_pallas/quant.py defines the integer formats and kernels_pallas/mxfp4.py MXFP4; their dequantize is the
// oracle.) A narrower weight is fewer
// bytes to stream: int8 is a quarter of float32, int4 about an eighth.
//
// The arguments come in tuples, one per product ("item"): x [M, I], the weight's fields, each [E, ...] (each matrix
// [out, in], the checkpoint layout), ids [M] int32; item i writes result i, out [M, J], with
// out[m] = w[ids[m]] @ x[m]. Fields per format: F32/BF16 w [E, J, I]; I8 q [E, J, I], scale [E, J, 1]; I4 packed
// [E, J, I/2], scale [E, J, I/g]; I4Z packed, scale, zero [E, J, I/g]; NF4 packed, absmax [E, J, I/g]; MXFP4
// packed [E, J, I/2], scale u8[E, J, I/32] (the checkpoint's bytes, decoded in the kernel). A plain
// weight has E = 1 with ids all zero; an expert stack is read in place at the chosen expert's rows, where XLA:CPU
// would copy the expert out first (kernels_pallas/matvec/__init__.py). The items of one call may have different
// shapes and group sizes. Built and registered by kernels_pallas/_native.py.
//
// At a handful of rows a product streams its weight once, so its speed is memory bandwidth. Launched one by one,
// XLA:CPU's products of 0.5-1 MB reach about half the rate of the large ones (each starts a cold stream and wakes
// the thread pool); here all the items of a call are cut into parts of about kPartBytes that the threads claim
// from one counter, so the stream never stops between items (RunParts, shared by every format). Narrow rows are
// prefetched a block of rows ahead (Ahead): the hardware prefetcher does not follow their short streams.
//
// Each dot product keeps kLanes partial sums in vector registers, and kRows weight rows share every load of x (up
// to kShared rows of x that use the same matrix share every load of the weight: DotRows).
// Summation order, float32 and int8 weights: lane l sums the products at i = l, l + kLanes, ...; the lanes are then
// added as a pairwise tree, then the tail i >= I - I % kLanes in order; int8 multiplies that sum of q * x by the
// row's scale. bfloat16 and 4-bit weights: lane l of block b (32 columns) sums, in block order, W[32b + 2l]
// x[32b + 2l] then W[32b + 2l + 1] x[32b + 2l + 1] (x is reordered once per call, even columns of each block first,
// so neither a bfloat16 pair nor a byte of nibbles needs a shuffle); then the same tree (bfloat16: then the tail
// i >= I - I % 32 in order; 4-bit groups are a multiple of 32 columns, so no tail).
// W is decoded exactly as the oracle does (the 16 values of a group's codes, (code - zero) * scale or
// NF4[code] * absmax or E2M1[code] * 2^(byte - 127) in float32, are a 16-entry table looked up per lane), so a
// 4-bit product differs from the float32 product of the decoded weight only in its summation order. The order
// depends on neither kRows, the parts nor the threads, nor the instruction set: with AVX-512 the byte widening and
// the table lookup are one instruction each (intrinsics; GCC 12 widens byte vectors lane by lane), elsewhere they
// are generic vector code (an AVX2 + FMA build gives the same bits, bfloat16 rows too: tests/test_native_kernels.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../_native.h"  // Lanes, Ints, Load, Widen, Splat, TreeSums, ShareParts

namespace {

using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using Ids = ffi::Buffer<ffi::S32, 1>;
template <ffi::DataType T>
using Stack = ffi::Buffer<T, 3>;

#ifdef __AVX512F__
constexpr int kRows = 8;  // 8 accumulators + x + loads fit the 32 zmm registers (4-bit: + 8 tables)
#else
constexpr int kRows = 4;
#endif

// kLanes int8 codes as float32 (exact): sign-extended and converted.
typedef int8_t Codes __attribute__((vector_size(kLanes)));

inline Lanes Load(const int8_t* p) {
#if defined(__AVX512F__)
  // GCC 12 converts a byte vector lane by lane; one vpmovsxbd does it
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  Codes c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, Lanes);
#endif
}

inline float Widen(int8_t v) { return float(v); }

// Software prefetch of the block of rows after the current one, a stretch of bytes per step of the inner loop. A
// block of narrow rows is kRows short streams (8 rows of 1 KB for int8 at I = 1024), too short for the hardware
// prefetcher to follow from memory: one thread streamed int8 [32000, 1024] at 8 GB/s without this, 26 GB/s with it
// (float32 rows: 21 GB/s, slower with it).
struct Ahead {
  const char* p;    // the next block's bytes not yet prefetched
  const char* end;  // the end of this part's rows

  template <int64_t Bytes>
  inline void Step() {
    for (int64_t b = 0; b < Bytes; b += 64) {
      if (p + b < end) __builtin_prefetch(p + b);
    }
    p += Bytes;
  }
};

// -- float and int8 weights: one value per element ------------------------------------------------------------

template <typename W>
constexpr bool kPrefetch = sizeof(W) < 4;  // float32 rows are long enough streams for the hardware prefetcher

// kLanes partial sums as kParts vectors of the machine's width (kVec floats: one AVX-512 register, half of them
// with AVX2, a quarter with NEON): lane l of a row's sums is lane l % kVec of part l / kVec, so the sums, their order
// and their bits are those of one kLanes-wide vector. Written with kLanes-wide vectors, GCC 12 kept an AVX2 build's
// accumulators on the stack (four loads and stores per product): 12 GB/s of bfloat16 rows where this streams 2x that.
#if defined(__AVX512F__)
constexpr int64_t kVec = 16;
#elif defined(__AVX__)
constexpr int64_t kVec = 8;
#else
constexpr int64_t kVec = 4;
#endif
constexpr int kParts = kLanes / kVec;
typedef float Vec __attribute__((vector_size(kVec * sizeof(float))));
typedef uint32_t VecWords __attribute__((vector_size(kVec * sizeof(uint32_t))));
typedef int8_t VecCodes __attribute__((vector_size(kVec)));

inline Vec LoadVec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec LoadVec(const int8_t* p) {  // int8 codes, sign-extended and converted (exact)
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  VecCodes c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, Vec);
#endif
}

// bfloat16 rows: a block of 32 columns is 16 words, each holding an even column's value in its low half and the
// next odd column's in its high half; the even values are the words shifted up, the odd ones the words masked (two
// integer operations per 32 values, where widening each half takes a shuffle and a shift: the shuffles were the
// loop's limit). As for 4-bit weights, lane l of block b sums W[32b + 2l] x[32b + 2l] then W[32b + 2l + 1]
// x[32b + 2l + 1], x reordered once per call to match (EvenOdd); the lanes then go through the same tree, then the
// tail i >= I - I % 32 in order. The vectors are the machine's width (kParts of them per kLanes), so the order and
// the bits are the same with AVX-512, AVX2 or NEON.
template <typename W>
constexpr bool kPairs = sizeof(W) == 2;

constexpr int64_t kPairBlock = 2 * kLanes;  // columns per block of bfloat16 pairs

// x [n] with each block of kPairBlock columns reordered even columns first (a tail of fewer stays in place).
inline void EvenOdd(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kPairBlock <= n; i += kPairBlock) {
    for (int64_t l = 0; l < kLanes; ++l) {
      out[i + l] = x[i + 2 * l];
      out[i + kLanes + l] = x[i + 2 * l + 1];
    }
  }
  for (; i < n; ++i) out[i] = x[i];
}

inline void LoadEvenOdd(const uint16_t* p, Vec* even, Vec* odd) {
  VecWords w;  // kVec words = 2 * kVec bfloat16 values
  std::memcpy(&w, p, sizeof w);
  const VecWords e = w << 16, o = w & 0xFFFF0000u;
  std::memcpy(even, &e, sizeof e);
  std::memcpy(odd, &o, sizeof o);
}

// y[q * ys + r] = w[r, :] . x[q * xs, :] for r < RowCount (rows I apart) and q < XCount: XCount rows of x share
// every load of the weight (a verify step's few positions, a small batch), the RowCount x XCount x kParts
// accumulators in registers. Each sum takes the same steps in the same order as with XCount = 1, so a row's result
// has the same bits whatever rows it shares the weight with. With kPairs<W>, x is in EvenOdd order.
template <int RowCount, int XCount, typename W>
inline void DotRows(const W* w, const float* x, int64_t xs, float* y, int64_t ys, int64_t I, const W* end) {
  Vec acc[XCount][RowCount][kParts] = {};
  Ahead ahead{reinterpret_cast<const char*>(w + RowCount * I), reinterpret_cast<const char*>(end)};
  int64_t i = 0;
  if constexpr (kPairs<W>) {
    for (; i + kPairBlock <= I; i += kPairBlock) {
      if constexpr (kPrefetch<W>) ahead.Step<RowCount * kPairBlock * sizeof(W)>();
      Vec xe[XCount][kParts], xo[XCount][kParts];
#pragma GCC unroll 4
      for (int q = 0; q < XCount; ++q) {
#pragma GCC unroll 4
        for (int p = 0; p < kParts; ++p) {
          xe[q][p] = LoadVec(x + q * xs + i + p * kVec);
          xo[q][p] = LoadVec(x + q * xs + i + kLanes + p * kVec);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RowCount; ++r) {
#pragma GCC unroll 4
        for (int p = 0; p < kParts; ++p) {
          Vec even, odd;
          LoadEvenOdd(reinterpret_cast<const uint16_t*>(w + r * I + i + 2 * p * kVec), &even, &odd);
#pragma GCC unroll 4
          for (int q = 0; q < XCount; ++q) {
            acc[q][r][p] += even * xe[q][p];
            acc[q][r][p] += odd * xo[q][p];
          }
        }
      }
    }
  } else {
    for (; i + kLanes <= I; i += kLanes) {
      if constexpr (kPrefetch<W>) ahead.Step<RowCount * kLanes * sizeof(W)>();
      Vec xi[XCount][kParts];
#pragma GCC unroll 4
      for (int q = 0; q < XCount; ++q) {
#pragma GCC unroll 4
        for (int p = 0; p < kParts; ++p) xi[q][p] = LoadVec(x + q * xs + i + p * kVec);
      }
#pragma GCC unroll 8
      for (int r = 0; r < RowCount; ++r) {
#pragma GCC unroll 4
        for (int p = 0; p < kParts; ++p) {
          const Vec wv = LoadVec(w + r * I + i + p * kVec);
#pragma GCC unroll 4
          for (int q = 0; q < XCount; ++q) acc[q][r][p] += wv * xi[q][p];
        }
      }
    }
  }
  for (int q = 0; q < XCount; ++q) {
    Lanes wide[RowCount];
    for (int r = 0; r < RowCount; ++r) std::memcpy(&wide[r], acc[q][r], sizeof wide[r]);
    float sums[RowCount];
    TreeSums<RowCount>(wide, sums);
    const float* xq = x + q * xs;
    for (int r = 0; r < RowCount; ++r) {
      float s = sums[r];
      for (int64_t t = i; t < I; ++t) s = std::fma(Widen(w[r * I + t]), xq[t], s);  // fused on every build
      y[q * ys + r] = s;
    }
  }
}

// Weight rows per DotRows block when several rows of x share it: the accumulators and the rows of x fit the
// registers (AVX-512, bfloat16: 4 x 4 sums + 4 x 2 halves of x, or 3 x 5 + 5 x 2, of 32; 8 rows of x spilled).
#ifdef __AVX512F__
constexpr int kRowsShared = 4;
#else
constexpr int kRowsShared = 2;
#endif
constexpr int kShared = 5;  // at most this many rows of x share one read of a weight block (k + 1 = 5)

// y[q * ys, :] = w @ x[q * xs, :] for w [J, I], q < XCount.
template <int XCount, typename W>
void Matvec(const W* w, const float* x, int64_t xs, float* y, int64_t ys, int64_t J, int64_t I) {
  constexpr int R = XCount == 1 ? kRows : XCount == 5 ? kRowsShared - 1 : kRowsShared;
  const W* end = w + J * I;
  int64_t j = 0;
  for (; j + R <= J; j += R) DotRows<R, XCount>(w + j * I, x, xs, y + j, ys, I, end);
  for (; j < J; ++j) DotRows<1, XCount>(w + j * I, x, xs, y + j, ys, I, end);
}

// x, ids and out of one item: x [M, I], ids [M], out [M, J].
struct Rows {
  const float* x;
  const int32_t* ids;
  float* out;
  int64_t M, J, I;
};

// run(m, count) for each run of up to kShared consecutive rows m .. m + n - 1 that choose the same matrix (every row
// of a plain weight), count a std::integral_constant<int, n> (the rows that share the weight's reads: a template
// argument of DotRows).
template <typename Run>
void SharedRuns(const Rows& r, Run&& run) {
  static_assert(kShared == 5, "one case per run length");
  for (int64_t m = 0, n; m < r.M; m += n) {
    for (n = 1; n < kShared && m + n < r.M && r.ids[m + n] == r.ids[m];) ++n;
    switch (n) {
      case 5: run(m, std::integral_constant<int, 5>{}); break;
      case 4: run(m, std::integral_constant<int, 4>{}); break;
      case 3: run(m, std::integral_constant<int, 3>{}); break;
      case 2: run(m, std::integral_constant<int, 2>{}); break;
      default: run(m, std::integral_constant<int, 1>{});
    }
  }
}

// A float weight w [E, J, I], or int8 codes with one scale per row, scale [E, J] (null for a float weight).
template <typename W>
struct DenseItem {
  Rows r;
  const W* w;
  const float* scale;
  std::vector<float> xp;  // kPairs<W>: x [M, I] in EvenOdd order

  int64_t RowBytes() const { return r.I * int64_t(sizeof(W)) + (scale ? 4 : 0); }

  void Reorder() {
    if constexpr (kPairs<W>) {
      xp.resize(r.M * r.I);
      for (int64_t m = 0; m < r.M; ++m) EvenOdd(r.x + m * r.I, xp.data() + m * r.I, r.I);
    }
  }

  // Output features [j0, j1) of every row; consecutive rows that choose the same matrix (all of a plain weight's)
  // share its reads, kShared at a time.
  void Compute(int64_t j0, int64_t j1) const {
    const int64_t J = r.J, I = r.I;
    const float* x = kPairs<W> ? xp.data() : r.x;
    SharedRuns(r, [&](int64_t m, auto count) {
      const int64_t row = r.ids[m] * J + j0;
      Matvec<decltype(count)::value>(w + row * I, x + m * I, I, r.out + m * J + j0, J, j1 - j0, I);
      if (scale) {
        for (int64_t q = 0; q < count; ++q) {
          float* y = r.out + (m + q) * J + j0;
          for (int64_t j = 0; j < j1 - j0; ++j) y[j] *= scale[row + j];
        }
      }
    });
  }
};

// -- 4-bit weights: nibble pairs, a table of 16 values per group -----------------------------------------------

enum class Nibble { kInt4, kInt4Zero, kNF4, kMXFP4 };

// The value of each code before its group's scale: two's-complement int4, or the NormalFloat-4 table
// (kernels_pallas/quant.py NF4_TABLE, bit for bit).
constexpr float kInt4Values[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
constexpr float kNF4Values[16] = {
    -0x1p+0f,         -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f,  -0x1.23449ap-2f, -0x1.7a6a7ep-3f,
    -0x1.74f0e2p-4f,  0x0p+0f,         0x1.45f5fep-4f,  0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c3497p-2f,    0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f,
};
// E2M1 (kernels_pallas/mxfp4.py E2M1): bit 3 sign, bits 2..1 exponent, bit 0 mantissa; code 8 is -0.
constexpr float kE2M1Values[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
static_assert(kLanes == 16, "a 4-bit table is one vector of kLanes values");

// table[idx[l] % 16] per lane.
inline Lanes Lookup(Lanes table, Words idx) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_permutexvar_ps((__m512i)idx, (__m512)table);  // uses the low 4 bits of each index
#elif !defined(__clang__)
  return __builtin_shuffle(table, (Ints)idx);  // GCC: the indices are taken modulo kLanes
#else
  Lanes r;
  for (int64_t l = 0; l < kLanes; ++l) r[l] = table[idx[l] & 15];
  return r;
#endif
}

// 16 bytes (32 columns' codes) zero-extended to one word per lane: lane l holds column 2l's code in bits 0..3 and
// column 2l + 1's in bits 4..7.
typedef uint8_t Bytes __attribute__((vector_size(kLanes)));

inline Words LoadPairs(const uint8_t* p) {
#if defined(__AVX512F__)
  return (Words)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // as Load(int8_t*)
#else
  Bytes b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, Words);
#endif
}

constexpr int64_t kBlock = 2 * kLanes;  // columns per 16 bytes of codes; groups are whole blocks

// An E8M0 scale byte as float32, as ml_dtypes' float8_e8m0fnu converts it: 2^(b - 127) (b = 0 is 2^-127, a
// subnormal), and 255 is NaN.
inline float E8M0(uint8_t b) {
  if (b == 255) return __builtin_nanf("");
  const uint32_t bits = b == 0 ? 0x00400000u : uint32_t(b) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr const float* NibbleValues(Nibble f) {
  return f == Nibble::kNF4 ? kNF4Values : f == Nibble::kMXFP4 ? kE2M1Values : kInt4Values;
}

// A 4-bit weight: codes [E, J, I/2], scale [E, J, G] (and zero [E, J, G]), groups of g = I / G columns. MXFP4's
// scales are E8M0 bytes (e8m0), the others' float32 (scale).
template <Nibble F>
struct NibbleItem {
  Rows r;
  const uint8_t* codes;
  const float* scale;
  const uint8_t* e8m0;
  const int8_t* zero;
  int64_t G, g;
  std::vector<float> xp;  // [M, I]: x, each block of 32 columns reordered even columns first

  int64_t RowBytes() const { return r.I / 2 + G * (F == Nibble::kInt4Zero ? 5 : F == Nibble::kMXFP4 ? 1 : 4); }

  void Reorder() {
    xp.resize(r.M * r.I);
    for (int64_t n = 0; n < r.M * r.I; n += kBlock) {
      for (int64_t l = 0; l < kLanes; ++l) {
        xp[n + l] = r.x[n + 2 * l];
        xp[n + kLanes + l] = r.x[n + 2 * l + 1];
      }
    }
  }

  // The 16 values of group k of weight row `row` (of the whole stack), as the oracle decodes them in float32:
  // (code - zero) * scale, NF4[code] * absmax, or E2M1[code] * 2^(byte - 127).
  Lanes Table(int64_t row, int64_t k) const {
    Lanes values;
    std::memcpy(&values, NibbleValues(F), sizeof values);
    const Lanes s = Splat(F == Nibble::kMXFP4 ? E8M0(e8m0[row * G + k]) : scale[row * G + k]);
    if constexpr (F == Nibble::kInt4Zero) return (values - Splat(float(zero[row * G + k]))) * s;
    return values * s;
  }

  // y[q * ys + r] = W[row + r, :] . x[q * xs, :] for r < RowCount and q < XCount, x reordered (xp); `end`: the end
  // of this part's codes. XCount rows of x share every decoded block of the weight (the lookups, a 4-bit product's
  // main cost), each sum in the same steps and order as with XCount = 1 (the same bits).
  template <int RowCount, int XCount>
  void DotRows(int64_t row, const float* x, int64_t xs, float* y, int64_t ys, const uint8_t* end) const {
    const int64_t stride = r.I / 2;
    const uint8_t* c = codes + row * stride;
    Ahead ahead{reinterpret_cast<const char*>(c + RowCount * stride), reinterpret_cast<const char*>(end)};
    Lanes acc[XCount][RowCount] = {};
    for (int64_t k = 0, i = 0; k < G; ++k) {
      Lanes t[RowCount];
      for (int q = 0; q < RowCount; ++q) t[q] = Table(row + q, k);
      for (const int64_t stop = i + g; i < stop; i += kBlock) {
        ahead.Step<RowCount * kBlock / 2>();
        Lanes xe[XCount], xo[XCount];
        for (int u = 0; u < XCount; ++u) {
          xe[u] = Load(x + u * xs + i);
          xo[u] = Load(x + u * xs + i + kLanes);
        }
        for (int q = 0; q < RowCount; ++q) {
          const Words b = LoadPairs(c + q * stride + i / 2);
          const Lanes we = Lookup(t[q], b), wo = Lookup(t[q], b >> 4);
          for (int u = 0; u < XCount; ++u) {
            acc[u][q] += we * xe[u];
            acc[u][q] += wo * xo[u];
          }
        }
      }
    }
    for (int u = 0; u < XCount; ++u) TreeSums<RowCount>(acc[u], y + u * ys);
  }

  // Output features [j0, j1) of every row; consecutive rows that choose the same matrix share its decoded blocks,
  // kShared at a time.
  void Compute(int64_t j0, int64_t j1) const {
    SharedRuns(r, [&](int64_t m, auto count) {
      constexpr int X = decltype(count)::value, R = X == 1 ? kRows : kRowsShared / 2;
      const int64_t first = r.ids[m] * r.J;  // the chosen matrix's first row
      const float* x = xp.data() + m * r.I;
      float* y = r.out + m * r.J;
      const uint8_t* end = codes + (first + j1) * (r.I / 2);
      int64_t j = j0;
      for (; j + R <= j1; j += R) DotRows<R, X>(first + j, x, r.I, y + j, r.J, end);
      for (; j < j1; ++j) DotRows<1, X>(first + j, x, r.I, y + j, r.J, end);
    });
  }
};

// -- weights in 2 MB pages ------------------------------------------------------------------------------------

// A weight streamed at decode crosses a 4 KB page every 4 KB: each crossing is a TLB miss, and the hardware
// prefetchers stop at page ends. A decode step's bfloat16 products (36 of 2-6 MB and one of 65 MB, two threads, a
// 2-core AVX-512 machine) streamed 32 GB/s in 2 MB pages against 27 in 4 KB pages, medians of four alternated
// runs each (their plain read rate: 34 against 30). XLA:CPU allocates its buffers with the C library, which
// leaves them in 4 KB pages where the system grants 2 MB ones only on request (transparent huge pages in
// "madvise" mode, the common default), so the second call that reads a weight at the same address asks for its
// pages to be 2 MB ones and collapsed into them now (MADV_COLLAPSE, Linux 6.1+: a copy, once; the contents stay;
// elsewhere the calls fail and nothing changes). The second, not the first: a buffer met once (a copy made afresh
// at a new address each step) is never asked for, so no step pays a collapse twice. The whole 2 MB pages the weight
// touches are asked for, so a neighbouring buffer may share them.
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

void HugePages(const void* data, int64_t bytes) {
#if defined(__linux__)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < int64_t(kHuge)) return;
  static std::mutex mu;
  static std::unordered_map<const void*, int> seen;  // calls that read each address
  {
    std::lock_guard<std::mutex> lock(mu);
    if (seen.size() > (1 << 16)) seen.clear();  // only addresses met once can fill it; weights come back
    if (++seen[data] != 2) return;
  }
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes + kHuge - 1) & ~(kHuge - 1);
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_COLLAPSE);
#endif
}

// -- the work: parts of every item, claimed by the threads -----------------------------------------------------

// Work is cut into parts of about this many weight bytes, claimed one at a time by the threads: each part is a
// stream the prefetchers start anew (parts of 128 KB streamed a decode step's bfloat16 products at 28.6 GB/s, of
// 512 KB at 29.8, medians of five alternated runs; a 1 MB weight is still shared by both threads of 2 cores).
constexpr int64_t kPartBytes = 512 << 10;
// ... and into at least this many parts where it has the rows: the 4-bit products are compute-bound (12-14 GB/s of
// codes per core), and one part of a 0.5 MB int4 weight would leave the other cores idle (147.8 tok/s for int4 g32
// against 175.6 with more parts).
constexpr int64_t kMinParts = 4;

// Item: Compute(j0, j1) writes output features [j0, j1) of every row; RowBytes() is one weight row's bytes.
template <typename Item>
ffi::Error RunParts(ffi::ThreadPool pool, const std::vector<Item>& items) {
  struct Part {
    const Item* item;
    int64_t j0, j1;
  };
  // Each item's output features are split so that every thread streams its share of each chosen matrix.
  std::vector<Part> parts;
  for (const Item& it : items) {
    const int64_t J = it.r.J, bytes = it.r.M * J * it.RowBytes();
    const int64_t n = std::max<int64_t>(1, std::min<int64_t>(std::max(bytes / kPartBytes, kMinParts), J / kRows));
    for (int64_t p = 0; p < n; ++p) {
      const int64_t j0 = J * p / n / kRows * kRows, j1 = p + 1 == n ? J : J * (p + 1) / n / kRows * kRows;
      if (j1 > j0) parts.push_back(Part{&it, j0, j1});
    }
  }
  struct None {};
  const Part* list = parts.data();
  ShareParts<None>(pool, static_cast<int64_t>(parts.size()),
                   [list](int64_t p, None&) { list[p].item->Compute(list[p].j0, list[p].j1); });
  return ffi::Error::Success();
}

// -- the handlers: arguments checked, items built ---------------------------------------------------------------

ffi::Error Invalid(int64_t i, const std::string& what) {
  return ffi::Error::InvalidArgument("matvec group, item " + std::to_string(i) + ": " + what);
}

// The arguments of one item: x, the weight's Fields fields, ids.
template <int Fields>
struct ItemArgs {
  static constexpr int64_t kCount = Fields + 2;
  ffi::RemainingArgs& args;
  int64_t base;

  template <typename T>
  ffi::ErrorOr<T> field(int f) const { return args.get<T>(base + 1 + f); }
};

ffi::Error CheckCount(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, int64_t per, const char* what) {
  if (static_cast<int64_t>(args.size()) != per * static_cast<int64_t>(rets.size())) {
    return ffi::Error::InvalidArgument(std::string("matvec group: expected ") + what + " per result");
  }
  return ffi::Error::Success();
}

// x [M, I], ids [M] (each in [0, E)) and out [M, J] of item i, checked; `expected` names the item's arguments.
template <int Fields>
ffi::Error GetRows(int64_t i, const ItemArgs<Fields>& a, ffi::RemainingRets& rets, int64_t E, int64_t J, int64_t I,
                   const std::string& expected, Rows* rows) {
  auto x = a.args.template get<F32Matrix>(a.base);
  auto ids = a.args.template get<Ids>(a.base + Fields + 1);
  auto out = rets.get<F32Matrix>(i);
  if (!x || !ids || !out) return Invalid(i, "expected " + expected + ", ids s32[M], out f32[M, J]");
  const int64_t M = ids->dimensions()[0];
  if (x->dimensions()[0] != M || x->dimensions()[1] != I || (*out)->dimensions()[0] != M ||
      (*out)->dimensions()[1] != J) {
    return Invalid(i, "shapes must be x [M, I], w [E, J, I], ids [M], out [M, J]");
  }
  const int32_t* id = ids->typed_data();
  for (int64_t m = 0; m < M; ++m) {
    if (id[m] < 0 || id[m] >= E) return Invalid(i, "expert id out of range");
  }
  *rows = Rows{x->typed_data(), id, (*out)->typed_data(), M, J, I};
  return ffi::Error::Success();
}

// WT: the weights' FFI element type; W: how their elements are stored.
template <ffi::DataType WT, typename W>
ffi::Error FloatGroup(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (auto e = CheckCount(args, rets, 3, "three arguments (x, w, ids)"); e.failure()) return e;
  const std::string expected = std::string("x f32[M, I], w ") + (WT == ffi::F32 ? "f32" : "bf16") + "[E, J, I]";
  std::vector<DenseItem<W>> items(rets.size());
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const ItemArgs<1> a{args, 3 * i};
    auto w = a.field<Stack<WT>>(0);
    if (!w) return Invalid(i, "expected " + expected);
    const auto wd = w->dimensions();
    items[i].w = reinterpret_cast<const W*>(w->untyped_data());
    items[i].scale = nullptr;
    HugePages(w->untyped_data(), w->size_bytes());
    if (auto e = GetRows(i, a, rets, wd[0], wd[1], wd[2], expected, &items[i].r); e.failure()) return e;
    items[i].Reorder();
  }
  return RunParts(pool, items);
}

ffi::Error Int8Group(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (auto e = CheckCount(args, rets, 4, "four arguments (x, q, scale, ids)"); e.failure()) return e;
  const std::string expected = "x f32[M, I], q s8[E, J, I], scale f32[E, J, 1]";
  std::vector<DenseItem<int8_t>> items(rets.size());
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const ItemArgs<2> a{args, 4 * i};
    auto q = a.field<Stack<ffi::S8>>(0);
    auto scale = a.field<Stack<ffi::F32>>(1);
    if (!q || !scale) return Invalid(i, "expected " + expected);
    const auto qd = q->dimensions(), sd = scale->dimensions();
    if (sd[0] != qd[0] || sd[1] != qd[1] || sd[2] != 1) return Invalid(i, "scale must be [E, J, 1] for q [E, J, I]");
    items[i].w = q->typed_data();
    items[i].scale = scale->typed_data();
    HugePages(q->untyped_data(), q->size_bytes());
    if (auto e = GetRows(i, a, rets, qd[0], qd[1], qd[2], expected, &items[i].r); e.failure()) return e;
  }
  return RunParts(pool, items);
}

template <Nibble F>
ffi::Error NibbleGroup(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr int kFields = F == Nibble::kInt4Zero ? 3 : 2;
  constexpr int64_t kPer = kFields + 2;
  if (auto e = CheckCount(args, rets, kPer, kFields == 3 ? "five arguments (x, packed, scale, zero, ids)"
                                                         : "four arguments (x, packed, scale, ids)");
      e.failure()) {
    return e;
  }
  constexpr ffi::DataType kScale = F == Nibble::kMXFP4 ? ffi::U8 : ffi::F32;
  const std::string expected = std::string("x f32[M, I], packed u8[E, J, I/2], scale ") +
                               (F == Nibble::kMXFP4 ? "u8" : "f32") + "[E, J, I/g]" +
                               (kFields == 3 ? ", zero s8[E, J, I/g]" : "");
  std::vector<NibbleItem<F>> items(rets.size());
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const ItemArgs<kFields> a{args, kPer * i};
    auto codes = a.template field<Stack<ffi::U8>>(0);
    auto scale = a.template field<Stack<kScale>>(1);
    if (!codes || !scale) return Invalid(i, "expected " + expected);
    const auto cd = codes->dimensions(), sd = scale->dimensions();
    const int64_t E = cd[0], J = cd[1], I = 2 * cd[2], G = sd[2];
    if (sd[0] != E || sd[1] != J || G < 1 || I % G) {
      return Invalid(i, "scale must be [E, J, I/g] for packed [E, J, I/2]");
    }
    NibbleItem<F>& it = items[i];
    it.codes = codes->typed_data();
    HugePages(codes->untyped_data(), codes->size_bytes());
    it.scale = nullptr;
    it.e8m0 = nullptr;
    if constexpr (F == Nibble::kMXFP4) {
      it.e8m0 = scale->typed_data();
    } else {
      it.scale = scale->typed_data();
    }
    it.zero = nullptr;
    it.G = G;
    it.g = I / G;
    if (it.g % kBlock) {
      return Invalid(i, "groups of " + std::to_string(it.g) + " columns (the kernel takes multiples of 32)");
    }
    if constexpr (kFields == 3) {
      auto zero = a.template field<Stack<ffi::S8>>(2);
      if (!zero) return Invalid(i, "expected " + expected);
      const auto zd = zero->dimensions();
      if (zd[0] != E || zd[1] != J || zd[2] != G) return Invalid(i, "zero must have the shape of scale");
      it.zero = zero->typed_data();
    }
    if (auto e = GetRows(i, a, rets, E, J, I, expected, &it.r); e.failure()) return e;
    it.Reorder();
  }
  return RunParts(pool, items);
}

}  // namespace

#define KIMI_MATVEC_HANDLER(name, fn) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn, ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().RemainingArgs().RemainingRets())

KIMI_MATVEC_HANDLER(KimiMatvecGroupF32, (FloatGroup<ffi::F32, float>));
KIMI_MATVEC_HANDLER(KimiMatvecGroupBF16, (FloatGroup<ffi::BF16, uint16_t>));
KIMI_MATVEC_HANDLER(KimiMatvecGroupI8, Int8Group);
KIMI_MATVEC_HANDLER(KimiMatvecGroupI4, NibbleGroup<Nibble::kInt4>);
KIMI_MATVEC_HANDLER(KimiMatvecGroupI4Z, NibbleGroup<Nibble::kInt4Zero>);
KIMI_MATVEC_HANDLER(KimiMatvecGroupNF4, NibbleGroup<Nibble::kNF4>);
KIMI_MATVEC_HANDLER(KimiMatvecGroupMXFP4, NibbleGroup<Nibble::kMXFP4>);
