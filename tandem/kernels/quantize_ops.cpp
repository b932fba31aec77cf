// Float weights -> Q3_K, Q2_K, IQ4_NL and IQ4_XS blocks, by the scale searches of
// llama.cpp's reference quantizers (ggml-quants.c, no importance matrix), across threads.
//
// The same algorithms as tandem/quant/scale_search.py (its docstring says what each
// searches), written as the reference's loops: sums in the order it makes them, in
// float32 without fast-math (the unit's -ffast-math is lifted below), so that the bytes
// are llama-quantize's for nearly every block. The torch version is the fallback where no
// compiler is, and ~100x slower; the tests hold both to llama.cpp's bytes.
//
// quantize_ggml(w float32 [N, K] contiguous, code) -> uint8 [N, K / block * bytes].

#include <torch/python.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace qz {

enum Code : int64_t { Q2_K = 10, Q3_K = 11, IQ4_NL = 20, IQ4_XS = 23 };
constexpr float kEps = 1e-15f;  // a group whose largest |x| is below is all zero
constexpr int8_t kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline int nearest(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }
inline uint16_t f16_bits(float x) { return c10::Half(x).x; }
inline float f16_round(float x) { return static_cast<float>(c10::Half(x)); }

// The signed value of largest magnitude (the first such).
inline float signed_extreme(const float* x, int n, float* amax) {
  float best = 0, value = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > best) { best = std::fabs(x[i]); value = x[i]; }
  *amax = best;
  return value;
}

// Weight j of a super-block of 256 in bits 2 * ((j % 128) / 32) of byte 32 * (j / 128) + j % 32.
inline void pack_pairs(const uint8_t* L, uint8_t* qs) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t* q = L + 128 * h + l;
      qs[32 * h + l] = q[0] | (q[32] << 2) | (q[64] << 4) | (q[96] << 6);
    }
}

// -- Q3_K ----------------------------------------------------------------------------

// A group of 16: levels in -4..3 (returned + 4), the x²-weighted least-squares scale
// after coordinate descent over the levels.
float q3_group(const float* x, int8_t* L) {
  float amax;
  const float max = signed_extreme(x, 16, &amax);
  if (amax < kEps) { std::memset(L, 0, 16); return 0.f; }
  const float iscale = -4.f / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < 16; ++i) {
    const int l = clampi(nearest(iscale * x[i]), -4, 3);
    L[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < 16; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * L[i];
      if (slx <= 0) continue;
      float sl2 = suml2 - w * L[i] * L[i];
      const int candidate = clampi(nearest(x[i] * sl2 / slx), -4, 3);
      if (candidate == L[i]) continue;
      slx += w * x[i] * candidate;
      sl2 += w * candidate * candidate;
      if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = static_cast<int8_t>(candidate);
        sumlx = slx;
        suml2 = sl2;
        ++changed;
      }
    }
    if (!changed) break;
  }
  for (int i = 0; i < 16; ++i) L[i] += 4;
  return suml2 > 0 ? sumlx / suml2 : 0.f;
}

// hmask[32] qs[64] scales[12] d: w = d * (sc - 32) * (q - 4).
void q3_k(const float* x, uint8_t* out) {
  int8_t L[256];
  float scales[16];
  float amax = 0, max_scale = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = q3_group(x + 16 * j, L + 16 * j);
    if (std::fabs(scales[j]) > amax) { amax = std::fabs(scales[j]); max_scale = scales[j]; }
  }
  uint8_t* hmask = out;
  uint8_t* qs = out + 32;
  uint8_t* packed = out + 96;
  std::memset(packed, 0, 12);
  float d = 0;
  int sub[16] = {0};
  if (max_scale != 0) {
    const float iscale = -32.f / max_scale;
    for (int j = 0; j < 16; ++j) {
      const int l = clampi(nearest(iscale * scales[j]), -32, 31) + 32;
      sub[j] = l;
      if (j < 8) packed[j] = l & 0xF;
      else packed[j - 8] |= (l & 0xF) << 4;
      packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    d = f16_round(1 / iscale);
  }
  const uint16_t d_bits = f16_bits(max_scale != 0 ? d : 0.f);
  std::memcpy(out + 108, &d_bits, 2);
  for (int j = 0; j < 16; ++j) {
    const float dl = d * (sub[j] - 32);
    if (dl == 0) continue;
    for (int i = 0; i < 16; ++i) L[16 * j + i] = static_cast<int8_t>(clampi(nearest(x[16 * j + i] / dl), -4, 3) + 4);
  }
  std::memset(hmask, 0, 32);
  uint8_t low[256];
  for (int j = 0; j < 256; ++j) {
    const bool high = L[j] > 3;
    if (high) hmask[j % 32] |= 1 << (j / 32);
    low[j] = static_cast<uint8_t>(L[j] - (high ? 4 : 0));
  }
  pack_pairs(low, qs);
}

// -- Q2_K ----------------------------------------------------------------------------

// A group of 16, levels 0..3 and a minimum (w = scale * l - minimum), fitted with
// weights |x|: 16 candidate ranges, each by least squares, kept when its absolute
// error is lower. Returns the scale; the minimum through ``the_min``.
float q2_group(const float* x, uint8_t* L, float* the_min) {
  float weight[16];
  float min = x[0], max = x[0];
  float sum_w = std::fabs(x[0]), sum_x = sum_w * x[0];
  weight[0] = sum_w;
  for (int i = 1; i < 16; ++i) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    weight[i] = std::fabs(x[i]);
    sum_w += weight[i];
    sum_x += weight[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) { std::memset(L, 0, 16); *the_min = -min; return 0.f; }
  float iscale = 3.f / (max - min);
  float scale = 1 / iscale;
  float best = 0;
  for (int i = 0; i < 16; ++i) {
    L[i] = static_cast<uint8_t>(clampi(nearest(iscale * (x[i] - min)), 0, 3));
    best += weight[i] * std::fabs(scale * L[i] + min - x[i]);
  }
  uint8_t trial[16];
  for (int step = 0; step <= 15; ++step) {
    iscale = (-0.5f + 0.1f * step + 3) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < 16; ++i) {
      const int l = clampi(nearest(iscale * (x[i] - min)), 0, 3);
      trial[i] = static_cast<uint8_t>(l);
      sum_l += weight[i] * l;
      sum_l2 += weight[i] * l * l;
      sum_xl += weight[i] * l * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0) { this_min = 0; this_scale = sum_xl / sum_l2; }
    float error = 0;
    for (int i = 0; i < 16; ++i) error += weight[i] * std::fabs(this_scale * trial[i] + this_min - x[i]);
    if (error < best) {
      std::memcpy(L, trial, 16);
      best = error;
      scale = this_scale;
      min = this_min;
    }
  }
  *the_min = -min;
  return scale;
}

// scales[16] (low nibble scale, high minimum) qs[64] d dmin: w = d*sc*q - dmin*m.
void q2_k(const float* x, uint8_t* out) {
  uint8_t L[256];
  float scales[16], mins[16];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = q2_group(x + 16 * j, L + 16 * j, &mins[j]);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  uint8_t* packed = out;
  float d = 0, dmin = 0;
  std::memset(packed, 0, 16);
  if (max_scale > 0) {
    const float iscale = 15.f / max_scale;
    for (int j = 0; j < 16; ++j) packed[j] = static_cast<uint8_t>(clampi(nearest(iscale * scales[j]), 0, 15));
    d = max_scale / 15.f;
  }
  if (max_min > 0) {
    const float iscale = 15.f / max_min;
    for (int j = 0; j < 16; ++j) packed[j] |= static_cast<uint8_t>(clampi(nearest(iscale * mins[j]), 0, 15) << 4);
    dmin = max_min / 15.f;
  }
  const uint16_t d_bits = f16_bits(d), dmin_bits = f16_bits(dmin);
  std::memcpy(out + 80, &d_bits, 2);
  std::memcpy(out + 82, &dmin_bits, 2);
  d = f16_round(d);
  dmin = f16_round(dmin);
  for (int j = 0; j < 16; ++j) {
    const float dl = d * (packed[j] & 0xF);
    if (dl == 0) continue;
    const float dm = dmin * (packed[j] >> 4);
    for (int i = 0; i < 16; ++i) L[16 * j + i] = static_cast<uint8_t>(clampi(nearest((x[16 * j + i] + dm) / dl), 0, 3));
  }
  pack_pairs(L, out + 16);
}

// -- IQ4_NL and IQ4_XS ---------------------------------------------------------------

// The nearest level's index (a tie to the upper).
inline int nearest_level(float x) {
  if (x <= kLevels[0]) return 0;
  if (x >= kLevels[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < kLevels[mid]) hi = mid; else lo = mid;
  }
  return x - kLevels[hi - 1] < kLevels[hi] - x ? hi - 1 : hi;
}

// A block of 32's scale: the x²-weighted fit, searched over 15 inverse scales.
float iq4_block(const float* x) {
  float amax;
  const float max = signed_extreme(x, 32, &amax);
  if (amax < kEps) return 0.f;
  auto fit = [&](float inverse, float* sumqx, float* sumq2) {
    float qx = 0, q2 = 0;
    for (int j = 0; j < 32; ++j) {
      const float q = kLevels[nearest_level(inverse * x[j])];
      const float w = x[j] * x[j];
      qx += w * q * x[j];
      q2 += w * q * q;
    }
    *sumqx = qx;
    *sumq2 = q2;
  };
  float sumqx, sumq2;
  const float d0 = -max / kLevels[0];
  fit(1 / d0, &sumqx, &sumq2);
  float d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
  float best = d * sumqx;
  for (int trial = -7; trial <= 7; ++trial) {
    fit((trial + kLevels[0]) / max, &sumqx, &sumq2);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) { d = sumqx / sumq2; best = d * sumqx; }
  }
  return d;
}

inline void iq4_nibbles(const float* x, float inverse, uint8_t* qs) {
  for (int j = 0; j < 16; ++j)
    qs[j] = static_cast<uint8_t>(nearest_level(inverse * x[j]) | (nearest_level(inverse * x[16 + j]) << 4));
}

// d qs[16]: w = d * level.
void iq4_nl(const float* x, uint8_t* out) {
  const float d = iq4_block(x);
  const uint16_t bits = f16_bits(d);
  std::memcpy(out, &bits, 2);
  iq4_nibbles(x, d != 0 ? 1 / d : 0.f, out + 2);
}

// d scales_h (u16) scales_l[4] qs[128]: w = d * (ls - 32) * level.
void iq4_xs(const float* x, uint8_t* out) {
  float scales[8];
  float amax = 0, max_scale = 0;
  for (int b = 0; b < 8; ++b) {
    scales[b] = iq4_block(x + 32 * b);
    if (std::fabs(scales[b]) > amax) { amax = std::fabs(scales[b]); max_scale = scales[b]; }
  }
  const float d = -max_scale / 32;
  const uint16_t bits = f16_bits(d);
  std::memcpy(out, &bits, 2);
  const float id = d != 0 ? 1 / d : 0.f;
  uint16_t scales_h = 0;
  uint8_t* scales_l = out + 4;
  std::memset(scales_l, 0, 4);
  for (int b = 0; b < 8; ++b) {
    const int l = clampi(nearest(id * scales[b]), -32, 31);
    const float dl = d * l;
    iq4_nibbles(x + 32 * b, dl != 0 ? 1 / dl : 0.f, out + 8 + 16 * b);
    const int ls = l + 32;
    scales_l[b / 2] |= (ls & 0xF) << (4 * (b % 2));
    scales_h |= static_cast<uint16_t>((ls >> 4) << (2 * b));
  }
  std::memcpy(out + 2, &scales_h, 2);
}

struct Format {
  int weights, bytes;
  void (*block)(const float*, uint8_t*);
};

inline Format format(int64_t code) {
  switch (code) {
    case Q3_K: return {256, 110, q3_k};
    case Q2_K: return {256, 84, q2_k};
    case IQ4_NL: return {32, 18, iq4_nl};
    case IQ4_XS: return {256, 136, iq4_xs};
  }
  TORCH_CHECK(false, "quantize_ggml: no quantizer for type ", code);
}

}  // namespace qz

#pragma GCC pop_options

torch::Tensor quantize_ggml(torch::Tensor w, int64_t code) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous(),
              "w: float32 [rows, columns], contiguous");
  const qz::Format f = qz::format(code);
  const int64_t rows = w.size(0), columns = w.size(1);
  TORCH_CHECK(columns % f.weights == 0, "columns: whole blocks of ", f.weights);
  const int64_t per_row = columns / f.weights, blocks = rows * per_row;
  auto out = torch::empty({rows, per_row * f.bytes}, torch::kUInt8);
  const float* x = w.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) f.block(x + b * f.weights, o + b * f.bytes);
  });
  return out;
}
