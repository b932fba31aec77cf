// The codebook i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M): a
// super-block of 256 weights decoded from the file's bytes, as tandem/quant/blocks.py
// decodes it. The kernels hold these types as the file's blocks (2 or 3 bits a weight
// where int8 values would take 8.5) and decode each tile as it is multiplied
// (quant_ops.cpp's expand_codebook), so this decoder runs every step: it is written to
// be fast, one grid entry of 4 or 8 values at a time.
//
// A decoded super-block is the file's float16 d, a sub-scale 1 + 2s per group of 16,
// and 256 int8 values (grid x sign, or IQ1's 8 grid +- 1): w = d * factor * sub * v,
// the factor (IQ3_XXS's 1/4, the others' 1/8) a power of two kept apart.
//
// The grids are gguf-py's decoding of llama.cpp's tables (blocks.py's ``grid``), given
// once a process by tandem/quant/packed.py (set_codebook_grid) and kept here.

#include <torch/python.h>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <mutex>
#include <vector>

namespace codebook {

enum Code : int64_t {
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ3_S = 21, IQ2_S = 22, IQ1_M = 29
};

// A codebook type's block bytes (one super-block of 256) and its grid's entries and
// values an entry; all 0 for the other types.
struct Shape {
  int64_t bytes, entries, width;
};
constexpr Shape shape(int64_t code) {
  switch (code) {
    case IQ3_XXS: return {98, 256, 4};
    case IQ3_S: return {110, 512, 4};
    case IQ2_XXS: return {66, 256, 8};
    case IQ2_XS: return {74, 512, 8};
    case IQ2_S: return {82, 1024, 8};
    case IQ1_S: return {50, 2048, 8};
    case IQ1_M: return {56, 2048, 8};
    default: return {0, 0, 0};
  }
}

// The grids, by code: set once (set_codebook_grid), read by every decode after.
inline std::vector<int8_t>& grid_storage(int64_t code) {
  static std::vector<int8_t> grids[64];
  return grids[code];
}
inline std::mutex& grid_lock() {
  static std::mutex lock;
  return lock;
}
// Type ``code``'s grid, or null where it is not a codebook type or was never given.
inline const int8_t* grid_of(int64_t code) {
  if (code < 0 || code >= 64 || shape(code).entries == 0) return nullptr;
  std::lock_guard<std::mutex> hold(grid_lock());
  const std::vector<int8_t>& grid = grid_storage(code);
  return grid.empty() ? nullptr : grid.data();
}

struct Decoded {
  uint16_t d;  // float16 bits
  int8_t sub[16];
  alignas(32) int8_t v[256];
};

inline uint16_t u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// Grid entry ``index``'s kWidth values into v, each times its sign: bit k of ``signs``
// set makes value k negative. (The width known at compile time, and the grid a local:
// through a struct, every int8 store may alias it, and the loop ran 8x slower.)
template <int kWidth>
inline void put_entry(const int8_t* grid, int64_t index, uint32_t signs, int8_t* v) {
  const int8_t* e = grid + index * kWidth;
#if defined(__SSSE3__)
  // Byte k of ``sign``: -1 where bit k of signs is set, else 1; psignb multiplies by it.
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(_mm_set1_epi8(static_cast<char>(signs)), bit), bit);
  const __m128i sign = _mm_or_si128(set, _mm_set1_epi8(1));
  int64_t entry = 0;
  std::memcpy(&entry, e, kWidth);
  const int64_t out = _mm_cvtsi128_si64(_mm_sign_epi8(_mm_cvtsi64_si128(entry), sign));
  std::memcpy(v, &out, kWidth);
#else
  int8_t out[kWidth];
  for (int k = 0; k < kWidth; ++k) out[k] = static_cast<int8_t>((signs >> k) & 1 ? -e[k] : e[k]);
  std::memcpy(v, out, kWidth);
#endif
}
// A 7-bit sign index's 8 signs (llama.cpp's ksigns): its bits, and an 8th that makes the
// count of minus signs even.
inline uint32_t parity_signs(uint32_t index) {
  return index | ((static_cast<uint32_t>(__builtin_popcount(index)) & 1) << 7);
}

// Type ``code``'s super-block ``blk`` decoded into ``c`` (blocks.py's decoders, type by
// type), through ``grid``, an entry at a time: the portable path, and the reference the
// vector path below is tested against (the same bytes).
inline void decode_entries(int64_t code, const int8_t* grid, const uint8_t* blk, Decoded& c) {
  auto subs_of_32 = [&](int ib, int s) { c.sub[2 * ib] = c.sub[2 * ib + 1] = static_cast<int8_t>(1 + 2 * s); };
  // scales[8]: an s a group of 16, the low nibble of byte j for group 2j, the high for 2j + 1
  auto subs_of_16 = [&](const uint8_t* scales) {
    for (int g = 0; g < 16; ++g) c.sub[g] = static_cast<int8_t>(1 + 2 * ((scales[g / 2] >> (4 * (g % 2))) & 0x0F));
  };
  switch (code) {
    case IQ3_XXS:  // qs[64] (an index a 4 weights), 8 u32: 4 sign indices and s per 32
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        const uint32_t w = u32(blk + 66 + 4 * ib);
        subs_of_32(ib, static_cast<int>(w >> 28));
        for (int j = 0; j < 4; ++j) {
          const uint32_t signs = parity_signs((w >> (7 * j)) & 127);
          put_entry<4>(grid, blk[2 + 8 * ib + 2 * j], signs, c.v + 32 * ib + 8 * j);
          put_entry<4>(grid, blk[2 + 8 * ib + 2 * j + 1], signs >> 4, c.v + 32 * ib + 8 * j + 4);
        }
      }
      return;
    case IQ2_XXS:  // per 32: four indices (a byte each, 8 weights), a u32 of sign indices and s
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        const uint8_t* q = blk + 2 + 8 * ib;
        const uint32_t w = u32(q + 4);
        subs_of_32(ib, static_cast<int>(w >> 28));
        for (int j = 0; j < 4; ++j) put_entry<8>(grid, q[j], parity_signs((w >> (7 * j)) & 127), c.v + 32 * ib + 8 * j);
      }
      return;
    case IQ2_XS:  // 32 u16: a 9-bit index and a 7-bit sign index; scales[8], a nibble a 16
      c.d = u16(blk);
      for (int i = 0; i < 32; ++i) {
        const uint16_t w = u16(blk + 2 + 2 * i);
        put_entry<8>(grid, w & 511, parity_signs(w >> 9), c.v + 8 * i);
      }
      subs_of_16(blk + 66);
      return;
    case IQ2_S:  // qs[32] low index bits, signs[32], qh[8] (2 top bits an index), scales[8]
      c.d = u16(blk);
      for (int i = 0; i < 32; ++i) {
        const int64_t index = blk[2 + i] | (((blk[66 + i / 4] >> (2 * (i % 4))) & 3) << 8);
        put_entry<8>(grid, index, blk[34 + i], c.v + 8 * i);
      }
      subs_of_16(blk + 74);
      return;
    case IQ3_S:  // qs[64], qh[8] (a ninth index bit), signs[32], scales[4] (a nibble a 32)
      c.d = u16(blk);
      for (int i = 0; i < 64; ++i) {
        const int64_t index = blk[2 + i] | (((blk[66 + i / 8] >> (i % 8)) & 1) << 8);
        put_entry<4>(grid, index, blk[74 + i / 2] >> (4 * (i % 2)), c.v + 4 * i);
      }
      for (int ib = 0; ib < 8; ++ib) subs_of_32(ib, (blk[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F);
      return;
    case IQ1_S:  // qs[32] low index bits, a u16 per 32: 3 top bits an index, s, delta's sign
    case IQ1_M: {  // qs[32], qh[16] (3 top bits and delta's sign a nibble), 4 u16: s and d
      int8_t delta[32];
      int64_t index[32];
      if (code == IQ1_S) {
        c.d = u16(blk);
        for (int ib = 0; ib < 8; ++ib) {
          const uint16_t w = u16(blk + 34 + 2 * ib);
          subs_of_32(ib, (w >> 12) & 7);
          for (int m = 0; m < 4; ++m) {
            index[4 * ib + m] = blk[2 + 4 * ib + m] | (((w >> (3 * m)) & 7) << 8);
            delta[4 * ib + m] = static_cast<int8_t>(w >> 15 ? -1 : 1);
          }
        }
      } else {
        uint16_t w[4];
        for (int i = 0; i < 4; ++i) w[i] = u16(blk + 48 + 2 * i);
        c.d = static_cast<uint16_t>((w[0] >> 12) | ((w[1] >> 12) << 4) | ((w[2] >> 12) << 8) | ((w[3] >> 12) << 12));
        for (int g = 0; g < 16; ++g) c.sub[g] = static_cast<int8_t>(1 + 2 * ((w[g / 4] >> (3 * (g % 4))) & 7));
        for (int i = 0; i < 32; ++i) {
          const int nibble = (blk[32 + i / 2] >> (4 * (i % 2))) & 0x0F;
          index[i] = blk[i] | ((nibble & 7) << 8);
          delta[i] = static_cast<int8_t>(nibble >> 3 ? -1 : 1);
        }
      }
      for (int i = 0; i < 32; ++i) {  // 8 grid + delta: the grid's -1, 0, 1 times 8, +- 1
        int8_t e[8];
        std::memcpy(e, grid + index[i] * 8, 8);
        for (int k = 0; k < 8; ++k) e[k] = static_cast<int8_t>(8 * e[k] + delta[i]);
        std::memcpy(c.v + 8 * i, e, 8);
      }
      return;
    }
  }
}

#if defined(__AVX2__)
// The same decode, 32 values at a time: a 32-weight group's 4 (or 8) grid entries
// loaded into one vector, multiplied by their signs with one vpsignb. The sign bytes
// of a sign mask m (bit k set: value k negative) are kSignBytes[m]: -1 or 1 each.
// A 7-bit sign index i's (parity_signs) are kSignBytes.even[i], precomputed: the popcount
// and shifts cost more than the rest of a group's decode.
struct SignBytes {
  uint64_t of[256];
  uint64_t even[128];
  constexpr SignBytes() : of(), even() {
    for (int m = 0; m < 256; ++m)
      for (int k = 0; k < 8; ++k) of[m] |= static_cast<uint64_t>((m >> k) & 1 ? 0xFF : 0x01) << (8 * k);
    for (int i = 0; i < 128; ++i) {
      int odd = 0;
      for (int k = 0; k < 7; ++k) odd ^= (i >> k) & 1;
      even[i] = of[i | (odd << 7)];
    }
  }
};
constexpr SignBytes kSignBytes;

inline int64_t entry8(const int8_t* grid, int64_t index) { int64_t e; std::memcpy(&e, grid + 8 * index, 8); return e; }
inline int32_t entry4(const int8_t* grid, int64_t index) { int32_t e; std::memcpy(&e, grid + 4 * index, 4); return e; }
// Four words as one vector, put together in registers: stored as four and loaded as one,
// they would wait for the stores (a load across several stores is not forwarded).
inline __m256i words(const uint64_t* w) {
  return _mm256_setr_epi64x(static_cast<int64_t>(w[0]), static_cast<int64_t>(w[1]), static_cast<int64_t>(w[2]),
                            static_cast<int64_t>(w[3]));
}
// Four 8-value entries (a group of 32) times their sign bytes (kSignBytes' words), or
// eight 4-value entries.
inline __m256i signed8(const int8_t* grid, const int64_t* index, const uint64_t* signs) {
  const __m256i values = _mm256_setr_epi64x(entry8(grid, index[0]), entry8(grid, index[1]), entry8(grid, index[2]),
                                            entry8(grid, index[3]));
  return _mm256_sign_epi8(values, words(signs));
}
inline __m256i signed4(const int8_t* grid, const int64_t* index, const uint64_t* signs) {
  const __m256i values = _mm256_setr_epi32(entry4(grid, index[0]), entry4(grid, index[1]), entry4(grid, index[2]),
                                           entry4(grid, index[3]), entry4(grid, index[4]), entry4(grid, index[5]),
                                           entry4(grid, index[6]), entry4(grid, index[7]));
  return _mm256_sign_epi8(values, words(signs));
}
__attribute__((always_inline)) inline void decode(int64_t code, const int8_t* grid, const uint8_t* blk,
                                                 Decoded& c) {
  int64_t index[8];
  uint64_t mask[4];  // sign bytes
  auto put = [&](int ib, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(c.v + 32 * ib), v); };
  switch (code) {
    case IQ2_XXS:
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        const uint8_t* q = blk + 2 + 8 * ib;
        const uint32_t w = u32(q + 4);
        c.sub[2 * ib] = c.sub[2 * ib + 1] = static_cast<int8_t>(1 + 2 * (w >> 28));
        for (int j = 0; j < 4; ++j) {
          index[j] = q[j];
          mask[j] = kSignBytes.even[(w >> (7 * j)) & 127];
        }
        put(ib, signed8(grid, index, mask));
      }
      return;
    case IQ2_XS:
    case IQ2_S:
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * ib + j;
          if (code == IQ2_XS) {
            const uint16_t w = u16(blk + 2 + 2 * i);
            index[j] = w & 511;
            mask[j] = kSignBytes.even[w >> 9];
          } else {
            index[j] = blk[2 + i] | (((blk[66 + ib] >> (2 * j)) & 3) << 8);
            mask[j] = kSignBytes.of[blk[34 + i]];
          }
        }
        put(ib, signed8(grid, index, mask));
      }
      for (int g = 0; g < 16; ++g)
        c.sub[g] = static_cast<int8_t>(1 + 2 * ((blk[(code == IQ2_XS ? 66 : 74) + g / 2] >> (4 * (g % 2))) & 0x0F));
      return;
    case IQ3_XXS:
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        const uint32_t w = u32(blk + 66 + 4 * ib);
        c.sub[2 * ib] = c.sub[2 * ib + 1] = static_cast<int8_t>(1 + 2 * (w >> 28));
        for (int k = 0; k < 8; ++k) index[k] = blk[2 + 8 * ib + k];
        for (int j = 0; j < 4; ++j) mask[j] = kSignBytes.even[(w >> (7 * j)) & 127];
        put(ib, signed4(grid, index, mask));
      }
      return;
    case IQ3_S:
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        const int s = (blk[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
        c.sub[2 * ib] = c.sub[2 * ib + 1] = static_cast<int8_t>(1 + 2 * s);
        for (int k = 0; k < 8; ++k) index[k] = blk[2 + 8 * ib + k] | (((blk[66 + ib] >> k) & 1) << 8);
        for (int j = 0; j < 4; ++j) mask[j] = kSignBytes.of[blk[74 + 4 * ib + j]];
        put(ib, signed4(grid, index, mask));
      }
      return;
    case IQ1_S:  // entries of -1, 0, 1: 8 times them (vpsignb of 8s), plus the delta
      c.d = u16(blk);
      for (int ib = 0; ib < 8; ++ib) {
        const uint16_t w = u16(blk + 34 + 2 * ib);
        c.sub[2 * ib] = c.sub[2 * ib + 1] = static_cast<int8_t>(1 + 2 * ((w >> 12) & 7));
        for (int m = 0; m < 4; ++m) index[m] = blk[2 + 4 * ib + m] | (((w >> (3 * m)) & 7) << 8);
        const __m256i entries = _mm256_setr_epi64x(entry8(grid, index[0]), entry8(grid, index[1]),
                                                   entry8(grid, index[2]), entry8(grid, index[3]));
        const __m256i delta = _mm256_set1_epi8(static_cast<char>(w >> 15 ? -1 : 1));
        put(ib, _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), entries), delta));
      }
      return;
    case IQ1_M: {
      uint16_t w[4];
      for (int i = 0; i < 4; ++i) w[i] = u16(blk + 48 + 2 * i);
      c.d = static_cast<uint16_t>((w[0] >> 12) | ((w[1] >> 12) << 4) | ((w[2] >> 12) << 8) | ((w[3] >> 12) << 12));
      for (int g = 0; g < 16; ++g) c.sub[g] = static_cast<int8_t>(1 + 2 * ((w[g / 4] >> (3 * (g % 4))) & 7));
      for (int ib = 0; ib < 8; ++ib) {
        int64_t delta[4];
        for (int m = 0; m < 4; ++m) {
          const int i = 4 * ib + m;
          const int nibble = (blk[32 + i / 2] >> (4 * (i % 2))) & 0x0F;
          index[m] = blk[i] | ((nibble & 7) << 8);
          delta[m] = nibble >> 3 ? -1 : 0x0101010101010101;  // -1 or 1 in each byte
        }
        const __m256i entries = _mm256_setr_epi64x(entry8(grid, index[0]), entry8(grid, index[1]),
                                                   entry8(grid, index[2]), entry8(grid, index[3]));
        const __m256i deltas = _mm256_setr_epi64x(delta[0], delta[1], delta[2], delta[3]);
        put(ib, _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), entries), deltas));
      }
      return;
    }
  }
}
#else
inline void decode(int64_t code, const int8_t* grid, const uint8_t* blk, Decoded& c) {
  decode_entries(code, grid, blk, c);
}
#endif

}  // namespace codebook

// Type ``code``'s grid (int8 [entries, width]: blocks.py's ``grid``), kept for the
// kernels that decode its blocks; a grid given again must be the same.
void set_codebook_grid(int64_t code, torch::Tensor grid) {
  const codebook::Shape shape = codebook::shape(code);
  TORCH_CHECK(shape.entries > 0, "GGML type ", code, " has no codebook");
  TORCH_CHECK(grid.scalar_type() == torch::kChar && grid.is_contiguous() && grid.dim() == 2 &&
                  grid.size(0) == shape.entries && grid.size(1) == shape.width,
              "grid: int8 [", shape.entries, ", ", shape.width, "], the type's codebook");
  const int8_t* data = grid.data_ptr<int8_t>();
  std::lock_guard<std::mutex> hold(codebook::grid_lock());
  std::vector<int8_t>& kept = codebook::grid_storage(code);
  const std::vector<int8_t> given(data, data + grid.numel());
  TORCH_CHECK(kept.empty() || kept == given, "GGML type ", code, ": a different grid than before");
  if (kept.empty()) kept = given;  // never reallocated after: kernels hold its address
}
