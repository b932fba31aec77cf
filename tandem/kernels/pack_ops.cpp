// GGML block bytes (a GGUF tensor's rows) -> the tiled layout of quant_ops.cpp, in one
// pass, threads taking disjoint tiles: how a quantized file is repacked at load.
//
// The same result as tandem/quant/packed.py's PackedWeight.from_decoded(decode(...)),
// byte for byte (the tests compare both), without the Python path's intermediates
// (every weight as a byte, then tiled and permuted by torch): loading a 4.7 GB 8B
// Q4_0 file took 66 s that way on 2 cores. Block layouts are in tandem/quant/blocks.py.
//
// Outputs, allocated by the caller (packed.py):
//   values  uint8 [tiles, K * 2 * bits]: 4 bits (Q4_0, Q4_1, Q4_K; Q3_K's 0..7, Q2_K's 0..3
//           unless compact, below), 5
//           (Q5_0, Q5_1, Q5_K: 0..31), 6 (Q6_K: 0..63), as nibbles and high-bit planes; int8
//           [tiles, K*16] for Q8_0
//   scales  float16 [tiles, K/group, 16] holding the file's own scale bits (Q4_0, Q4_1,
//           Q5_0, Q5_1, Q8_0); for the K formats uint8 records [tiles, K/256, R], the
//           file's factors per super-block, each item for the tile's 16 rows side by
//           side (quant_ops.cpp's quant::record): Q4_K / Q5_K (R = 320) d, dmin
//           (float16 bits), sub-scales [8], sub-mins [8]; Q6_K and Q3_K (R = 288) d,
//           sub-scales [16] (int8; Q3_K's 6-bit scale - 32; TQ1_0's and TQ2_0's 1s;
//           IQ4_XS's 6-bit scale - 32 for both groups of its 32); Q2_K (R = 320) d,
//           dmin, its 16 bytes of a 4-bit sub-scale and sub-min; IQ4_NL as Q8_0, its
//           values its table's levels (IQ4_XS's too, int8 under its records); MXFP4 as
//           Q5_0, its values + 16 and its powers of two as float16. Where the kernels
//           read the compact layouts (quant::kCompactLayouts) and ``values`` is sized
//           for them (compact_bits), IQ4_NL, IQ4_XS and MXFP4 keep the file's 4-bit
//           indices instead, as Q4_0's nibbles (MXFP4's -0, index 8, as +0, index 0),
//           Q2_K and the ternary types take 2 bits, Q3_K 3
//   corr    float16 like scales, or absent: Q4_1 / Q5_1's m
// The codebook i-quants are copied as the file's blocks (quant::codebook_offset: per
// super-block, the tile's 16 rows' blocks side by side; no scales), which the kernel
// decodes as it multiplies them (codebook_ops.cpp).
// Rows past the matrix's last (padding of the last tile) are zeros everywhere.

#include <torch/python.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace pack {

constexpr int64_t kRows = 16;

enum Code : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  IQ1_M = 29, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39
};
// IQ4_NL's (and IQ4_XS's) levels and MXFP4's values (FP4 E2M1 doubled; held + 16 as
// Q5_0's are), as int8 values: quant::kTables.
constexpr const int8_t* kIq4Levels = quant::kTables[0];
constexpr const int8_t* kMxfp4Values = quant::kTables[1];

// Bytes of the format's super-block records a tile (quant::record), 0: float16 scales.
inline int64_t record_bytes(int64_t code) {
  switch (code) {
    case Q4_K: case Q5_K: return 320;
    case Q6_K: case Q3_K: case TQ1_0: case TQ2_0: case IQ4_XS: return 288;
    case Q2_K: return 320;
    default: return 0;
  }
}

// The group of the format's records' sub-scales (quant::record).
inline int64_t record_group(int64_t code) { return code == Q4_K || code == Q5_K ? 32 : 16; }

// Bits a value of the format takes packed.
inline int value_bits(int64_t code) {
  switch (code) {
    case Q5_0: case Q5_1: case Q5_K: case MXFP4: return 5;
    case Q6_K: return 6;
    case Q8_0: case IQ4_NL: case IQ4_XS: return 8;
    default: return 4;
  }
}
// Bits a value takes in the compact layouts, where the kernels read them
// (quant::kCompactLayouts); 0: none (blocks.py's BlockFormat.compact_bits).
inline int compact_bits(int64_t code) {
  switch (code) {
    case Q2_K: case TQ1_0: case TQ2_0: return 2;
    case Q3_K: return 3;
    case IQ4_NL: case IQ4_XS: case MXFP4: return 4;
    default: return 0;
  }
}

using codebook::u16;  // little-endian loads: codebook_ops.cpp's, before this file

struct Out {
  uint8_t* values;
  int64_t values_per_tile;
  void* scales;
  void* corr;      // nullptr when the format has no constants
  int64_t groups;  // per row (float16 scales)
  int64_t supers;  // super-blocks per row (records)
  int64_t record_group;  // records (quant::record): the format's group; 0: float16 scales
  bool record_mins;      // records: with minimums (groups of 32; Q2_K's of 16)
  int bits;              // bits a value takes in ``values`` (IQ4_NL, IQ4_XS, MXFP4: 4, their
                         // table indices; see the top)
};

// Row r's 4 bytes of vector v of 32-block b in its tile (quant_ops.cpp's quant::values).
inline uint8_t* at(uint8_t* tile, int bits, int64_t b, int64_t v, int64_t r) {
  return tile + quant::values::offset(bits, b, v, r);
}
// Four consecutive bytes as one little-endian word: the packer moves values four at
// a time, as the layout keeps them (4 weights of a row side by side).
inline uint32_t word(const uint8_t* p) { return codebook::u32(p); }
inline void put_word(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
constexpr uint32_t kNibbles = 0x0F0F0F0Fu;

// The 32 values of row r, 32-block b, into its tile, as words: quad(k) holds weights
// 4k..4k+3 of the block, a byte each (a value of ``bits`` bits, bits above it zero).
template <int bits, typename Quad>
inline void put_values(uint8_t* tile, int64_t b, int64_t r, Quad quad) {
  uint32_t q[8];
  for (int k = 0; k < 8; ++k) q[k] = quad(k);
  if constexpr (bits == 8) {
    for (int s = 0; s < 8; ++s) put_word(at(tile, 8, b, s, r), q[s]);
  } else {
    constexpr int low = quant::values::low(bits), hb = quant::values::high(bits);
    if constexpr (low == 4) {
      // Nibble vector p: weights 4p+i (low nibble) and 16+4p+i (high nibble).
      for (int p = 0; p < 4; ++p)
        put_word(at(tile, bits, b, p, r), (q[p] & kNibbles) | ((q[p + 4] & kNibbles) << 4));
    } else {
      // Crumb vector h: weights 4s+i, s = 4h + p, at bits 2p.
      for (int h = 0; h < 2; ++h) {
        uint32_t crumbs = 0;
        for (int p = 0; p < 4; ++p) crumbs |= (q[4 * h + p] & 0x03030303u) << (2 * p);
        put_word(at(tile, bits, b, h, r), crumbs);
      }
    }
    if constexpr (hb > 0) {
      // Value vector s = 4h + p (weights 4s..4s+3) keeps its high bits in plane
      // vector high_vector(bits, s) from bit high_bit(bits, s) of each byte.
      constexpr uint32_t high = (1u << hb) - 1;
      uint32_t planes[2] = {0, 0};
      for (int s = 0; s < 8; ++s)
        planes[quant::values::high_vector(bits, s) - low] |=
            ((q[s] >> low) & (high * 0x01010101u)) << quant::values::high_bit(bits, s);
      for (int v = 0; v < hb; ++v) put_word(at(tile, bits, b, low + v, r), planes[v]);
    }
  }
}

// Bits 0..3 of x as bit 0 of bytes 0..3.
inline uint32_t spread4(uint32_t x) {
  return (x & 1) | ((x & 2) << 7) | ((x & 4) << 14) | ((x & 8) << 21);
}
inline void put_scale(const Out& o, int64_t tile, int64_t g, int64_t r, uint16_t bits, void* dst) {
  static_cast<uint16_t*>(dst)[(tile * o.groups + g) * kRows + r] = bits;
}
// Super-block sb's record in tile ``tile`` (laid out by quant::record): float16 item j
// (d, dmin) of row r at byte 32j + 2r, byte unit u of row r at byte 16u + r.
inline uint8_t* record(const Out& o, int64_t tile, int64_t sb) {
  return static_cast<uint8_t*>(o.scales) + (tile * o.supers + sb) * quant::record::bytes(o.record_group, o.record_mins);
}
inline void put_half(uint8_t* at, uint16_t bits) { std::memcpy(at, &bits, 2); }

// 6-bit scale and min j of a Q4_K / Q5_K block's 12 bytes (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A super-block's 256 2-bit values into 32-blocks sb * 8 .. sb * 8 + 7 of tile row r:
// weight 128h + 32j + l is bits 2j of qs[32h + l] (TQ2_0's values, Q3_K's low bits),
// with bit 4h + j of hmask[l] above them when there is a hmask (Q3_K's third bit); as
// values of ``bits`` bits (a nibble each, or 2 and 3: the compact layouts).
template <int bits>
inline void put_pairs(uint8_t* dst, int64_t sb, int64_t r, const uint8_t* qs, const uint8_t* hmask) {
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      put_values<bits>(dst, sb * 8 + h * 4 + j, r, [&](int k) {
        const uint32_t pairs = (word(qs + 32 * h + 4 * k) >> (2 * j)) & 0x03030303u;
        if (hmask == nullptr) return pairs;
        return pairs | (((word(hmask + 4 * k) >> (4 * h + j)) & 0x01010101u) << 2);
      });
}
inline void put_pairs(const Out& o, uint8_t* dst, int64_t sb, int64_t r, const uint8_t* qs,
                      const uint8_t* hmask) {
  if (o.bits == 4) put_pairs<4>(dst, sb, r, qs, hmask);
  else if (o.bits == 3) put_pairs<3>(dst, sb, r, qs, hmask);
  else put_pairs<2>(dst, sb, r, qs, hmask);
}

// A 32-weight block's 16 bytes ``qs`` of nibbles (weight j low in byte j, 16 + j high)
// into block b of tile row r as 4-bit values: vector p is bytes 4p..4p+3 as they are
// (Q4_0's and the table formats' indices); ``plus_zero``: MXFP4's -0 (8) as +0.
inline void put_nibbles(uint8_t* tile, int64_t b, int64_t r, const uint8_t* qs, bool plus_zero) {
  for (int p = 0; p < 4; ++p) {
    uint32_t w = word(qs + 4 * p);
    if (plus_zero) {  // a nibble is 8 where bit 3 is set and bits 0-2 are clear
      const uint32_t low = ((w & 0x77777777u) + 0x77777777u) & 0x88888888u;
      w &= ~(w & 0x88888888u & ~low);
    }
    put_word(at(tile, 4, b, p, r), w);
  }
}

// Weights 4k..4k+3 of a 32-weight block whose 16 bytes ``qs`` hold weight j in the low
// nibble of byte j and weight 16 + j in the high: each nibble's entry of ``table`` plus
// ``add``, a byte each (IQ4_NL's levels, MXFP4's values + 16).
inline uint32_t table_quad(const uint8_t* qs, int k, const int8_t* table, int add) {
  // Bytes 4(k % 4)..+3 hold the four weights: their low nibbles for k < 4, else high.
  const uint32_t bytes = word(qs + 4 * (k % 4)) >> (k < 4 ? 0 : 4);
  uint32_t quad = 0;
  for (int i = 0; i < 4; ++i)
    quad |= static_cast<uint32_t>(static_cast<uint8_t>(table[(bytes >> (8 * i)) & 0x0F] + add)) << (8 * i);
  return quad;
}

// One row's blocks -> tile row r.
void pack_row(int64_t code, const uint8_t* row, int64_t K, const Out& o, int64_t tile, int64_t r) {
  uint8_t* dst = o.values + tile * o.values_per_tile;
  if (const int64_t size = codebook::shape(code).bytes) {  // the file's blocks, as they are
    for (int64_t sb = 0; sb < K / 256; ++sb) std::memcpy(dst + quant::codebook_offset(size, sb, r), row + sb * size, size);
    return;
  }
  switch (code) {
    case Q4_0:
    case Q4_1: {
      const int64_t size = code == Q4_0 ? 18 : 20, start = code == Q4_0 ? 2 : 4;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * size;
        // Byte 4p+i of the file holds weights 4p+i and 16+4p+i: the packed byte as is.
        put_nibbles(dst, b, r, blk + start, false);
        put_scale(o, tile, b, r, u16(blk), o.scales);
        if (code == Q4_1) put_scale(o, tile, b, r, u16(blk + 2), o.corr);
      }
      return;
    }
    case Q8_0:
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * 34;
        put_values<8>(dst, b, r, [&](int k) { return word(blk + 2 + 4 * k); });
        put_scale(o, tile, b, r, u16(blk), o.scales);
      }
      return;
    case IQ4_NL:
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * 18;
        // Byte j holds weight j (low nibble) and weight 16 + j (high nibble).
        if (o.bits == 4) put_nibbles(dst, b, r, blk + 2, false);
        else put_values<8>(dst, b, r, [&](int k) { return table_quad(blk + 2, k, kIq4Levels, 0); });
        put_scale(o, tile, b, r, u16(blk), o.scales);
      }
      return;
    case IQ4_XS:  // IQ4_NL's levels under Q6_K's records: a 32-weight scale a group of 16 twice
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 136;
        const uint16_t high = u16(blk + 2);
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk));
        for (int g = 0; g < 8; ++g) {
          // 6-bit scale g: its low nibble from scales_l, its top two bits from scales_h.
          const int ls = ((blk[4 + g / 2] >> (4 * (g % 2))) & 0x0F) | (((high >> (2 * g)) & 0x03) << 4);
          const uint8_t sub = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
          rec[quant::record::sub_unit(16, false, 2 * g) * kRows + r] = sub;
          rec[quant::record::sub_unit(16, false, 2 * g + 1) * kRows + r] = sub;
          // Byte j of the group's 16 holds weight j (low nibble) and weight 16 + j (high).
          if (o.bits == 4) put_nibbles(dst, sb * 8 + g, r, blk + 8 + 16 * g, false);
          else put_values<8>(dst, sb * 8 + g, r, [&](int k) { return table_quad(blk + 8 + 16 * g, k, kIq4Levels, 0); });
        }
      }
      return;
    case MXFP4:
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * 17;
        // Byte 1 + j holds weight j (low nibble) and weight 16 + j (high nibble).
        if (o.bits == 4) put_nibbles(dst, b, r, blk + 1, true);
        else put_values<5>(dst, b, r, [&](int k) { return table_quad(blk + 1, k, kMxfp4Values, 16); });
        // The shared exponent's 2**(e - 128) (ggml's e8m0 half), as a float16 (the
        // loader keeps only tensors whose powers of two a float16 holds).
        const uint32_t e = blk[0];
        const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
        float scale;
        std::memcpy(&scale, &bits, 4);
        put_scale(o, tile, b, r, c10::Half(scale).x, o.scales);
      }
      return;
    case Q5_0:
    case Q5_1: {
      const int64_t size = code == Q5_0 ? 22 : 24, start = code == Q5_0 ? 2 : 4;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * size;
        const uint32_t qh = word(blk + start);
        const uint8_t* qs = blk + start + 4;
        // Weights 0..15: low nibbles of qs, high bit j of qh; 16..31: high nibbles, bit 16 + j.
        put_values<5>(dst, b, r, [&](int k) {
          const uint32_t low = k < 4 ? word(qs + 4 * k) : word(qs + 4 * (k - 4)) >> 4;
          return (low & kNibbles) | (spread4((qh >> (4 * k)) & 0x0F) << 4);
        });
        put_scale(o, tile, b, r, u16(blk), o.scales);
        if (code == Q5_1) put_scale(o, tile, b, r, u16(blk + 2), o.corr);
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const int64_t size = code == Q4_K ? 144 : 176;
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * size;
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk));
        put_half(rec + 2 * (kRows + r), u16(blk + 2));
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (code == Q4_K ? 16 : 48);
        for (int g = 0; g < 8; ++g) {
          // Group g: nibble g % 2 of the 32 bytes of chunk g / 2.
          const uint8_t* chunk = qs + (g / 2) * 32;
          const int shift = (g % 2) * 4;
          const int64_t b = sb * 8 + g;
          if (code == Q4_K) {
            put_values<4>(dst, b, r, [&](int k) { return (word(chunk + 4 * k) >> shift) & kNibbles; });
          } else {  // the fifth bit of weight j is bit g of qh[j]
            put_values<5>(dst, b, r, [&](int k) {
              return ((word(chunk + 4 * k) >> shift) & kNibbles) |
                     (((word(qh + 4 * k) >> g) & 0x01010101u) << 4);
            });
          }
          scale_min_k4(g, blk + 4, rec[quant::record::sub_unit(32, true, g) * kRows + r],
                       rec[quant::record::min_unit(32, g) * kRows + r]);
        }
      }
      return;
    }
    case Q3_K:
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 110;
        const uint8_t* hmask = blk;
        const uint8_t* qs = blk + 32;
        const uint8_t* packed = blk + 96;
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk + 108));
        for (int g = 0; g < 16; ++g) {  // 6-bit scale g (blocks.py's _decode_q3_k), less 32
          const int low = g < 8 ? packed[g] & 0x0F : packed[g - 8] >> 4;
          const int top = (packed[8 + g % 4] >> (2 * (g / 4))) & 0x03;
          rec[quant::record::sub_unit(16, false, g) * kRows + r] = static_cast<uint8_t>((low | (top << 4)) - 32);
        }
        put_pairs(o, dst, sb, r, qs, hmask);
      }
      return;
    case Q2_K:  // Q3_K's pairs; records of groups of 16 with minimums
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 84;
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk + 80));
        put_half(rec + 2 * (kRows + r), u16(blk + 82));
        // Byte g: group g's sub-scale (low nibble) and sub-min (high), as records keep them.
        for (int g = 0; g < 16; ++g) rec[quant::record::sub_unit(16, true, g) * kRows + r] = blk[g];
        put_pairs(o, dst, sb, r, blk + 16, nullptr);
      }
      return;
    case TQ2_0:  // Q3_K's layout: 2-bit values (bits 2j of byte 32h + l), sub-scales of 1
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 66;
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk + 64));
        for (int g = 0; g < 16; ++g) rec[quant::record::sub_unit(16, false, g) * kRows + r] = 1;
        put_pairs(o, dst, sb, r, blk, nullptr);
      }
      return;
    case TQ1_0:  // TQ2_0's layout: its base-3 values rewritten as TQ2_0's 2-bit pairs
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 54;
        uint8_t trits[256];
        // Byte b's k-th value is the top trit of b * 3**k (blocks.py's _decode_tq1_0).
        auto unpack = [&](const uint8_t* bytes, int n, int values, int first) {
          uint8_t power = 1;
          for (int k = 0; k < values; ++k, power = static_cast<uint8_t>(power * 3))
            for (int i = 0; i < n; ++i)
              trits[first + n * k + i] = static_cast<uint8_t>((static_cast<uint8_t>(bytes[i] * power) * 3) >> 8);
        };
        unpack(blk, 32, 5, 0);
        unpack(blk + 32, 16, 5, 160);
        unpack(blk + 48, 4, 4, 240);
        uint8_t pairs[64];
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 32; ++l) {
            const uint8_t* t = trits + 128 * h + l;
            pairs[32 * h + l] = t[0] | (t[32] << 2) | (t[64] << 4) | (t[96] << 6);
          }
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk + 52));
        for (int g = 0; g < 16; ++g) rec[quant::record::sub_unit(16, false, g) * kRows + r] = 1;
        put_pairs(o, dst, sb, r, pairs, nullptr);
      }
      return;
    case Q6_K:
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        uint8_t* rec = record(o, tile, sb);
        put_half(rec + 2 * r, u16(blk + 208));
        for (int g = 0; g < 16; ++g) rec[quant::record::sub_unit(16, false, g) * kRows + r] = blk[192 + g];  // int8
        for (int h = 0; h < 2; ++h) {
          for (int part = 0; part < 4; ++part) {
            // Weights h*128 + part*32 + j: low 4 bits from ql, high 2 from qh.
            const uint8_t* low = ql + h * 64 + (part % 2) * 32;
            const int low_shift = (part / 2) * 4, high_shift = part * 2;
            const uint8_t* high = qh + h * 32;
            put_values<6>(dst, sb * 8 + h * 4 + part, r, [&](int k) {
              return ((word(low + 4 * k) >> low_shift) & kNibbles) |
                     (((word(high + 4 * k) >> high_shift) & 0x03030303u) << 4);
            });
          }
        }
      }
      return;
  }
  TORCH_CHECK(false, "no packer for GGML type ", code);
}

// Zeros for tile row r (a padding row).
// Every layout is runs of 4 bytes per row: [vectors, 16 rows, 4]; the codebook types'
// blocks a block a row (quant::codebook_offset).
void zero_row(int64_t code, const Out& o, int64_t tile, int64_t r) {
  uint8_t* dst = o.values + tile * o.values_per_tile;
  if (const int64_t size = codebook::shape(code).bytes) {
    for (int64_t sb = 0; sb < o.supers; ++sb) std::memset(dst + quant::codebook_offset(size, sb, r), 0, size);
    return;
  }
  const int64_t steps = o.values_per_tile / (kRows * 4);
  for (int64_t s = 0; s < steps; ++s) std::memset(dst + (s * kRows + r) * 4, 0, 4);
  if (o.record_group) {
    const int64_t halves = quant::record::halves(o.record_mins);
    const int64_t units = quant::record::bytes(o.record_group, o.record_mins) / kRows;
    for (int64_t sb = 0; sb < o.supers; ++sb) {
      uint8_t* rec = record(o, tile, sb);
      for (int64_t h = 0; h < halves; ++h) put_half(rec + 2 * (h * kRows + r), 0);
      for (int64_t unit = 2 * halves; unit < units; ++unit) rec[unit * kRows + r] = 0;
    }
    return;
  }
  for (int64_t g = 0; g < o.groups; ++g) {
    put_scale(o, tile, g, r, 0, o.scales);
    if (o.corr) put_scale(o, tile, g, r, 0, o.corr);
  }
}

}  // namespace pack

// raw: uint8 [rows, row bytes] (a GGUF tensor, rows may be strided) of GGML type
// ``code`` with ``columns`` weights a row -> values, scales (and corr) as laid out above.
void pack_ggml(torch::Tensor raw, int64_t code, int64_t columns, torch::Tensor values,
               torch::Tensor scales, c10::optional<torch::Tensor> corr) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.stride(1) == 1,
              "raw: uint8 [rows, row bytes], rows contiguous");
  TORCH_CHECK(values.is_contiguous() && scales.is_contiguous(), "outputs: contiguous");
  const int64_t rows = raw.size(0), tiles = values.size(0);
  TORCH_CHECK(tiles * pack::kRows >= rows && (tiles - 1) * pack::kRows < rows, "tile count");
  const int64_t block = codebook::shape(code).bytes;  // the codebook types': their blocks
  const int64_t record = pack::record_bytes(code);
  const bool records = record > 0;
  TORCH_CHECK(scales.scalar_type() == (records || block ? torch::kByte : torch::kHalf),
              "scales: uint8 records (K formats), empty (codebook types) or float16");
  TORCH_CHECK((!records && !block) || columns % 256 == 0, "K formats: whole super-blocks");
  int64_t record_group = 0;
  bool record_mins = false;
  if (records) {
    record_group = pack::record_group(code);
    quant::record::kind(record, record_group, record_mins);
  }
  TORCH_CHECK(!records || scales.size(1) == columns / 256 * record, "scales: records per tile");
  // The compact layouts (quant::kCompactLayouts), where ``values`` is sized for them.
  const int compact = pack::compact_bits(code);
  const bool is_compact = compact && quant::kCompactLayouts && values.scalar_type() == torch::kByte &&
                          values.size(1) == columns * 2 * compact;
  const int bits = is_compact ? compact : pack::value_bits(code);
  pack::Out o{static_cast<uint8_t*>(values.data_ptr()), values.size(1), scales.data_ptr(),
              corr.has_value() ? corr->data_ptr() : nullptr, records ? 0 : scales.size(1),
              columns / 256, record_group, record_mins, bits};
  if (block) {
    TORCH_CHECK(values.scalar_type() == torch::kByte && o.values_per_tile == columns / 256 * pack::kRows * block &&
                    scales.numel() == 0,
                "codebook types: uint8 values [tiles, K / 256 * 16 * block bytes], no scales");
  } else {
    TORCH_CHECK(values.scalar_type() == (bits == 8 ? torch::kChar : torch::kByte) &&
                    o.values_per_tile == columns * 2 * bits,
                "values: uint8 [tiles, K * 2 * bits] (int8 [tiles, K * 16] for 8 bits)");
  }
  const uint8_t* base = raw.data_ptr<uint8_t>();
  const int64_t stride = raw.stride(0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < pack::kRows; ++r) {
        const int64_t row = t * pack::kRows + r;
        if (row < rows) pack::pack_row(code, base + row * stride, columns, o, t, r);
        else pack::zero_row(code, o, t, r);
      }
  });
}
