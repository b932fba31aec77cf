// tandem's CPU kernels: everything in a decoder layer that is not a weight matmul.
//
// Each op replaces a chain of eager torch ops (about 40 small ops per layer become 7
// calls), works in place on strided views where it can (q/k/v are column slices of
// the fused qkv projection), and computes in float32. For bfloat16 tensors every op
// rounds where the reference implementation (transformers) rounds, so results differ
// from the torch path only where float32 math itself differs (an ulp of exp or sqrt,
// the order of a sum), never by an extra rounding.
//
// Built with torch.utils.cpp_extension on first use (see cpu.py); -march=native lets
// gcc vectorise the inner loops for the CPU it runs on (AVX2 or AVX-512).

#include <torch/python.h>  // not torch/extension.h: its C++ frontend took 25 s of the build
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <cmath>
#include <immintrin.h>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }

// Rows per thread task for elementwise ops: about 32k elements, so a decode step's few
// rows run on the calling thread (waking a pool costs more than the work).
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements));
}
// Round through T: identity for float, bfloat16 rounding for bf16.
template <typename T> inline float round_t(float x) { return static_cast<float>(static_cast<T>(x)); }

// -- RMSNorm -----------------------------------------------------------------------
// out = weight * T(x / rms(x)), the norm in float32 and the scale in T, as the reference.
// With a residual: residual = T(x + residual) first, and the norm reads the sum.

// One row, held in float32 in ``buf``: out = weight * T(buf / rms(buf)).
template <typename T>
inline void norm_row(T* o, const float* buf, const T* weight, int64_t dim, double eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < dim; ++i) sum += buf[i] * buf[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
  for (int64_t i = 0; i < dim; ++i) {
    o[i] = static_cast<T>(to_f(weight[i]) * round_t<T>(buf[i] * inv));
  }
}

template <typename T>
void rms_norm_impl(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t dim,
                   int64_t out_stride, int64_t x_stride, int64_t res_stride, double eps) {
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      if (residual != nullptr) {
        T* rr = residual + r * res_stride;
        for (int64_t i = 0; i < dim; ++i) {
          const T s = static_cast<T>(to_f(xr[i]) + to_f(rr[i]));
          rr[i] = s;
          buf[i] = to_f(s);
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) buf[i] = to_f(xr[i]);
      }
      norm_row<T>(out + r * out_stride, buf.data(), weight, dim, eps);
    }
  });
}

// Each head of x [T, H, D] (strided tokens and heads) normed on its own (q/k norms).
template <typename T>
void rms_norm_heads_impl(T* out, const T* x, const T* weight, int64_t tokens, int64_t heads,
                         int64_t dim, int64_t out_t, int64_t out_h, int64_t x_t, int64_t x_h,
                         double eps) {
  at::parallel_for(0, tokens * heads, grain_rows(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads, h = r % heads;
      const T* xr = x + t * x_t + h * x_h;
      for (int64_t i = 0; i < dim; ++i) buf[i] = to_f(xr[i]);
      norm_row<T>(out + t * out_t + h * out_h, buf.data(), weight, dim, eps);
    }
  });
}

// -- rotary (neox: rotate the two halves of the first rot_dim features) -------------

template <typename T>
void rotary_impl(T* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                 const int64_t* positions, const float* cos_sin, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, tokens * heads, grain_rows(rot_dim), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      const float* cos = cos_sin + positions[t] * rot_dim;  // [cos(half) | sin(half)]
      const float* sin = cos + half;
      T* v = x + t * token_stride + h * head_stride;
      for (int64_t i = 0; i < half; ++i) {
        const float c = round_t<T>(cos[i]), s = round_t<T>(sin[i]);
        const float a = to_f(v[i]), b = to_f(v[i + half]);
        v[i] = static_cast<T>(round_t<T>(a * c) + round_t<T>(-b * s));
        v[i + half] = static_cast<T>(round_t<T>(b * c) + round_t<T>(a * s));
      }
    }
  });
}

// -- act(gate) * up: silu (Llama) or tanh-approximated GELU (Gemma's GeGLU) --------

enum class Act { kSilu, kGeluTanh };

template <Act A> inline float activate(float g) {
  if constexpr (A == Act::kSilu) {
    // Under -ffast-math (no infinities assumed) exp(-g) overflowing made NaN for a gate
    // under -88, where silu is -0 (a random IQ4_XS file's gates of -945): below -80 it
    // is 0 to float's precision.
    return g < -80.f ? 0.f : g / (1.f + std::exp(-g));
  } else {
    constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + std::tanh(kBeta * (g + 0.044715f * g * g * g)));
  }
}

// out [R, dim] = combine(gate, up) of x [R, 2 * dim] (gate half, then up half), each
// element widened to float and the result rounded to T once.
template <typename T, typename Combine>
void gated_rows(T* out, const T* x, int64_t rows, int64_t dim, int64_t out_stride,
                int64_t x_stride, Combine combine) {
  at::parallel_for(0, rows, grain_rows(2 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + dim;
      T* o = out + r * out_stride;
      for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<T>(combine(to_f(gate[i]), to_f(up[i])));
    }
  });
}

template <typename T, Act A>
void act_and_mul_impl(T* out, const T* x, int64_t rows, int64_t dim, int64_t out_stride,
                      int64_t x_stride) {
  gated_rows(out, x, rows, dim, out_stride, x_stride,
             [](float g, float u) { return round_t<T>(activate<A>(g)) * u; });
}

// gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
// g = min(gate, limit), in float32, rounded once. The experts' loop (models/gpt_oss.py)
// and their one call (moe_ops.cpp) both run this, so the two agree to the bit.
template <typename T>
void clamped_swiglu_impl(T* out, const T* x, int64_t rows, int64_t dim, int64_t out_stride,
                         int64_t x_stride, float alpha, float limit) {
  gated_rows(out, x, rows, dim, out_stride, x_stride, [=](float gate, float up) {
    const float g = std::min(gate, limit);
    const float u = std::clamp(up, -limit, limit);
    const float z = alpha * g;  // (exp(-z) would overflow, under -ffast-math to NaN)
    const float sigmoid = z < -80.f ? 0.f : 1.f / (1.f + std::exp(-z));
    return (u + 1.f) * (g * sigmoid);
  });
}

// -- paged KV cache ------------------------------------------------------------------

// k/v: [T, Hkv, D] with row stride; cache rows [num_blocks * block_size, Hkv * D].
template <typename T>
void write_kv_impl(const T* k, const T* v, int64_t tokens, int64_t row, int64_t k_stride,
                   int64_t v_stride, T* k_cache, T* v_cache, const int64_t* slots) {
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy(k + t * k_stride, k + t * k_stride + row, k_cache + slots[t] * row);
    std::copy(v + t * v_stride, v + t * v_stride + row, v_cache + slots[t] * row);
  }
}

// How a cache row of one (token, KV head) is stored: as a float type (KV = T, bfloat16
// or fp8 e4m3), or int8 (KV = int8_t) followed by its float32 scale: head_dim + 4 bytes, the value
// being scale * q. tandem/runner/kv_cache.py writes the same layout from torch.
template <typename KV>
struct KVRows {
  static constexpr int64_t kExtra = std::is_same_v<KV, int8_t> ? 4 : 0;
  static float scale(const KV* row, int64_t head_dim) {
    if constexpr (kExtra == 0) {
      return 1.f;
    } else {
      float s;
      std::memcpy(&s, row + head_dim, sizeof(s));
      return s;
    }
  }
};

// One cache element as float32; bfloat16 from its bits (a shift the compiler vectorises,
// where c10::BFloat16's conversion stays scalar).
template <typename KV> inline float kv_f(const KV* row, int64_t d) { return to_f(row[d]); }
template <> inline float kv_f<c10::BFloat16>(const c10::BFloat16* row, int64_t d) {
  const uint32_t word = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[d]) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// Asks for a row's cache lines ahead of their use, into L2 (locality hint 2: on the
// EPYC measured, hint 3 (L1) stalled on its few line-fill buffers and ran at half the
// speed when a kernel streams thousands of rows).
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(row) + b, 0, 2);
}

// A vector of floats as wide as the CPU's registers (GCC's vector extension: 16 lanes
// with AVX-512, else 8), read from and written to memory of any alignment. 16-lane
// vectors on an AVX2 build ran at a third of the speed (their shuffles split badly).
#if defined(__AVX512F__)
constexpr int64_t kVecLanes = 16;
#else
constexpr int64_t kVecLanes = 8;
#endif
typedef float VecF __attribute__((vector_size(kVecLanes * 4)));
typedef float VecFu __attribute__((vector_size(kVecLanes * 4), aligned(4)));
inline VecF load_lanes(const float* p) { return *reinterpret_cast<const VecFu*>(p); }
inline void store_lanes(float* p, const VecF& v) { *reinterpret_cast<VecFu*>(p) = v; }

// kVecLanes elements of a cache row as float32, read straight from the row, where the
// conversion is one or two instructions: float; with AVX-512, bfloat16 (its bits moved
// up a half-word) and int8 (widened, then converted; the row's scale is applied after,
// as for a copy). The values kv_f gives, without first widening each head row into a
// float32 buffer and reading it back. AVX2's narrower conversions measured 0.90x the
// copies (docs/BENCHMARKS.md), so there only float rows are read in place.
#if defined(__AVX512F__)
template <typename KV>
constexpr bool kRowLanes = std::is_same_v<KV, float> || std::is_same_v<KV, c10::BFloat16> ||
                           std::is_same_v<KV, int8_t>;
#else
template <typename KV>
constexpr bool kRowLanes = std::is_same_v<KV, float>;
#endif
template <typename KV>
inline VecF row_lanes(const KV* p) {
  static_assert(kRowLanes<KV>, "row_lanes: a type read in place");
  if constexpr (std::is_same_v<KV, float>) {
    return load_lanes(p);
#if defined(__AVX512F__)
  } else if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<VecF>(_mm512_slli_epi32(bits, 16));
  } else {
    return reinterpret_cast<VecF>(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#endif
  }
}

constexpr int64_t kTileTokens = 8;  // keys (values) one query takes at a time

// s[i] = the sum of v[i]'s lanes, for eight vectors at once: lane j is added to lane
// j + kVecLanes / 2, then j + kVecLanes / 4, ... j + 1, the same order in every slot
// (a score does not depend on which slot of a tile its key had). Eight horizontal sums
// one by one cost about three times the shuffles.
inline void lane_sums8(const VecF (&v)[kTileTokens], float (&s)[kTileTokens]) {
  VecF h[4], f[2];
#if defined(__AVX512F__)
  for (int i = 0; i < 4; ++i)
    h[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                   18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    f[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                   18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                   21, 22, 23, 28, 29, 30, 31);
  const VecF g = __builtin_shufflevector(f[0], f[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                         21, 24, 25, 28, 29) +
                 __builtin_shufflevector(f[0], f[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                         23, 26, 27, 30, 31);
  typedef float Vec8 __attribute__((vector_size(32)));
  const Vec8 sums = __builtin_shufflevector(g, g, 0, 2, 4, 6, 8, 10, 12, 14) +
                    __builtin_shufflevector(g, g, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  for (int i = 0; i < 4; ++i)
    h[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    f[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  const VecF sums = __builtin_shufflevector(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                    __builtin_shufflevector(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
  for (int i = 0; i < kTileTokens; ++i) s[i] = sums[i];
}

// The queries of one KV head that take a tile's rows together (key_scores,
// add_values): a bfloat16 or int8 row read in place is loaded and converted once for
// all of them, not once each (the kernel 1.08-1.20x at three and four query heads a
// KV head, 1.11-1.47x at eight, on a 2-vCPU Zen 5 EPYC: docs/BENCHMARKS.md). As many
// as keep their sums in registers (AVX-512 has 32 vector registers; AVX2 builds read
// no narrow rows in place). One at a time for float32 rows, which need no conversion:
// several at once measured no faster.
#if defined(__AVX512F__)
constexpr int64_t kVecRegisters = 32;
#else
constexpr int64_t kVecRegisters = 16;
#endif
template <int64_t HD>
constexpr bool kUnrolled = HD > 0 && HD % kVecLanes == 0;  // rows as whole vectors
template <int64_t HD, typename Row>
constexpr int64_t key_queries() {
  // Each holds kTileTokens sums in registers; the queries' own vectors are read from L1
  // where the rest do not fit (at head size 128, two queries a run measured 1.06-1.10x
  // one, three 1.08-1.14x).
  int64_t q = 1;
  while (kUnrolled<HD> && !std::is_same_v<Row, float> &&
         (q + 1) * kTileTokens <= kVecRegisters - 8)
    ++q;
  return q;
}
template <int64_t HD, typename Row>
constexpr int64_t value_queries() {  // each holds HD / kVecLanes sums, in half the registers
  if constexpr (kUnrolled<HD> && !std::is_same_v<Row, float>)
    return std::max<int64_t>(1, kVecRegisters / 2 / (HD / kVecLanes));
  return 1;
}

// fn(std::integral_constant<int64_t, size>, i) for one run [i, i + size), size <= Q.
template <int64_t Q, typename Fn>
inline void run_of(int64_t size, int64_t i, Fn&& fn) {
  if constexpr (Q > 1) {
    if (size < Q) return run_of<Q - 1>(size, i, fn);
  }
  fn(std::integral_constant<int64_t, Q>{}, i);
}

// [begin, end) in as few runs of at most Q as it takes, their sizes differing by at
// most one (eight queries at most three a run: 3 + 3 + 2; four: 2 + 2, not 3 + 1, whose
// single query shares nothing: 0.94-0.99x of 2 + 2 on the 1B shape).
template <int64_t Q, typename Fn>
inline void in_runs(int64_t begin, int64_t end, Fn&& fn) {
  const int64_t n = end - begin, runs = (n + Q - 1) / Q;
  for (int64_t r = 0, i = begin; r < runs; ++r) {
    const int64_t size = n / runs + (r < n % runs ? 1 : 0);
    run_of<Q>(size, i, fn);
    i += size;
  }
}

// scores[j] = (q . keys[j]) * key_scales[j] for the tile's ``count`` keys (rows of one
// head: float32, or a cache's own rows where row_lanes reads them), for Q queries at
// once (q: the first's HD floats, the next after it; its scores ``score_stride`` after
// the first's). With the head size a multiple of kVecLanes known at compile time, the
// dot products stay in registers and their lanes are summed eight keys at a time.
// Each query's products are those of Q = 1, in the same order; since -ffast-math may
// still regroup them per Q, a row's queries take the same runs in a decode and in a
// verification run (decode_attention_impl), so the two agree to the bit.
template <int64_t HD, int64_t Q, typename Row>
inline void key_scores(const float* __restrict q, const Row* const* keys,
                       const float* key_scales, int64_t count, int64_t head_dim,
                       float* __restrict scores, int64_t score_stride) {
  if constexpr (kUnrolled<HD>) {
    constexpr int64_t kVecs = HD / kVecLanes;
    VecF query[Q][kVecs], dots[Q][kTileTokens];
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t c = 0; c < kVecs; ++c) query[i][c] = load_lanes(q + i * HD + kVecLanes * c);
    for (int64_t j = 0; j < kTileTokens; ++j) {
      VecF dot[Q] = {};
      if (j < count)
        for (int64_t c = 0; c < kVecs; ++c) {
          const VecF key = row_lanes(keys[j] + kVecLanes * c);
          for (int64_t i = 0; i < Q; ++i) dot[i] += query[i][c] * key;
        }
      for (int64_t i = 0; i < Q; ++i) dots[i][j] = dot[i];
    }
    for (int64_t i = 0; i < Q; ++i) {
      float sums[kTileTokens];
      lane_sums8(dots[i], sums);
      for (int64_t j = 0; j < count; ++j) scores[i * score_stride + j] = sums[j] * key_scales[j];
    }
  } else {
    static_assert(Q == 1);
    const int64_t n = HD > 0 ? HD : head_dim;
    for (int64_t j = 0; j < count; ++j) {
      float sum = 0.f;
      for (int64_t d = 0; d < n; ++d) sum += q[d] * keys[j][d];
      scores[j] = sum * key_scales[j];
    }
  }
}

// One cache row as float32: float rows in place, others widened into ``buffer``.
template <int64_t HD, typename KV>
inline const float* row_as_float(const KV* row, float* __restrict buffer, int64_t head_dim) {
  if constexpr (std::is_same_v<KV, float>) {
    return row;
  } else {
    const int64_t n = HD > 0 ? HD : head_dim;
    for (int64_t d = 0; d < n; ++d) buffer[d] = kv_f(row, d);
    return buffer;
  }
}

// out += weights[j] * values[j] over the tile's ``count`` value rows, in key order, for
// Q queries at once (out: the first's sums, the next HD floats after it; weights:
// kTileTokens a query). With the head size a multiple of kVecLanes known at compile
// time, the sums stay in registers across the tile (one load and store of them per
// tile, not per key). Runs of queries as for key_scores.
template <int64_t HD, int64_t Q, typename Row>
inline void add_values(float* __restrict out, const Row* const* values,
                       const float* weights, int64_t count, int64_t head_dim) {
  if constexpr (kUnrolled<HD>) {
    constexpr int64_t kVecs = HD / kVecLanes;
    VecF sum[Q][kVecs];
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t c = 0; c < kVecs; ++c) sum[i][c] = load_lanes(out + i * HD + kVecLanes * c);
    for (int64_t j = 0; j < count; ++j)
      for (int64_t c = 0; c < kVecs; ++c) {
        const VecF value = row_lanes(values[j] + kVecLanes * c);
        for (int64_t i = 0; i < Q; ++i) sum[i][c] += weights[i * kTileTokens + j] * value;
      }
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t c = 0; c < kVecs; ++c) store_lanes(out + i * HD + kVecLanes * c, sum[i][c]);
  } else {
    static_assert(Q == 1);
    const int64_t n = HD > 0 ? HD : head_dim;
    for (int64_t j = 0; j < count; ++j)
      for (int64_t d = 0; d < n; ++d) out[d] += weights[j] * values[j][d];
  }
}

// Flash-decoding: a few query rows per sequence against its paged K/V, K/V read once.
//
// Each sequence's context is cut into spans of kSpanTokens positions (absolute
// positions: span j holds [j * kSpanTokens, (j + 1) * kSpanTokens)), and the work items
// are (sequence, span, run of KV heads), so that one long sequence, or a model with
// fewer KV heads than there are cores, still keeps every thread reading K/V. An item
// computes, for each of its query rows (the G query heads sharing each of its KV heads,
// for each row of the sequence), the scores against its span's keys, their maximum m,
// the sum l of exp(score - m) and acc = sum exp(score - m) * value. A sequence of one
// span writes acc / l; otherwise a second pass merges the spans: with M the largest m,
//     out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j
// (spans a row does not reach are skipped). The spans depend on positions only, so a
// row's result depends on its own context alone: not on the batch, the thread count,
// or other rows of its sequence (a decode computes the same with or without drafts).
// With an int8 cache each row's scale multiplies its dot product (K) or its weight (V).
//
// Memory order: a cache token row holds all KV heads side by side, so an item reads
// its span a tile of kTileTokens rows at a time, every KV head of its run from each
// row (K, then V, each row prefetched kAheadTokens ahead), and each query takes its
// head's rows of the tile in registers (eight dot products reduced together; the value
// sum loaded and stored once a tile), while the tile is in L1.
// Reading one head at a time instead (a few hundred bytes of every 2 KB token row,
// each row fetched into L1) ran at a third to two thirds of this speed on the EPYC
// measured (benchmarks/decode_attention.py). Items take all KV heads unless there are
// too few spans to keep the threads busy; how the heads are split never changes a
// result.
//
// HD: the head size when known at compile time (64, 128: the common ones), 0 for any:
// with it fixed, the per-key dot products and value updates unroll into registers
// (the kernel is bound by those instructions, not by memory, without it).
constexpr int64_t kSpanTokens = 256;
constexpr int64_t kAheadTokens = 8;  // token rows prefetched ahead of the one being read

template <typename T, typename KV, int64_t HD = 0>
void decode_attention_impl(T* out, int64_t out_stride, const T* q, int64_t q_stride,
                           int64_t num_seqs, int64_t num_heads, int64_t head_dim_arg,
                           const KV* k_ptr, const KV* v_ptr, int64_t block_size,
                           int64_t num_kv_heads, const int64_t* tables, int64_t table_width,
                           const int64_t* lens, double scale, int64_t window,
                           const int64_t* row_starts = nullptr, const float* sinks = nullptr) {
  // Rows of sequence s: [row_starts[s], row_starts[s + 1]) (nullptr: row s alone), each a
  // query token attending to the first lens[row] tokens of its sequence's context (minus
  // the window). sinks (nullptr: none): a logit per query head that joins each row's
  // softmax denominator and adds no value (gpt-oss's attention sinks).
  const int64_t head_dim = HD > 0 ? HD : head_dim_arg;
  // What the per-tile loops read: the cache's own rows where row_lanes converts them
  // (float32; bfloat16 and int8 on AVX-512) and the head size is compiled, else float32
  // copies of them (row_as_float; float rows are their own copies). A bfloat16 or int8
  // row read in place is converted by each run of queries (key_queries, value_queries),
  // a copy once for all; in place measured 1.11-1.47x the copies at eight query heads
  // a KV head (Qwen3-30B-A3B's shape) on a 2-vCPU Zen 5 EPYC (docs/BENCHMARKS.md).
  constexpr bool kInPlace = kRowLanes<KV> && kUnrolled<HD>;
  using Row = std::conditional_t<kInPlace, KV, float>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_width = head_dim + KVRows<KV>::kExtra;  // elements of one head's row
  const int64_t row = num_kv_heads * head_width;  // one token of one block, all KV heads
  auto first_row = [&](int64_t seq) { return row_starts ? row_starts[seq] : seq; };
  auto row_count = [&](int64_t seq) {
    return (row_starts ? row_starts[seq + 1] : seq + 1) - first_row(seq);
  };
  auto row_start = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, lens[r] - window) : int64_t{0};
  };
  // Per sequence: its first span, its span count, and, when it has several spans, where
  // its partial results start (m, l, acc per span and query).
  const int64_t partial_width = head_dim + 2;
  std::vector<int64_t> span0(num_seqs), spans(num_seqs), partial0(num_seqs, 0);
  int64_t partial_total = 0, all_spans = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    int64_t first = INT64_MAX, last = 0;
    for (int64_t r = first_row(seq); r < first_row(seq) + row_count(seq); ++r) {
      first = std::min(first, row_start(r));
      last = std::max(last, lens[r]);
    }
    spans[seq] = last > first ? (last - 1) / kSpanTokens - first / kSpanTokens + 1 : 0;
    span0[seq] = last > first ? first / kSpanTokens : 0;
    all_spans += spans[seq];
    if (spans[seq] > 1) {
      partial0[seq] = partial_total;
      partial_total += num_kv_heads * spans[seq] * row_count(seq) * group * partial_width;
    }
  }
  // Runs of KV heads per span: one (whole token rows) unless that leaves fewer than
  // four items a thread.
  int64_t runs = 1;
  while (runs < num_kv_heads && all_spans * runs < 4 * at::get_num_threads()) runs *= 2;
  runs = std::min(runs, num_kv_heads);
  std::vector<int64_t> item0(num_seqs + 1, 0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) item0[seq + 1] = item0[seq] + spans[seq] * runs;
  // Every slot is written by its item before the merge reads it: no zero-filling.
  std::unique_ptr<float[]> partials(new float[std::max<int64_t>(partial_total, 1)]);
  // Items are shared from a counter (parallel.cpp), not split in equal counts: a
  // context's last span is partial, so items differ in cost, and threads in speed.
  work::share(item0[num_seqs], 1, [&](work::SharedRuns& shared) {
    std::vector<float> query, acc, scores, top, total;
    std::vector<float> widened(kInPlace ? 0 : kTileTokens * head_dim);  // row_as_float's copies
    std::vector<int64_t> lo, hi;
    std::vector<const KV*> key_rows, value_rows;
    // (each run's items in turn, then the next run)
    for (int64_t item = 0, end = 0; item < end || shared.next(item, end); ++item) {
      const int64_t seq = std::upper_bound(item0.begin(), item0.end(), item) - item0.begin() - 1;
      const int64_t local = item - item0[seq];
      const int64_t span = local / runs, run = local % runs;
      const int64_t h0 = run * num_kv_heads / runs, h1 = (run + 1) * num_kv_heads / runs;
      const int64_t r0 = first_row(seq), rows = row_count(seq);
      // Query i of this item: KV head h0 + i / per_head, row (i % per_head) / group.
      const int64_t per_head = rows * group, queries = (h1 - h0) * per_head;
      const int64_t span_lo = (span0[seq] + span) * kSpanTokens;
      const int64_t span_hi = span_lo + kSpanTokens;
      lo.resize(rows);
      hi.resize(rows);
      int64_t first = INT64_MAX, last = 0;  // the positions some row reads in this span
      for (int64_t r = 0; r < rows; ++r) {
        lo[r] = std::max(span_lo, row_start(r0 + r));
        hi[r] = std::min(span_hi, lens[r0 + r]);
        if (hi[r] > lo[r]) { first = std::min(first, lo[r]); last = std::max(last, hi[r]); }
      }
      const int64_t n = std::max<int64_t>(0, last - first);
      const int64_t* table = tables + seq * table_width;
      query.resize(queries * head_dim);
      acc.assign(queries * head_dim, 0.f);
      scores.assign(queries * n, 0.f);
      top.assign(queries, 0.f);
      total.assign(queries, 0.f);
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t h = h0 + i / per_head, r = (i % per_head) / group, g = i % group;
        const T* qh = q + (r0 + r) * q_stride + (h * group + g) * head_dim;
        float* dst = query.data() + i * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_f(qh[d]) * scale;
      }
      if (n > 0) {
        // The span's token rows (this item's heads of each), found once through the
        // block table; K read token by token for every query, then V.
        const int64_t run_bytes = (h1 - h0) * head_width * sizeof(KV);
        key_rows.resize(n);
        value_rows.resize(n);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t pos = first + t;
          const int64_t offset = (table[pos / block_size] * block_size + pos % block_size) * row +
                                 h0 * head_width;
          key_rows[t] = k_ptr + offset;
          value_rows[t] = v_ptr + offset;
        }
        // Tiles of kTileTokens token rows: each head's rows of the tile (Row) go to
        // ``use`` together, so a query's registers serve the whole tile.
        auto pass = [&](const std::vector<const KV*>& token_rows, auto&& use) {
          for (int64_t t = 0; t < std::min(n, kAheadTokens); ++t) prefetch_row(token_rows[t], run_bytes);
          const Row* head_rows[kTileTokens];
          float row_scales[kTileTokens];
          for (int64_t t0 = 0; t0 < n; t0 += kTileTokens) {
            const int64_t count = std::min(kTileTokens, n - t0), heads = h1 - h0;
            // The rows kAheadTokens on, asked for a few before each head: all at the
            // tile's start, the requests queued behind the line-fill buffers and the
            // kernel ran at 0.8-0.9x the row-by-row speed.
            int64_t asked = 0;
            for (int64_t h = 0; h < heads; ++h) {
              for (; asked < (h + 1) * count / heads; ++asked) {
                const int64_t ahead = t0 + asked + kAheadTokens;
                if (ahead < n) prefetch_row(token_rows[ahead], run_bytes);
              }
              for (int64_t j = 0; j < count; ++j) {
                const KV* head_row = token_rows[t0 + j] + h * head_width;
                if constexpr (kInPlace) head_rows[j] = head_row;
                else head_rows[j] = row_as_float<HD>(head_row, widened.data() + j * head_dim, head_dim);
                row_scales[j] = KVRows<KV>::scale(head_row, head_dim);
              }
              use(t0, count, h, head_rows, row_scales);
            }
          }
        };
        pass(key_rows, [&](int64_t t0, int64_t count, int64_t h, const Row* const* k,
                           const float* k_scales) {
          if constexpr (key_queries<HD, Row>() == 1) {  // one query at a time: see values
            for (int64_t i = h * per_head; i < (h + 1) * per_head; ++i)
              key_scores<HD, 1>(query.data() + i * head_dim, k, k_scales, count, head_dim,
                                scores.data() + i * n + t0, n);
          } else {
            for (int64_t i0 = h * per_head; i0 < (h + 1) * per_head; i0 += group)  // a row's
              in_runs<key_queries<HD, Row>()>(i0, i0 + group, [&](auto run, int64_t i) {
                key_scores<HD, decltype(run)::value>(query.data() + i * head_dim, k,
                                                     k_scales, count, head_dim,
                                                     scores.data() + i * n + t0, n);
              });
          }
        });
        // exp(s - m) over each query's own keys (plain loops on locals: they vectorise,
        // where std::max_element and a vector's element would not); other keys weigh 0.
        for (int64_t i = 0; i < queries; ++i) {
          const int64_t r = (i % per_head) / group, a = lo[r] - first, b = hi[r] - first;
          if (b <= a) continue;
          float* s = scores.data() + i * n;
          float m = s[a];
          for (int64_t t = a + 1; t < b; ++t) m = std::max(m, s[t]);
          float sum = 0.f;
          for (int64_t t = a; t < b; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
          for (int64_t t = 0; t < a; ++t) s[t] = 0.f;
          for (int64_t t = b; t < n; ++t) s[t] = 0.f;
          top[i] = m;
          total[i] = sum;
        }
        // Each query adds its own keys of the tile (a run: verification rows have their
        // own lengths), one after another in key order: the same sums as key by key. A
        // row's queries go in the same runs (key_queries, value_queries) in a decode and
        // in a verification run, so a row's result is the same machine code's either way.
        pass(value_rows, [&](int64_t t0, int64_t count, int64_t h, const Row* const* v,
                             const float* v_scales) {
          float weights[value_queries<HD, Row>() * kTileTokens];
          if constexpr (value_queries<HD, Row>() == 1) {
            // One query at a time (float32 rows, copies): the loop over the head's
            // queries, which measured faster there than the runs' loop over its rows
            // (0.94-0.96x on SmolLM2's float32 cache).
            for (int64_t i = h * per_head; i < (h + 1) * per_head; ++i) {
              int64_t j0 = 0, j1 = count;
              if (rows > 1) {  // (no division per query and tile for a decode: it cost 15%)
                const int64_t r = (i % per_head) / group;
                j0 = std::max<int64_t>(0, lo[r] - first - t0);
                j1 = std::min<int64_t>(count, hi[r] - first - t0);
                if (j1 <= j0) continue;
              }
              for (int64_t j = j0; j < j1; ++j) weights[j] = scores[i * n + t0 + j] * v_scales[j];
              add_values<HD, 1>(acc.data() + i * head_dim, v + j0, weights + j0, j1 - j0, head_dim);
            }
            return;
          }
          for (int64_t r = 0; r < rows; ++r) {
            int64_t j0 = 0, j1 = count;
            if (rows > 1) {  // (a decode row reads the whole tile)
              j0 = std::max<int64_t>(0, lo[r] - first - t0);
              j1 = std::min<int64_t>(count, hi[r] - first - t0);
              if (j1 <= j0) continue;
            }
            const int64_t i0 = h * per_head + r * group;
            in_runs<value_queries<HD, Row>()>(i0, i0 + group, [&](auto run, int64_t i) {
              constexpr int64_t Q = decltype(run)::value;
              for (int64_t a = 0; a < Q; ++a)
                for (int64_t j = j0; j < j1; ++j)
                  weights[a * kTileTokens + j] = scores[(i + a) * n + t0 + j] * v_scales[j];
              add_values<HD, Q>(acc.data() + i * head_dim, v + j0, weights + j0, j1 - j0, head_dim);
            });
          }
        });
      }
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t h = h0 + i / per_head, qi = i % per_head;  // qi: query within its head
        if (spans[seq] == 1) {  // the whole context: normalise in place
          const int64_t r = qi / group, g = qi % group;
          T* o = out + (r0 + r) * out_stride + (h * group + g) * head_dim;
          // (a sink far above the scores: exp overflows, and the row is 0, its limit)
          const float sink = sinks ? std::exp(sinks[h * group + g] - top[i]) : 0.f;
          const float inv = total[i] + sink > 0.f ? 1.f / (total[i] + sink) : 0.f;
          const float* a = acc.data() + i * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(a[d] * inv);
          continue;
        }
        float* dst = partials.get() + partial0[seq] +
                     ((h * spans[seq] + span) * per_head + qi) * partial_width;
        dst[0] = top[i];
        dst[1] = total[i];
        std::copy(acc.data() + i * head_dim, acc.data() + (i + 1) * head_dim, dst + 2);
      }
    }
  });
  // Merge the spans of sequences that have several.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      if (spans[seq] <= 1) continue;
      const int64_t r0 = first_row(seq), queries = row_count(seq) * group;
      const float* base = partials.get() + partial0[seq] +
                          kv_head * spans[seq] * queries * partial_width;
      for (int64_t i = 0; i < queries; ++i) {
        float top = 0.f;
        bool any = false;
        for (int64_t j = 0; j < spans[seq]; ++j) {
          const float* p = base + (j * queries + i) * partial_width;
          if (p[1] > 0.f) { top = any ? std::max(top, p[0]) : p[0]; any = true; }
        }
        float denominator = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t j = 0; j < spans[seq]; ++j) {
          const float* p = base + (j * queries + i) * partial_width;
          if (!(p[1] > 0.f)) continue;
          const float weight = std::exp(p[0] - top);
          denominator += weight * p[1];
          for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * p[2 + d];
        }
        const int64_t r = i / group, g = i % group;
        T* o = out + (r0 + r) * out_stride + (kv_head * group + g) * head_dim;
        if (sinks) denominator += std::exp(sinks[kv_head * group + g] - top);
        const float inv = denominator > 0.f ? 1.f / denominator : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(merged[d] * inv);
      }
    }
  });
}

// A cache of another float type than the model's (bfloat16, fp8 e4m3): rows rounded on
// write as torch's .to() rounds (fp8 saturating at +-448, where .to() would give NaN).
template <typename KV> inline KV to_cache(float x) {
  if constexpr (std::is_same_v<KV, c10::Float8_e4m3fn>) x = std::clamp(x, -448.f, 448.f);
  return static_cast<KV>(x);
}

template <typename T, typename KV>
void write_kv_cast_impl(const T* k, const T* v, int64_t tokens, int64_t row, int64_t k_stride,
                        int64_t v_stride, KV* k_cache, KV* v_cache, const int64_t* slots) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < row; ++i) {
      k_cache[slots[t] * row + i] = to_cache<KV>(to_f(k[t * k_stride + i]));
      v_cache[slots[t] * row + i] = to_cache<KV>(to_f(v[t * v_stride + i]));
    }
  }
}

// fn(KV{}) for the cache's element type: T itself, bfloat16, fp8 e4m3, or int8 (a
// uint8 tensor of int8 rows, each followed by its scale: KVRows<int8_t>).
template <typename T, typename Fn>
void dispatch_cache(torch::ScalarType type, Fn&& fn) {
  if (type == c10::CppTypeToScalarType<T>::value) {
    fn(T{});
  } else if (type == torch::kBFloat16) {
    fn(c10::BFloat16{});
  } else if (type == torch::kFloat8_e4m3fn) {
    fn(c10::Float8_e4m3fn{});
  } else if (type == torch::kUInt8) {
    fn(int8_t{});
  } else {
    TORCH_CHECK(false, "KV cache type ", type, " is not supported");
  }
}

// Rows of k / v [tokens, Hkv, D] -> int8 cache rows: per (token, head), scale =
// max|x| / 127 and q = round(x / scale), then the scale's 4 bytes.
template <typename T>
void write_kv_int8_impl(const T* x, int64_t tokens, int64_t heads, int64_t head_dim,
                        int64_t stride, int8_t* cache, const int64_t* slots) {
  const int64_t width = head_dim + 4;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = x + t * stride + h * head_dim;
      int8_t* dst = cache + (slots[t] * heads + h) * width;
      float amax = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(to_f(src[d])));
      const float s = amax / 127.f;
      const float inverse = s > 0.f ? 1.f / s : 0.f;
      for (int64_t d = 0; d < head_dim; ++d)
        dst[d] = static_cast<int8_t>(std::nearbyint(to_f(src[d]) * inverse));
      std::memcpy(dst + head_dim, &s, sizeof(s));
    }
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  // A 2-D or 3-D view whose innermost dimensions are packed: rows may be strided.
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
  if (t.dim() == 3) TORCH_CHECK(t.stride(1) == t.size(2), name, ": heads must be packed");
}

#define TANDEM_DISPATCH(dtype, NAME, ...)                                             \
  if ((dtype) == torch::kFloat) { using scalar_t = float; __VA_ARGS__(); }            \
  else if ((dtype) == torch::kBFloat16) { using scalar_t = at::BFloat16; __VA_ARGS__(); } \
  else TORCH_CHECK(false, NAME ": float32 or bfloat16 only");

}  // namespace

// out [R, N] = rms_norm(x [R, N]) * weight; with ``residual`` given, residual += x
// first (in place) and the norm reads the sum. Rows may be strided.
void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> residual,
              torch::Tensor weight, double eps) {
  check_rows(out, "out"); check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type());
  const int64_t rows = x.size(0), dim = x.size(-1);
  TANDEM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    scalar_t* res = nullptr;
    int64_t res_stride = 0;
    if (residual.has_value()) {
      check_rows(*residual, "residual");
      res = residual->data_ptr<scalar_t>();
      res_stride = residual->stride(0);
    }
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), res,
                            weight.data_ptr<scalar_t>(), rows, dim, out.stride(0), x.stride(0),
                            res_stride, eps);
  });
}

// out [T, H, D] = each head of x [T, H, D] (strided tokens and heads) normed, times weight.
void rms_norm_heads(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && out.dim() == 3 && x.stride(2) == 1 && out.stride(2) == 1);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type());
  TANDEM_DISPATCH(x.scalar_type(), "rms_norm_heads", [&] {
    rms_norm_heads_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                  weight.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2),
                                  out.stride(0), out.stride(1), x.stride(0), x.stride(1), eps);
  });
}

// In place on q [T, H, D] and k [T, Hkv, D] (views with strided tokens): neox rotary of
// the first rot_dim features; cos_sin [positions, rot_dim] float32 (cos half, sin half).
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos_sin) {
  check_rows(q, "q"); check_rows(k, "k");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == torch::kLong);
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.scalar_type() == torch::kFloat);
  const int64_t rot_dim = cos_sin.size(1);
  TANDEM_DISPATCH(q.scalar_type(), "rotary", [&] {
    for (auto* t : {&q, &k}) {
      rotary_impl<scalar_t>(t->data_ptr<scalar_t>(), t->size(0), t->size(1), t->stride(0),
                            t->stride(1), positions.data_ptr<int64_t>(),
                            cos_sin.data_ptr<float>(), rot_dim);
    }
  });
}

// out [R, N] = silu(x[:, :N]) * x[:, N:]
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  check_rows(out, "out"); check_rows(x, "x");
  TANDEM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    act_and_mul_impl<scalar_t, Act::kSilu>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                           x.size(0), out.size(1), out.stride(0), x.stride(0));
  });
}

// out [R, N] = gelu_tanh(x[:, :N]) * x[:, N:]
void gelu_tanh_and_mul(torch::Tensor out, torch::Tensor x) {
  check_rows(out, "out"); check_rows(x, "x");
  TANDEM_DISPATCH(x.scalar_type(), "gelu_tanh_and_mul", [&] {
    act_and_mul_impl<scalar_t, Act::kGeluTanh>(out.data_ptr<scalar_t>(),
                                               x.data_ptr<scalar_t>(), x.size(0), out.size(1),
                                               out.stride(0), x.stride(0));
  });
}

// out [R, N] = gpt-oss's clamped SwiGLU of x [R, 2N] (gate, up): clamped_swiglu_impl
void clamped_swiglu_and_mul(torch::Tensor out, torch::Tensor x, double alpha, double limit) {
  check_rows(out, "out"); check_rows(x, "x");
  TANDEM_DISPATCH(x.scalar_type(), "clamped_swiglu_and_mul", [&] {
    clamped_swiglu_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.size(0),
                                  out.size(1), out.stride(0), x.stride(0),
                                  static_cast<float>(alpha), static_cast<float>(limit));
  });
}

// Write k/v [T, Hkv, D] (strided tokens) into the caches [blocks, block_size, Hkv, D]
// at flat slots (block * block_size + offset).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  check_rows(k, "k"); check_rows(v, "v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous());
  TANDEM_DISPATCH(k.scalar_type(), "write_kv", [&] {
    dispatch_cache<scalar_t>(k_cache.scalar_type(), [&](auto tag) {
      using KV = decltype(tag);
      if constexpr (std::is_same_v<KV, int8_t>) {  // quantized rows with their scales
        for (auto [x, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
          write_kv_int8_impl<scalar_t>(x->template data_ptr<scalar_t>(), x->size(0), x->size(1),
                                       x->size(2), x->stride(0),
                                       static_cast<int8_t*>(cache->data_ptr()),
                                       slots.data_ptr<int64_t>());
        }
      } else if constexpr (std::is_same_v<KV, scalar_t>) {  // copied
        write_kv_impl<scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k.size(0),
                                k.size(1) * k.size(2), k.stride(0), v.stride(0),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                slots.data_ptr<int64_t>());
      } else {  // rounded to the cache's type
        write_kv_cast_impl<scalar_t, KV>(
            k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k.size(0), k.size(1) * k.size(2),
            k.stride(0), v.stride(0), static_cast<KV*>(k_cache.data_ptr()),
            static_cast<KV*>(v_cache.data_ptr()), slots.data_ptr<int64_t>());
      }
    });
  });
}

// out [S, H, D] (strided rows allowed) = attention of q [S, H, D] (one token per
// sequence) over the paged K/V of each sequence's first context_lens[s] tokens.
void paged_attention_rows(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor block_tables,
                          torch::Tensor context_lens, torch::Tensor row_starts, double scale,
                          int64_t window, torch::Tensor sinks) {
  // q [R, H, D]: a few query rows per sequence (row_starts [S + 1]; empty: one row per
  // sequence), each with its own context length (context_lens [R]). sinks: float32 [H],
  // each query head's sink logit, or empty.
  check_rows(out, "out"); check_rows(q, "q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  const bool runs = row_starts.numel() > 0;
  TORCH_CHECK(!runs || (row_starts.is_contiguous() && row_starts.numel() == block_tables.size(0) + 1));
  TORCH_CHECK(context_lens.numel() == q.size(0));
  const bool sunk = sinks.numel() > 0;
  TORCH_CHECK(!sunk || (sinks.scalar_type() == torch::kFloat && sinks.is_contiguous() &&
                        sinks.numel() == q.size(1)), "sinks: float32, one per query head");
  TANDEM_DISPATCH(q.scalar_type(), "paged_attention_rows", [&] {
    dispatch_cache<scalar_t>(k_cache.scalar_type(), [&](auto tag) {
      using KV = decltype(tag);
      auto run = [&](auto head_dim_tag) {
        constexpr int64_t HD = decltype(head_dim_tag)::value;
        decode_attention_impl<scalar_t, KV, HD>(
            out.data_ptr<scalar_t>(), out.stride(0), q.data_ptr<scalar_t>(), q.stride(0),
            block_tables.size(0), q.size(1), q.size(2),
            static_cast<const KV*>(k_cache.data_ptr()), static_cast<const KV*>(v_cache.data_ptr()),
            k_cache.size(1), k_cache.size(2), block_tables.data_ptr<int64_t>(),
            block_tables.size(1), context_lens.data_ptr<int64_t>(), scale, window,
            runs ? row_starts.data_ptr<int64_t>() : nullptr,
            sunk ? sinks.data_ptr<float>() : nullptr);
      };
      if (q.size(2) == 64) run(std::integral_constant<int64_t, 64>{});
      else if (q.size(2) == 128) run(std::integral_constant<int64_t, 128>{});
      else run(std::integral_constant<int64_t, 0>{});
    });
  });
}

void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor context_lens, double scale, int64_t window,
                      torch::Tensor sinks) {
  paged_attention_rows(out, q, k_cache, v_cache, block_tables, context_lens,
                       torch::empty({0}, block_tables.options()), scale, window, sinks);
}

// -- small-batch linear ----------------------------------------------------------------
// out [M, N] = x [M, K] @ W[N, K]^T (+ bias) for the few rows of a decode step, where the
// time is one pass over W and BLAS libraries reach a fraction of the memory bandwidth.
// Tiles of 4 weight rows are loaded once (they stay in L1) and dotted with every row of
// x; threads take disjoint runs of weight rows, so W streams through memory once.

namespace {

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

template <typename T> inline float load_f(const T* p, int64_t i) { return to_f(p[i]); }
template <> inline float load_f<at::BFloat16>(const at::BFloat16* p, int64_t i) {
  return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
}

// 16 consecutive weights as float32. float16 weights (a GGUF file's F16 matrices on a
// float32 model) convert with F16C / AVX-512 instructions the compiler would not
// pick for c10::Half's scalar conversion.
template <typename TW> inline void load16(const TW* p, float* dst) {
  for (int l = 0; l < 16; ++l) dst[l] = load_f(p, l);
}
#if defined(__AVX512F__)
template <> inline void load16<at::Half>(const at::Half* p, float* dst) {
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#elif defined(__F16C__)
template <> inline void load16<at::Half>(const at::Half* p, float* dst) {
  const __m128i* v = reinterpret_cast<const __m128i*>(p);
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(v)));
  _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm_loadu_si128(v + 1)));
}
#endif

constexpr int64_t kTile = 4;   // weight rows per tile
constexpr int64_t kLanes = 16; // partial sums per row (vector width x unroll)

// T: activations, output and bias; TW: the weights (T, or narrower: float16 / bfloat16
// weights of a float32 model).
template <typename T, typename TW = T>
void small_linear_impl(T* out, const T* x, const TW* w, const T* bias, int64_t M, int64_t N,
                       int64_t K, int64_t out_stride, int64_t x_stride) {
  const int64_t K_main = K - K % kLanes;
  // x in float32 once (it is tiny and read N / kTile times).
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = load_f(x + m * x_stride, k);
  const int64_t num_tiles = N / kTile;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTile;
      const TW* w0 = w + n0 * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf.data() + m * K;
        // Four rows at once: each chunk of x is loaded once for four independent
        // accumulator sets (more loads in flight, fewer x loads per FMA).
        float acc[kTile][kLanes] = {};
        for (int64_t k = 0; k < K_main; k += kLanes)
          for (int64_t r = 0; r < kTile; ++r) {
            if constexpr (std::is_same_v<TW, at::Half>) {
              float wv[kLanes];
              load16(w0 + r * K + k, wv);
              for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += wv[l] * xm[k + l];
            } else {
              for (int64_t l = 0; l < kLanes; ++l)
                acc[r][l] += load_f(w0 + r * K, k + l) * xm[k + l];
            }
          }
        for (int64_t r = 0; r < kTile; ++r) {
          float sum = 0.f;
          for (int64_t l = 0; l < kLanes; ++l) sum += acc[r][l];
          for (int64_t k = K_main; k < K; ++k) sum += load_f(w0 + r * K, k) * xm[k];
          if (bias != nullptr) sum += to_f(bias[n0 + r]);
          out[m * out_stride + n0 + r] = static_cast<T>(sum);
        }
      }
    }
  });
  // The last N % kTile rows, one at a time.
  for (int64_t n = num_tiles * kTile; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += load_f(w + n * K, k) * xf[m * K + k];
      if (bias != nullptr) sum += to_f(bias[n]);
      out[m * out_stride + n] = static_cast<T>(sum);
    }
  }
}

}  // namespace

void small_linear(torch::Tensor out, torch::Tensor x, torch::Tensor weight,
                  c10::optional<torch::Tensor> bias) {
  check_rows(out, "out"); check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous());
  if (weight.scalar_type() != x.scalar_type()) {  // float16 / bfloat16 weights, float32 x
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "narrow weights need float32 activations");
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    auto run = [&](auto* w) {
      small_linear_impl(out.data_ptr<float>(), x.data_ptr<float>(), w, b, x.size(0),
                        weight.size(0), weight.size(1), out.stride(0), x.stride(0));
    };
    if (weight.scalar_type() == torch::kHalf) run(weight.data_ptr<at::Half>());
    else if (weight.scalar_type() == torch::kBFloat16) run(weight.data_ptr<at::BFloat16>());
    else TORCH_CHECK(false, "small_linear: weights float32, bfloat16 or float16");
    return;
  }
  TANDEM_DISPATCH(x.scalar_type(), "small_linear", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    small_linear_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), b, x.size(0), weight.size(0),
                                weight.size(1), out.stride(0), x.stride(0));
  });
}

// -- greedy sampling -------------------------------------------------------------------
// out [R] = argmax of each row of x [R, V] float32: the first index of the maximum, as
// torch (NaNs are skipped, where torch would return one). torch's CPU argmax walks a
// [64, 49152] batch of logits at a fraction of the memory bandwidth. Here threads take
// rows; each row is scanned twice: a plain max reduction (vectorised), then the first
// position holding it (the row is still in L2).

void argmax_rows(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kLong);
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t kLanes = 16;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * stride;
      float lane[kLanes];
      std::fill(lane, lane + kLanes, -INFINITY);
      const int64_t main = vocab - vocab % kLanes;
      for (int64_t i = 0; i < main; i += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], row[i + l]);
      float top = -INFINITY;
      for (int64_t l = 0; l < kLanes; ++l) top = std::max(top, lane[l]);
      for (int64_t i = main; i < vocab; ++i) top = std::max(top, row[i]);
      int64_t index = 0;
      while (index < vocab && row[index] != top) ++index;
      result[r] = index < vocab ? index : 0;
    }
  });
}

// Structured outputs (tandem/grammar.py): in row rows[i] of logits [S, vocab] (float,
// unit stride), every token whose bit is clear in masks[i] becomes -inf. A mask row is
// int32 words, bit j of word w standing for token 32 w + j (llguidance's layout);
// tokens past its last word are cleared too. Rows are independent: one per task.
void mask_rows(torch::Tensor logits, torch::Tensor masks, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
              logits.scalar_type() == torch::kFloat);
  TORCH_CHECK(masks.dim() == 2 && masks.is_contiguous() && masks.scalar_type() == torch::kInt);
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == torch::kLong);
  const int64_t count = rows.size(0), vocab = logits.size(1), words = masks.size(1);
  TORCH_CHECK(count <= masks.size(0));
  const int64_t* index = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r)
    TORCH_CHECK(index[r] >= 0 && index[r] < logits.size(0), "mask_rows: row out of range");
  float* data = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + index[r] * stride;
      const uint32_t* word = bits + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t allowed = w < words ? word[w] : 0u;
        if (allowed == 0xFFFFFFFFu) continue;
        const int64_t last = std::min<int64_t>(32, vocab - w * 32);
        for (int64_t b = 0; b < last; ++b)
          if (!((allowed >> b) & 1u)) row[w * 32 + b] = -INFINITY;
      }
    }
  });
}
