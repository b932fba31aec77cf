// Quantized linear layers on the CPU: weights kept in llama.cpp's block formats,
// activations quantized to 8 bits per block of 32 on the fly, integer dot products.
//
// Layout (built by tandem/quant/packed.py from any GGML format): weight rows in tiles
// of 16, interleaved so that one 64-byte load holds 4 consecutive weights of each of
// the 16 rows; broadcasting 4 activation bytes against it gives, per int32 lane, the
// partial dot product of one row (the shape of llama.cpp's repacked GEMV kernels). A
// tile is one sequential stream: the prefetcher sees one stream per thread, not 16.
// AVX-512 takes a tile in one register; AVX2 in two halves of 8 rows (32 bytes), both
// in one pass for one or two tokens, and for 4-bit values without VNNI (sharing each
// activation broadcast), else one at a time (so that the accumulators stay in
// registers).
//   values  uint8, 2 to 6 bits a weight: per block of 32, ``bits`` vectors of [16 rows, 4]
//           bytes. Each of the eight value vectors s = 4h + p (weights 4s..4s+3 of the
//           block: p = 0..3, h = 0 the first 16 weights, 1 the second) takes its low
//           bits from the low vectors, the rest (hb of them) from high-bit planes:
//           - 4 to 6 bits: vectors 0-3 (p) are nibbles: byte (p, r, i) holds the low
//             nibbles of weights 4p+i (low) and 16+4p+i (high) of row r;
//           - 2 and 3 bits (kCompactLayouts): vectors 0-1 (h) are crumbs: byte (h, r, i)
//             holds the low 2 bits of weight 4s+i at bit 2p;
//           then vectors ``low`` (4 or 2).. hold the planes: s's hb = bits - low bits
//           at bit hb*s of the planes (vector low + hb*s / 8, bit hb*s % 8). Q5's
//           values are 0..31, Q6_K's 0..63 (q, not q - 32), Q3_K's 0..7, Q2_K's 0..3
//           int8 [tiles, K/32 * 8 * 64] (Q8_0): vector s is weights 4s..4s+3
//           ([16 rows, 4]); ``bits`` is 8
//           4-bit values may instead index a table of 16 int8 levels (``table``:
//           IQ4_NL, IQ4_XS, MXFP4), looked up by a byte shuffle and then multiplied as
//           int8 values are (kCompactLayouts, as the 2- and 3-bit values)
//   scales  float16 [tiles, K/group, 16] (group 32), the file's own scales; or, for the
//           K formats, uint8 records [tiles, K/256, R] of the file's factors (R = 320
//           for Q4_K / Q5_K: float16 d[16] and dmin[16], uint8 sub-scales [8][16] and
//           sub-mins [8][16]; R = 288 for Q6_K, group 16: d[16], int8 sub-scales
//           [16][16]; Q3_K's 4-bit and IQ4_XS's int8 values the same way; R = 320 for
//           Q2_K, group 16 with minimums: d[16], dmin[16], and [16][16] bytes of a
//           sub-scale (low nibble) and a sub-min (high), as the file packs them), whose
//           scale is d * sub-scale and constant
//           -(dmin * sub-min), multiplied here in float32 as tandem/quant/blocks.py does
//   corr    float16 like scales, or empty: the group's minimum (Q4_1, Q5_1)
//   or, for the codebook i-quants, the file's blocks (codebook_offset), each tile decoded
//   into int8 values under Q6_K-kind records in the thread's buffers as it is multiplied
//   (expand_codebook; ScaleTable's codebook)
//   offset  an integer the values are stored above (Q4_0: 8, Q5_0: 16, Q6_K: 32)
// so that w[n, k] = scales[n, g] * (q[n, k] - offset) + corr[n, g] with g = k / group.
//
// With x[k] ~= dx_b * xq[k] (xq int8, one dx per block b of 32):
//   y[n] = sum_g  scales[n, g] * dx * (dot(q, xq)_g - offset * sum(xq)_g)
//                 + corr[n, g] * dx * sum(xq)_g
// The offset is taken off in integers, one subtraction per group and token.
// The dot is unsigned-by-signed bytes: VNNI's vpdpbusd where the CPU has it (AVX-512
// or AVX-VNNI), else AVX2's vpmaddubsw (values of at most 6 bits times int8 cannot
// saturate its pairs), whose int16 sums are added as far as int16 holds them (a whole
// block for 4 bits) before one vpmaddwd widens them. int8 weights use llama.cpp's
// sign trick: |q| (unsigned) by xq carrying q's sign.
//
// Work: threads take disjoint tiles; inside, tokens go in chunks that stay in L2,
// and up to 4 tokens reuse each unpacked weight vector. The build is -march=native
// on the machine that runs it (the module cache is keyed on the CPU's flags), which
// is how the instruction set is chosen at run time; without AVX2 a scalar loop runs.
// Prompt-sized passes go to AMX tile registers where the CPU and its kernel give them
// (the amx namespace below), with the same results.

#include <torch/python.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/syscall.h>
#include <unistd.h>

namespace quant {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 16;        // weight rows per tile
// Tokens sharing one unpacked weight vector: on AVX-512 eight for the 4-6 bit formats
// (their sums take 24 of the 32 registers; each weight vector's unpacking and each
// scale's conversion are shared by twice the tokens of four: 1.12-1.29x for Q4_K and
// Q6_K at 16-512 tokens, 1.03-1.07x for Q4_0), four for Q8_0 (its signed dot needs a
// sign-flipped copy of each token's activations: eight measured 0.71-0.76x) and on
// AVX2 (16 registers).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int64_t kWideTokens = 8;
#else
constexpr int64_t kWideTokens = 4;
#endif
template <int kBits>
constexpr int64_t tokens_per_pass() { return kBits == 8 ? 4 : kWideTokens; }
constexpr int64_t kTokenChunk = 64;  // tokens whose quantized activations stay in L2
constexpr int64_t kMinRun = 4;       // tiles a thread takes at least (parallel.cpp)

struct Activations {
  std::vector<int8_t> q;   // [T, K]
  std::vector<float> d;    // [T, K/32]
  std::vector<float> s32;  // [T, K/32]: d * sum(q) over each block (for the constants)
  std::vector<float> s16;  // [T, K/16]: d * sum(q) over each half-block (groups of 16's)
  // [T, K/16]: the matrix's offset times sum(q) over each 16 values, taken off a
  // half-block's dot as it is (one subtraction of a broadcast from memory a half-block
  // and token, no multiply in the tile loop); zero without an offset.
  std::vector<int32_t> offsets;
};

// One block of 32: q = round-half-even(x * (1 / d)), d = max|x| * (1 / 127). Written
// with intrinsics where the CPU has AVX2, so that -ffast-math cannot reassociate the
// rounding (tandem/quant/packed.py's reference reproduces it bit for bit).
inline float quantize_block(const float* src, int8_t* q, int32_t sum[2]) {
#if defined(__AVX2__)
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(_mm_mul_ss(m, _mm_set_ss(1.f / 127.f)));
  const float id = d > 0.f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.f), _mm_set_ss(d))) : 0.f;
  const __m256 scale = _mm256_set1_ps(id);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
  // int32 -> int8 in order: packs interleave 128-bit lanes, the permute undoes it.
  const __m256i words = _mm256_packs_epi32(n[0], n[1]), words2 = _mm256_packs_epi32(n[2], n[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  const __m256i lo = _mm256_add_epi32(n[0], n[1]), hi = _mm256_add_epi32(n[2], n[3]);
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), hi);
  sum[0] = sum[1] = 0;
  for (int i = 0; i < 8; ++i) {
    sum[0] += lanes[i];
    sum[1] += lanes[8 + i];
  }
  return d;
#else
  // SSE's scalar instructions (x86-64's baseline), for the same reason: plain C++ let
  // -ffast-math round x * (1 / d) otherwise, and a product of exactly k + 0.5 became
  // k + 1 where the reference (and the AVX2 path) rounds it to even.
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(src[i]));
  const float d = _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(amax), _mm_set_ss(1.f / 127.f)));
  const float id = d > 0.f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.f), _mm_set_ss(d))) : 0.f;
  sum[0] = sum[1] = 0;
  for (int i = 0; i < kBlock; ++i) {
    // cvtss2si rounds by MXCSR's mode: to nearest, ties to even.
    q[i] = static_cast<int8_t>(_mm_cvtss_si32(_mm_mul_ss(_mm_set_ss(src[i]), _mm_set_ss(id))));
    sum[i / 16] += q[i];
  }
  return d;
#endif
}

void quantize_activations(const float* x, int64_t x_stride, int64_t T, int64_t K, int32_t offset,
                          Activations& a) {
  const int64_t nb = K / kBlock;
  a.q.resize(T * K);
  a.d.resize(T * nb);
  a.s32.resize(T * nb);
  a.s16.resize(T * 2 * nb);
  a.offsets.resize(T * 2 * nb);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum[2];
        const float d = quantize_block(x + t * x_stride + b * kBlock, a.q.data() + t * K + b * kBlock, sum);
        a.d[t * nb + b] = d;
        a.s32[t * nb + b] = d * (sum[0] + sum[1]);
        a.s16[t * 2 * nb + 2 * b] = d * sum[0];
        a.s16[t * 2 * nb + 2 * b + 1] = d * sum[1];
        a.offsets[t * 2 * nb + 2 * b] = offset * sum[0];
        a.offsets[t * 2 * nb + 2 * b + 1] = offset * sum[1];
      }
    }
  });
}

// How a matrix's scales are held (see the top of this file).
enum ScaleKind : int { kHalfScales = 0, kRecords = 1 };

// The tables a matrix's 4-bit values may index (``table`` 1 and 2; 0: none), one
// definition (tandem/quant/blocks.py's IQ4_NL_VALUES and MXFP4_VALUES: the tests read
// these lines): IQ4_NL's and IQ4_XS's levels, MXFP4's values (FP4 E2M1 doubled).
alignas(16) constexpr int8_t kTables[2][16] = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},
};
// Whether this build's paths read the compact layouts: 4-bit table values, and 2- and
// 3-bit values (the AVX2 and portable paths; the AVX-512 and AMX ones not yet, so
// there the table formats pack as int8 levels and Q2_K, Q3_K and the ternary types as
// nibbles: tandem/quant/packed.py asks compact_layouts()).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kCompactLayouts = false;
#else
constexpr bool kCompactLayouts = true;
#endif

// A K format's super-block record (one per tile and super-block of 256 weights), in
// units of 16 bytes, one byte a row: float16 d (units 0-1), dmin (2-3, with minimums:
// groups of 32, and Q2_K's of 16), the sub-scales, then the sub-mins (with minimums;
// groups of 16 with minimums, Q2_K's, keep both in one byte as the file does: the
// sub-scale the low nibble, the sub-min the high).
// The one definition: pack_ops.cpp writes records with it (tandem/quant/packed.py
// mirrors it in torch).
namespace record {
constexpr int64_t halves(bool mins) { return mins ? 2 : 1; }  // d (, dmin)
constexpr int64_t subs(int64_t group) { return 256 / group; }  // sub-scales a record
constexpr bool nibbles(int64_t group, bool mins) { return group == 16 && mins; }
constexpr int64_t sub_unit(int64_t group, bool mins, int64_t g) { return 2 * halves(mins) + g % subs(group); }
constexpr int64_t min_unit(int64_t group, int64_t g) {
  return sub_unit(group, true, g) + (nibbles(group, true) ? 0 : subs(group));
}
// The sub-scale and the sub-min in a unit's byte.
constexpr uint8_t sub_of(int64_t group, bool mins, uint8_t byte) { return nibbles(group, mins) ? byte & 0x0F : byte; }
constexpr uint8_t min_of(int64_t group, uint8_t byte) { return nibbles(group, true) ? byte >> 4 : byte; }
// 320 (group 32; 16 with minimums), 288 (16)
constexpr int64_t bytes(int64_t group, bool mins) {
  return (2 * halves(mins) + subs(group) * (nibbles(group, mins) ? 1 : halves(mins))) * kRows;
}
// Whether ``size`` bytes are a record of groups of ``group``, and then whether it holds
// minimums (groups of 32 always do).
inline bool kind(int64_t size, int64_t group, bool& mins) {
  for (const bool m : {true, false})
    if ((group == 16 || m) && size == bytes(group, m)) {
      mins = m;
      return true;
    }
  return false;
}
}  // namespace record

// A thread streams its tiles' values front to back; asking for the block kPrefetchBytes
// ahead while this one is computed keeps more of the stream in flight than the hardware
// prefetcher does alone (measured in docs/BENCHMARKS.md: batch 1 read 16.5 GB/s of a
// 22.5 GB/s sum without it, on an Intel Xeon VM). Only the pass that brings a tile in
// from memory asks (the first token group of a chunk, the first half of a tile on
// AVX2): the later ones find it in L2. Into L2 (locality hint 2): into L1 measured
// the same here, and decode attention's prefetch measured L1 hints stalling an EPYC.
// Past a tile's end it reads the next tile, the thread's next; past the matrix's end
// the hint is dropped, never faults.
constexpr int64_t kPrefetchBytes = 4096;

template <int kBits>
inline void prefetch_block(const uint8_t* block) {
  for (int line = 0; line < kBits; ++line)
    __builtin_prefetch(block + kPrefetchBytes + line * 64, 0, 2);
}

// Where a value lives (the layout at the top of this file): byte i of row r in vector v
// of block b, for values of ``bits`` bits; the low bits each value takes from the
// nibble or crumb vectors (4 or 2: as many vectors); and where the high bits of value
// vector s (s = 4h + p) are, high(bits) of them: plane vector high_vector, from bit
// high_bit. The one definition: the kernels below and pack_ops.cpp's packer use it
// (tandem/quant/packed.py mirrors it in torch).
namespace values {
constexpr int64_t offset(int bits, int64_t b, int64_t v, int64_t r) { return ((b * bits + v) * kRows + r) * 4; }
constexpr int low(int bits) { return bits < 4 ? 2 : 4; }
constexpr int high(int bits) { return bits - low(bits); }
constexpr int high_vector(int bits, int s) { return low(bits) + high(bits) * s / 8; }
constexpr int high_bit(int bits, int s) { return high(bits) * s % 8; }
}  // namespace values

// Where a matrix's scales and constants are, for either kind.
struct ScaleTable {
  const void* scales;  // float16 [tiles, groups, 16], or uint8 records
  const void* corr;    // float16 like scales; null: none
  int64_t groups;      // per row
  int64_t supers;      // records: super-blocks per row
  int64_t record;      // records: bytes of one; 0 for float16 scales
  int64_t tile_stride; // records: bytes from one tile's to the next (0: one tile's, a buffer)
  int group;
  bool mins;           // records: they hold minimums (groups of 32; Q2_K's of 16)
  // A power of two every scale takes beyond the table's (the codebook i-quants' d / 4
  // and d / 8, which a float16 d may not hold): store_rows multiplies each output by
  // it, exactly. 1 for every other format.
  float factor;
  // The 16 levels a 4-bit value indexes (kTables: IQ4_NL's and IQ4_XS's, MXFP4's), read
  // through a byte shuffle; null: the values are q.
  const int8_t* table;
  // A codebook type (its GGML code; 0: none): the values are its blocks, each tile
  // decoded into int8 values under Q6_K-kind records as it is multiplied
  // (expand_codebook); until then ``scales`` is empty and ``record`` is the size of the
  // records it decodes to.
  int64_t codebook;
  const int8_t* grid;  // the codebook's grid (codebook::grid_of)

  // Constants beside the offset: Q4_1 / Q5_1's minimums, the K formats' dmin terms.
  bool has_constants() const { return corr != nullptr || (record && mins); }
  // The record of tile ``tile`` and super-block ``super`` (of 256 weights).
  const uint8_t* record_at(int64_t tile, int64_t super) const {
    return static_cast<const uint8_t*>(scales) + tile * tile_stride + super * record;
  }
  // The record of tile ``tile`` holding group g. The vector paths below name their
  // group at compile time instead (record_for): a division by the run-time group is an
  // idiv, three of them a block in the tile loop (Q4_K at batch 1 ran 1.4x Q4_0's time).
  const uint8_t* record_of(int64_t tile, int64_t g) const { return record_at(tile, g / (256 / group)); }
  template <int kGroup>
  const uint8_t* record_for(int64_t tile, int64_t g) const { return record_at(tile, g / (256 / kGroup)); }
};

inline float half_at(const void* base, int64_t i) {
  return static_cast<float>(static_cast<const at::Half*>(base)[i]);
}

// One weight's scale and constant (row r of tile ``tile``, group g; the offset apart),
// as the vector paths below compute them.
inline float scale_at(const ScaleTable& s, int64_t tile, int64_t r, int64_t g) {
  if (!s.record) return half_at(s.scales, (tile * s.groups + g) * kRows + r);
  const uint8_t* rec = s.record_of(tile, g);
  const uint8_t sub = record::sub_of(s.group, s.mins, rec[record::sub_unit(s.group, s.mins, g) * kRows + r]);
  const float q = s.group == 32 ? static_cast<float>(sub) : static_cast<float>(static_cast<int8_t>(sub));
  return half_at(rec, r) * q;
}
inline float constant_at(const ScaleTable& s, int64_t tile, int64_t r, int64_t g) {
  if (s.record) {
    if (!s.mins) return 0.f;
    const uint8_t* rec = s.record_of(tile, g);
    const uint8_t sub_min = record::min_of(s.group, rec[record::min_unit(s.group, g) * kRows + r]);
    return -(half_at(rec, kRows + r) * static_cast<float>(sub_min));
  }
  return s.corr != nullptr ? half_at(s.corr, (tile * s.groups + g) * kRows + r) : 0.f;
}

// The value q of weight j (0..31) of row r in block b of a tile (``bits`` as laid out
// at the top of this file), one at a time: the portable path and row lookups.
inline int32_t value_at(const uint8_t* tile, int bits, int64_t b, int64_t r, int64_t j) {
  auto byte = [&](int64_t vector, int64_t i) { return tile[values::offset(bits, b, vector, r) + i]; };
  if (bits == 8) return static_cast<int8_t>(byte(j / 4, j % 4));
  const int s = static_cast<int>(j / 4), i = static_cast<int>(j % 4);  // s = 4h + p
  int32_t q = 0;
  if (bits < 4) q = (byte(s / 4, i) >> (2 * (s % 4))) & 0x03;
  else q = s >= 4 ? byte(s - 4, i) >> 4 : byte(s, i) & 0x0F;
  const int hb = values::high(bits);
  if (hb > 0)
    q |= ((byte(values::high_vector(bits, s), i) >> values::high_bit(bits, s)) & ((1 << hb) - 1)) << values::low(bits);
  return q;
}

// The codebook types' layout: per super-block of 256 columns, the tile's 16 rows'
// blocks side by side, each as the file holds it (codebook_ops.cpp decodes them).
constexpr int64_t codebook_offset(int64_t block_bytes, int64_t sb, int64_t r) { return (sb * kRows + r) * block_bytes; }

// Tile ``blocks``'s codebook super-blocks [0, supers) -> int8 values in the layout at the
// top of this file (``values``: supers * 4096 bytes) under Q6_K-kind records (``records``:
// supers * 288 bytes), the numbers tandem/quant/blocks.py decodes (d's power of two
// apart: ScaleTable's factor). Each super-block's 16 rows are decoded side by side, then
// turned into the layout's [16 rows, 4] vectors: on AVX2 eight rows' 32 values of a block
// at a time, an 8 x 8 transpose of 4-byte words.
// (The type a template argument: its decode inlined, no switch a row.)
template <int64_t kCode>
void expand_codebook_as(const ScaleTable& s, const uint8_t* blocks, int64_t supers, int8_t* values,
                        uint8_t* records) {
  constexpr int64_t bytes = codebook::shape(kCode).bytes;
  static thread_local codebook::Decoded rows[kRows];
  for (int64_t sb = 0; sb < supers; ++sb) {
    uint8_t* rec = records + sb * s.record;
    for (int64_t r = 0; r < kRows; ++r) {
      codebook::Decoded& c = rows[r];
      codebook::decode(kCode, s.grid, blocks + codebook_offset(bytes, sb, r), c);
      std::memcpy(rec + 2 * r, &c.d, 2);
      for (int g = 0; g < 16; ++g) rec[record::sub_unit(16, false, g) * kRows + r] = static_cast<uint8_t>(c.sub[g]);
    }
    for (int64_t b = 0; b < 8; ++b) {
#if defined(__AVX2__)
      for (int64_t half = 0; half < 2; ++half) {
        __m256i row[8], pair[8], quad[8];
        for (int i = 0; i < 8; ++i)
          row[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(rows[8 * half + i].v + 32 * b));
        for (int i = 0; i < 8; i += 2) {
          pair[i] = _mm256_unpacklo_epi32(row[i], row[i + 1]);
          pair[i + 1] = _mm256_unpackhi_epi32(row[i], row[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {  // quad[i + k]: words k and 4 + k of 4 rows
          quad[i] = _mm256_unpacklo_epi64(pair[i], pair[i + 2]);
          quad[i + 1] = _mm256_unpackhi_epi64(pair[i], pair[i + 2]);
          quad[i + 2] = _mm256_unpacklo_epi64(pair[i + 1], pair[i + 3]);
          quad[i + 3] = _mm256_unpackhi_epi64(pair[i + 1], pair[i + 3]);
        }
        for (int k = 0; k < 4; ++k) {  // vector v: word v of the 8 rows
          auto* low = reinterpret_cast<__m256i*>(values + values::offset(8, sb * 8 + b, k, 8 * half));
          auto* high = reinterpret_cast<__m256i*>(values + values::offset(8, sb * 8 + b, k + 4, 8 * half));
          _mm256_storeu_si256(low, _mm256_permute2x128_si256(quad[k], quad[4 + k], 0x20));
          _mm256_storeu_si256(high, _mm256_permute2x128_si256(quad[k], quad[4 + k], 0x31));
        }
      }
#else
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t v = 0; v < 8; ++v)
          std::memcpy(values + values::offset(8, sb * 8 + b, v, r), rows[r].v + 32 * b + 4 * v, 4);
#endif
    }
  }
}
inline void expand_codebook(const ScaleTable& s, const uint8_t* blocks, int64_t supers, int8_t* values,
                            uint8_t* records) {
  using namespace codebook;
  switch (s.codebook) {
    case IQ2_XXS: return expand_codebook_as<IQ2_XXS>(s, blocks, supers, values, records);
    case IQ2_XS: return expand_codebook_as<IQ2_XS>(s, blocks, supers, values, records);
    case IQ2_S: return expand_codebook_as<IQ2_S>(s, blocks, supers, values, records);
    case IQ3_XXS: return expand_codebook_as<IQ3_XXS>(s, blocks, supers, values, records);
    case IQ3_S: return expand_codebook_as<IQ3_S>(s, blocks, supers, values, records);
    case IQ1_S: return expand_codebook_as<IQ1_S>(s, blocks, supers, values, records);
    case IQ1_M: return expand_codebook_as<IQ1_M>(s, blocks, supers, values, records);
    default: TORCH_CHECK(false, "no codebook type ", s.codebook);
  }
}

struct Problem {
  const uint8_t* values;
  int64_t tile_bytes;  // value bytes per tile
  ScaleTable s;
  int32_t offset;      // the values' offset, taken off in integers
  const float* bias;   // null: none
  int64_t N, K;
  const Activations* act;
  float* out;
  int64_t out_stride;
};

inline void store_rows(const Problem& p, int64_t n0, int64_t tok, const float* y,
                       int64_t count = kRows) {
  float* dst = p.out + tok * p.out_stride + n0;
  const int64_t rows = std::min<int64_t>(count, p.N - n0);
  const float factor = p.s.factor;
  for (int64_t r = 0; r < rows; ++r) dst[r] = y[r] * factor + (p.bias != nullptr ? p.bias[n0 + r] : 0.f);
}

// a * b rounded as written: -ffast-math lets the compiler reassociate a product of
// products (d * sub-scale * dx) differently in each instance of a tile kernel, and a
// token's result must not depend on how many tokens came with it. The empty asm hides
// the product from the optimizer; it costs no instruction.
template <typename Vector>
inline Vector product(Vector a, Vector b) {
  Vector p = a * b;
  asm("" : "+v"(p));
  return p;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// int32 lane r += dot of row r's 4 weights with the 4 activation bytes broadcast in x
// (16 rows: one 64-byte load). int8 weights: |w| (unsigned) by x carrying w's sign.
template <bool kSigned>
inline __m512i dot4(__m512i acc, __m512i w, __m512i x) {
  if constexpr (kSigned) {
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    w = _mm512_abs_epi8(w);
  }
  return _mm512_dpbusd_epi32(acc, w, x);
}

inline __m512 halves16(const void* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// Group g's scales for the tile's 16 rows; records: d is its super-block's (super16).
template <int kScales, int kGroup>
inline __m512 scales16(const ScaleTable& s, int64_t tile, int64_t g, __m512 d) {
  if constexpr (kScales == kRecords) {
    const uint8_t* rec = s.record_for<kGroup>(tile, g);
    __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + record::sub_unit(kGroup, kGroup == 32 || s.mins, g) * kRows));
    if (kGroup == 16 && s.mins) sub = _mm_and_si128(sub, _mm_set1_epi8(0x0F));  // record::nibbles
    const __m512i q = kGroup == 32 ? _mm512_cvtepu8_epi32(sub) : _mm512_cvtepi8_epi32(sub);
    return product(d, _mm512_cvtepi32_ps(q));
  } else {
    return halves16(static_cast<const at::Half*>(s.scales) + (tile * s.groups + g) * kRows);
  }
}

// Records: the float16 item (0: d, 1: dmin) of super-block ``super``.
template <int kScales>
inline __m512 super16(const ScaleTable& s, int64_t tile, int64_t super, int item) {
  if constexpr (kScales == kRecords) return halves16(s.record_at(tile, super) + item * 2 * kRows);
  else return _mm512_setzero_ps();
}

// Group g's constant terms for the tile's 16 rows (has_constants() is true), as they
// are added: acc + c * sum for float16 constants; for records, whose constant is
// -(dmin * sub-min) (dmin: its super-block's), c is dmin * sub-min and it is taken off
// by one fnmadd (rounded as the fmadd of its negation).
template <int kScales, int kGroup>
inline __m512 constants16(const ScaleTable& s, int64_t tile, int64_t g, __m512 dmin) {
  if constexpr (kScales == kRecords) {
    const uint8_t* rec = s.record_for<kGroup>(tile, g);
    __m128i mins = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + record::min_unit(kGroup, g) * kRows));
    if constexpr (record::nibbles(kGroup, true)) mins = _mm_and_si128(_mm_srli_epi16(mins, 4), _mm_set1_epi8(0x0F));
    return product(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mins)));
  } else {
    return halves16(static_cast<const at::Half*>(s.corr) + (tile * s.groups + g) * kRows);
  }
}
template <int kScales>
inline __m512 add_constant(__m512 acc, __m512 c, __m512 sum) {
  return kScales == kRecords ? _mm512_fnmadd_ps(c, sum, acc) : _mm512_fmadd_ps(c, sum, acc);
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The high bits of nibble vector s (see the top of this file) from a block's planes,
// moved to bits 4.. of each byte and OR-ed into its low nibbles ``low``.
template <int kBits>
inline __m512i with_high_bits(__m512i low, const __m512i* planes, int s) {
  static_assert(kBits > 4, "the nibble layouts' planes (kCompactLayouts: no crumbs here)");
  constexpr int hb = values::high(kBits);
  const int shift = 4 - values::high_bit(kBits, s);
  __m512i v = planes[values::high_vector(kBits, s) - 4];
  if (shift > 0) v = _mm512_slli_epi16(v, shift);
  if (shift < 0) v = _mm512_srli_epi16(v, -shift);
  // low | (v & mask): bits 4.. of ``low`` are zero, and a 16-bit shift leaves each
  // byte's bits 4..4+hb its own.
  return _mm512_ternarylogic_epi32(low, v, _mm512_set1_epi8(((1 << hb) - 1) << 4), 0xF8);
}

// A block of 4-6 bit values (the layout at the top of this file), one nibble pair at a
// time as bytes q (0 .. 2^bits - 1): ``lo`` holds weights 4p..4p+3 of each of the 16
// rows, ``hi`` weights 16+4p..16+4p+3. The vector tiles multiply them as they come,
// the AMX tiles store them (less the offset) as B tiles.
template <int kBits>
struct BlockValues {
  static_assert(kBits >= 4, "no 2- or 3-bit values on this path (kCompactLayouts)");
  explicit BlockValues(const uint8_t* v) : v(v) {
    for (int i = 0; i < kBits - 4; ++i) planes[i] = _mm512_loadu_si512(v + (4 + i) * 64);
  }
  void pair(int p, __m512i& lo, __m512i& hi) const {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i packed = _mm512_loadu_si512(v + p * 64);
    lo = _mm512_and_si512(packed, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    if constexpr (kBits > 4) {
      lo = with_high_bits<kBits>(lo, planes, p);
      hi = with_high_bits<kBits>(hi, planes, 4 + p);
    }
  }
  const uint8_t* v;
  __m512i planes[2];  // the high-bit planes (5 and 6 bits)
};

// Records: at the first block of a super-block (8 blocks of 32), its d and (with
// constants) dmin.
template <int kScales>
inline void next_super(const Problem& p, int64_t tile_index, int64_t b, bool constants, __m512& d,
                       __m512& dmin) {
  if (kScales == kRecords && b % 8 == 0) {
    d = super16<kScales>(p.s, tile_index, b / 8, 0);
    if (constants) dmin = super16<kScales>(p.s, tile_index, b / 8, 1);
  }
}

// Block b's int32 sums (their offset taken off) scaled into NT tokens' accumulators
// from t0, then the block's constant term: the one float epilogue of the vector tiles
// below and the AMX tiles (amx::tile16), which is why the two give the same bits.
// sum(t, j): token t's sums; for groups of 32 the block's whole (j = 0), for groups
// of 16 its first (j = 0) or second (1) half.
template <int kGroup, int kScales, int NT, typename Sums>
inline void add_block(const Problem& p, int64_t tile_index, int64_t b, int64_t t0, __m512 d,
                      __m512 dmin, bool constants, __m512* acc, Sums sum) {
  const Activations& a = *p.act;
  const int64_t nb = p.K / kBlock;
  if constexpr (kGroup == 32) {
    const __m512 w = scales16<kScales, 32>(p.s, tile_index, b, d);
    for (int t = 0; t < NT; ++t) {
      const __m512 s = product(w, _mm512_set1_ps(a.d[(t0 + t) * nb + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(t, 0)), s, acc[t]);
    }
    // The block's constant term after its scaled dot, in the same pass: as a loop of
    // its own after the blocks it was a chain of dependent fmas, one a block (Q4_K
    // at batch 1 waited on it).
    if (constants) {
      const __m512 c = constants16<kScales, 32>(p.s, tile_index, b, dmin);
      for (int t = 0; t < NT; ++t)
        acc[t] = add_constant<kScales>(acc[t], c, _mm512_set1_ps(a.s32[(t0 + t) * nb + b]));
    }
  } else {
    const __m512 w0 = scales16<kScales, 16>(p.s, tile_index, 2 * b, d);
    const __m512 w1 = scales16<kScales, 16>(p.s, tile_index, 2 * b + 1, d);
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_set1_ps(a.d[(t0 + t) * nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(t, 0)), product(w0, dx), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(t, 1)), product(w1, dx), acc[t]);
    }
    if (constants) {  // (Q2_K: a minimum a group of 16)
      const __m512 c0 = constants16<kScales, 16>(p.s, tile_index, 2 * b, dmin);
      const __m512 c1 = constants16<kScales, 16>(p.s, tile_index, 2 * b + 1, dmin);
      for (int t = 0; t < NT; ++t) {
        const float* s16 = a.s16.data() + (t0 + t) * 2 * nb + 2 * b;
        acc[t] = add_constant<kScales>(acc[t], c0, _mm512_set1_ps(s16[0]));
        acc[t] = add_constant<kScales>(acc[t], c1, _mm512_set1_ps(s16[1]));
      }
    }
  }
}

// One tile (16 rows) x NT tokens starting at t0.
template <int kBits, int kGroup, int kScales, int NT, bool kTable = false>
void tile(const Problem& p, int64_t tile_index, int64_t t0) {
  static_assert(!kTable, "no table values on this path (kCompactLayouts)");
  const int64_t nb = p.K / kBlock;
  const uint8_t* vals = p.values + tile_index * p.tile_bytes;
  const Activations& a = *p.act;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  // Records: the super-block's d and dmin (8 blocks of 32).
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  const bool constants = p.s.has_constants();
  for (int64_t b = 0; b < nb; ++b) {
    next_super<kScales>(p, tile_index, b, constants, d, dmin);
    // dot[t][h]: per row, over the block's first (h = 0) or second 16 values. With
    // fewer than four tokens each is the sum of two chains (c) so that consecutive
    // vpdpbusd do not wait on each other; with more, the tokens' own chains are
    // independent enough, and the registers are needed. (Integer sums: the same
    // result either way.)
    constexpr int kChains = NT >= 4 ? 1 : 2;
    __m512i chain[NT][2][kChains];
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < kChains; ++c) chain[t][h][c] = _mm512_setzero_si512();
    const uint8_t* v = vals + b * kBits * 64;
    if (t0 % kTokenChunk == 0) prefetch_block<kBits>(v);
    if constexpr (kBits < 8) {
      const BlockValues<kBits> block(v);
      for (int pair = 0; pair < 4; ++pair) {
        __m512i lo, hi;
        block.pair(pair, lo, hi);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = a.q.data() + (t0 + t) * p.K + b * kBlock;
          __m512i* c0 = &chain[t][0][pair % kChains];
          __m512i* c1 = &chain[t][1][pair % kChains];
          *c0 = dot4<false>(*c0, lo, broadcast4(x + 4 * pair));
          *c1 = dot4<false>(*c1, hi, broadcast4(x + 16 + 4 * pair));
        }
      }
    } else {
      for (int step = 0; step < 8; ++step) {
        const __m512i w = _mm512_loadu_si512(v + step * 64);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = a.q.data() + (t0 + t) * p.K + b * kBlock;
          __m512i* c = &chain[t][step / 4][step % kChains];
          *c = dot4<true>(*c, w, broadcast4(x + 4 * step));
        }
      }
    }
    __m512i dot[NT][2];
    for (int t = 0; t < NT; ++t) {
      const int32_t* offsets = a.offsets.data() + (t0 + t) * 2 * nb + 2 * b;
      for (int h = 0; h < 2; ++h) {
        dot[t][h] = chain[t][h][0];
        if constexpr (kChains == 2) dot[t][h] = _mm512_add_epi32(dot[t][h], chain[t][h][kChains - 1]);
        if (p.offset) dot[t][h] = _mm512_sub_epi32(dot[t][h], _mm512_set1_epi32(offsets[h]));
      }
    }
    add_block<kGroup, kScales, NT>(p, tile_index, b, t0, d, dmin, constants, acc, [&](int t, int j) {
      return kGroup == 32 ? _mm512_add_epi32(dot[t][0], dot[t][1]) : dot[t][j];
    });
  }
  const int64_t n0 = tile_index * kRows;
  for (int t = 0; t < NT; ++t) {
    alignas(64) float y[kRows];
    _mm512_store_ps(y, acc[t]);
    store_rows(p, n0, t0 + t, y);
  }
}
#elif defined(__AVX2__)
// int32 lane r += dot of row r's 4 weights (w: unsigned, or signed for kSigned) with
// the 4 activation bytes broadcast in x. A tile's 16 rows are two halves of 8.
template <bool kSigned>
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
  if constexpr (kSigned) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

inline __m256 halves8(const void* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

// Group g's scales for rows half*8 .. half*8+7 of the tile; records: d is its
// super-block's (super8).
template <int kScales, int kGroup>
inline __m256 scales8(const ScaleTable& s, int64_t tile, int half, int64_t g, __m256 d) {
  if constexpr (kScales == kRecords) {
    const uint8_t* rec = s.record_for<kGroup>(tile, g);
    __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + record::sub_unit(kGroup, kGroup == 32 || s.mins, g) * kRows + half * 8));
    if (kGroup == 16 && s.mins) sub = _mm_and_si128(sub, _mm_set1_epi8(0x0F));  // record::nibbles
    const __m256i q = kGroup == 32 ? _mm256_cvtepu8_epi32(sub) : _mm256_cvtepi8_epi32(sub);
    return product(d, _mm256_cvtepi32_ps(q));
  } else {
    return halves8(static_cast<const at::Half*>(s.scales) + (tile * s.groups + g) * kRows + half * 8);
  }
}

// Records: the float16 item (0: d, 1: dmin) of super-block ``super``, for those rows.
template <int kScales>
inline __m256 super8(const ScaleTable& s, int64_t tile, int half, int64_t super, int item) {
  if constexpr (kScales == kRecords) return halves8(s.record_at(tile, super) + item * 2 * kRows + half * 16);
  else return _mm256_setzero_ps();
}

// constants16 and add_constant for those rows.
template <int kScales, int kGroup>
inline __m256 constants8(const ScaleTable& s, int64_t tile, int half, int64_t g, __m256 dmin) {
  if constexpr (kScales == kRecords) {
    const uint8_t* rec = s.record_for<kGroup>(tile, g);
    __m128i mins = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + record::min_unit(kGroup, g) * kRows + half * 8));
    if constexpr (record::nibbles(kGroup, true)) mins = _mm_and_si128(_mm_srli_epi16(mins, 4), _mm_set1_epi8(0x0F));
    return product(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)));
  } else {
    return halves8(static_cast<const at::Half*>(s.corr) + (tile * s.groups + g) * kRows + half * 8);
  }
}
template <int kScales>
inline __m256 add_constant(__m256 acc, __m256 c, __m256 sum) {
  return kScales == kRecords ? _mm256_fnmadd_ps(c, sum, acc) : _mm256_fmadd_ps(c, sum, acc);
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// with_high_bits for 8 rows, above nibbles or (2 and 3 bits) crumbs. A 16-bit shift
// keeps each byte's own bits where they are kept (at most 5 places for 3 bits).
template <int kBits>
inline __m256i with_high_bits(__m256i low, const __m256i* planes, int s) {
  constexpr int lb = values::low(kBits), hb = values::high(kBits);
  const int shift = lb - values::high_bit(kBits, s);
  __m256i v = planes[values::high_vector(kBits, s) - lb];
  if (shift > 0) v = _mm256_slli_epi16(v, shift);
  if (shift < 0) v = _mm256_srli_epi16(v, -shift);
  return _mm256_or_si256(low, _mm256_and_si256(v, _mm256_set1_epi8(((1 << hb) - 1) << lb)));
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// Without VNNI, vpmaddubsw's int16 pair sums (at most 2 * (2^bits - 1) * 127: each
// activation byte is within +-127) are added in int16 before one vpmaddwd widens
// them; this many fit (4 bits: 8, 5: 4, 6: 2), a half-block's 4 at most.
// int16 lanes a + b, for sums that cannot reach the limits (kInt16Sums), kept in
// program order by an empty asm on the sum: reassociated, GCC computed a block's 32
// products first and summed them after, spilling them. Not a saturating add (which
// kept the order before): on Zen 3 vpaddsw issues only to the two pipes vpmaddubsw
// needs (an independent pair of them ran 1.0 pairs a cycle, with vpaddw 1.2-1.35).
inline __m256i add16(__m256i a, __m256i b) {
  __m256i sum = _mm256_add_epi16(a, b);
  asm("" : "+x"(sum));
  return sum;
}

template <int kBits>
constexpr int kInt16Sums = 32767 / (2 * 127 * ((1 << kBits) - 1));

// Value vectors s = pair and 4 + pair (lo, hi) of 8 rows from a block's crumb vectors
// (2 and 3 bits: crumbs[0], crumbs[1]) and high-bit plane.
template <int kBits>
inline void crumb_pair(const __m256i* crumbs, const __m256i* planes, int pair, __m256i& lo, __m256i& hi) {
  const __m256i low2 = _mm256_set1_epi8(0x03);
  lo = _mm256_and_si256(_mm256_srli_epi16(crumbs[0], 2 * pair), low2);
  hi = _mm256_and_si256(_mm256_srli_epi16(crumbs[1], 2 * pair), low2);
  if constexpr (values::high(kBits) > 0) {
    lo = with_high_bits<kBits>(lo, planes, pair);
    hi = with_high_bits<kBits>(hi, planes, 4 + pair);
  }
}

// A tile's 2- or 3-bit values (nb blocks) rewritten as 4-bit values, Q4's nibble
// vectors (the layout at the top of this file), into ``out`` [nb * 256]: prompts
// multiply them on the 4-bit path (tile_chunk).
template <int kBits>
void unpack_nibbles(const uint8_t* tile, int64_t nb, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* v = tile + b * kBits * 64;
    for (int h = 0; h < 2; ++h) {  // 8 rows (32 bytes) at a time
      __m256i crumbs[2], planes[1];
      for (int i = 0; i < 2; ++i) crumbs[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i * 64 + h * 32));
      if constexpr (values::high(kBits) > 0)
        planes[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 2 * 64 + h * 32));
      for (int pair = 0; pair < 4; ++pair) {
        __m256i lo, hi;
        crumb_pair<kBits>(crumbs, planes, pair, lo, hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b * 4 + pair) * 64 + h * 32),
                            _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
      }
    }
  }
}
#define TANDEM_UNPACKS_COMPACT 1

// kHalves (1 or 2) halves of a tile's rows from ``first``, NT tokens from t0, in one
// pass: the halves share each activation broadcast; one half at a time keeps the
// accumulators in registers (tile() below chooses).
// kFetch: whether the pass may ask for the stream ahead (below).
// kTable: 4-bit values index p.s.table's 16 levels (int8), looked up by a byte
// shuffle and multiplied as int8 values are.
template <int kBits, int kGroup, int kScales, int NT, int kHalves, bool kFetch, bool kTable>
void tile_rows(const Problem& p, int64_t tile_index, int first, int64_t t0) {
  constexpr int64_t kHalfRows = kRows / 2;
  const int64_t nb = p.K / kBlock;
  const uint8_t* vals = p.values + tile_index * p.tile_bytes + first * 32;
  const Activations& a = *p.act;
  __m256 acc[NT][kHalves];
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < kHalves; ++h) acc[t][h] = _mm256_setzero_ps();
  __m256 d[kHalves];  // records: the super-block's d (8 blocks of 32)
  for (int h = 0; h < kHalves; ++h) d[h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (kScales == kRecords && b % 8 == 0)
      for (int h = 0; h < kHalves; ++h) d[h] = super8<kScales>(p.s, tile_index, first + h, b / 8, 0);
    // dot[t][h][j]: per row, the int32 dot over the block's first (j = 0) or second 16
    // values (for groups of 32 without VNNI, all 32 may be in j = 0 and j = 1 zero).
    __m256i dot[NT][kHalves][2];
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < kHalves; ++h) dot[t][h][0] = dot[t][h][1] = _mm256_setzero_si256();
    const uint8_t* v = vals + b * kBits * 64;
    if (kFetch && first == 0 && t0 % kTokenChunk == 0) prefetch_block<kBits>(v);
    if constexpr (kBits < 8) {
      constexpr int kSums = kInt16Sums<kBits> < 4 ? kInt16Sums<kBits> : 4;
      constexpr bool kJoin = !kVnni && kGroup == 32 && kInt16Sums<kBits> >= 8;  // j = 0 takes all
      const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
      __m256i levels = _mm256_setzero_si256();
      if constexpr (kTable)
        levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(p.s.table)));
      constexpr int kLow = values::low(kBits);
      __m256i planes[kHalves][2], crumbs[kHalves][2];  // crumbs: 2 and 3 bits' low vectors
      for (int h = 0; h < kHalves; ++h) {
        for (int i = 0; i < values::high(kBits); ++i)
          planes[h][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (kLow + i) * 64 + h * 32));
        if constexpr (kBits < 4)
          for (int i = 0; i < 2; ++i)
            crumbs[h][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i * 64 + h * 32));
      }
      __m256i sum16[NT][kHalves][2];  // int16 sums not yet widened (no VNNI)
      // Unrolled, so that which sums start, add and widen is known at compile time.
#pragma GCC unroll 4
      for (int pair = 0; pair < 4; ++pair) {
        __m256i lo[kHalves], hi[kHalves];
        for (int h = 0; h < kHalves; ++h) {
          if constexpr (kBits < 4) {
            crumb_pair<kBits>(crumbs[h], planes[h], pair, lo[h], hi[h]);
          } else {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + pair * 64 + h * 32));
            lo[h] = _mm256_and_si256(packed, low4);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
          }
          if constexpr (kBits > 4) {
            lo[h] = with_high_bits<kBits>(lo[h], planes[h], pair);
            hi[h] = with_high_bits<kBits>(hi[h], planes[h], 4 + pair);
          }
          if constexpr (kTable) {
            lo[h] = _mm256_shuffle_epi8(levels, lo[h]);
            hi[h] = _mm256_shuffle_epi8(levels, hi[h]);
          }
        }
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = a.q.data() + (t0 + t) * p.K + b * kBlock;
          const __m256i xlo = broadcast4(x + 4 * pair), xhi = broadcast4(x + 16 + 4 * pair);
          for (int h = 0; h < kHalves; ++h) {
            if constexpr (kTable) {  // int8 levels: no int16 sums to keep (one pair fills them)
              dot[t][h][0] = dot4<true>(dot[t][h][0], lo[h], xlo);
              dot[t][h][1] = dot4<true>(dot[t][h][1], hi[h], xhi);
            } else if constexpr (kVnni) {
              dot[t][h][0] = dot4<false>(dot[t][h][0], lo[h], xlo);
              dot[t][h][1] = dot4<false>(dot[t][h][1], hi[h], xhi);
            } else {
              const __m256i plo = _mm256_maddubs_epi16(lo[h], xlo), phi = _mm256_maddubs_epi16(hi[h], xhi);
              if constexpr (kJoin) {
                const __m256i both = add16(plo, phi);
                sum16[t][h][0] = pair == 0 ? both : add16(sum16[t][h][0], both);
              } else {
                const bool first_sum = pair % kSums == 0;
                sum16[t][h][0] = first_sum ? plo : add16(sum16[t][h][0], plo);
                sum16[t][h][1] = first_sum ? phi : add16(sum16[t][h][1], phi);
                if (pair % kSums == kSums - 1)
                  for (int j = 0; j < 2; ++j)
                    dot[t][h][j] = _mm256_add_epi32(dot[t][h][j], _mm256_madd_epi16(sum16[t][h][j], ones));
              }
            }
          }
        }
      }
      if constexpr (kJoin && !kTable)
        for (int t = 0; t < NT; ++t)
          for (int h = 0; h < kHalves; ++h) dot[t][h][0] = _mm256_madd_epi16(sum16[t][h][0], ones);
    } else {
#pragma GCC unroll 8
      for (int step = 0; step < 8; ++step) {
        __m256i w[kHalves];
        for (int h = 0; h < kHalves; ++h)
          w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + step * 64 + h * 32));
        for (int t = 0; t < NT; ++t) {
          const __m256i x = broadcast4(a.q.data() + (t0 + t) * p.K + b * kBlock + 4 * step);
          for (int h = 0; h < kHalves; ++h) dot[t][h][step / 4] = dot4<true>(dot[t][h][step / 4], w[h], x);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const int32_t* offsets = a.offsets.data() + (t0 + t) * 2 * nb + 2 * b;
      const __m256 dx = _mm256_set1_ps(a.d[(t0 + t) * nb + b]);
      for (int h = 0; h < kHalves; ++h) {
        if constexpr (kGroup == 32) {
          __m256i sum = _mm256_add_epi32(dot[t][h][0], dot[t][h][1]);
          if (p.offset) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(offsets[0] + offsets[1]));
          const __m256 s = product(scales8<kScales, 32>(p.s, tile_index, first + h, b, d[h]), dx);
          acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[t][h]);
        } else {
          for (int j = 0; j < 2; ++j) {
            __m256i sum = dot[t][h][j];
            if (p.offset) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(offsets[j]));
            const __m256 s = product(scales8<kScales, 16>(p.s, tile_index, first + h, 2 * b + j, d[h]), dx);
            acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[t][h]);
          }
        }
      }
    }
  }
  // The constant terms after the blocks: folded into the block loop as the AVX-512
  // path does, the 16 registers spilled at four tokens (0.74-0.86x). A group's sum of
  // activations is its block's (s32), or for groups of 16 its half-block's (s16).
  if (p.s.has_constants()) {
    constexpr int64_t kPerSuper = 256 / kGroup;
    const std::vector<float>& sums = kGroup == 32 ? a.s32 : a.s16;
    for (int h = 0; h < kHalves; ++h) {
      __m256 dmin = _mm256_setzero_ps();
      for (int64_t g = 0; g < p.s.groups; ++g) {
        if (kScales == kRecords && g % kPerSuper == 0)
          dmin = super8<kScales>(p.s, tile_index, first + h, g / kPerSuper, 1);
        const __m256 c = constants8<kScales, kGroup>(p.s, tile_index, first + h, g, dmin);
        for (int t = 0; t < NT; ++t)
          acc[t][h] = add_constant<kScales>(acc[t][h], c, _mm256_set1_ps(sums[(t0 + t) * p.s.groups + g]));
      }
    }
  }
  for (int h = 0; h < kHalves; ++h) {
    const int64_t n0 = tile_index * kRows + (first + h) * kHalfRows;
    for (int t = 0; t < NT; ++t) {
      alignas(32) float y[kHalfRows];
      _mm256_store_ps(y, acc[t][h]);
      store_rows(p, n0, t0 + t, y, kHalfRows);
    }
  }
}

// Both halves in one pass for one or two tokens (batch 1 is bound by the activation
// broadcasts), and for 4-bit values without VNNI at any count: there a broadcast is an
// op on the same four pipes as the dot's, so sharing it between the halves takes a
// sixth of the tile loop's ops, which is worth the accumulators spilled to the stack
// (Q4_0 / Q4_K 1.14-1.20x at 4-64 tokens on a Zen 3; 5 and 6 bits, whose high-bit
// planes take four more registers, measured 0.93-1.04x, Q8_0 0.99-1.13x). A tile's
// second half may be wholly padding (N a multiple of 8, not of 16).
template <int kBits, int kGroup, int kScales, int NT, bool kFetch, bool kTable>
void tile_halves(const Problem& p, int64_t tile_index, int64_t t0) {
  const bool second = tile_index * kRows + kRows / 2 < p.N;
  if ((NT <= 2 || (!kVnni && kBits == 4)) && second) {
    tile_rows<kBits, kGroup, kScales, NT, 2, kFetch, kTable>(p, tile_index, 0, t0);
  } else {
    tile_rows<kBits, kGroup, kScales, NT, 1, kFetch, kTable>(p, tile_index, 0, t0);
    if (second) tile_rows<kBits, kGroup, kScales, NT, 1, kFetch, kTable>(p, tile_index, 1, t0);
  }
}

// Passes of three or more tokens without VNNI are bound by the dot, not by memory, and
// there the prefetch's test in the block loop cost 8-12% of a 64-token pass (Zen 3):
// the passes that never ask (all but a chunk's first) run a loop without the test.
template <int kBits, int kGroup, int kScales, int NT, bool kTable = false>
void tile(const Problem& p, int64_t tile_index, int64_t t0) {
  if constexpr (NT >= 3 && !kVnni) {
    if (t0 % kTokenChunk != 0) return tile_halves<kBits, kGroup, kScales, NT, false, kTable>(p, tile_index, t0);
  }
  tile_halves<kBits, kGroup, kScales, NT, true, kTable>(p, tile_index, t0);
}
#else
// Portable: the same layout, one weight at a time.
template <int kBits, int kGroup, int kScales, int NT, bool kTable = false>
void tile(const Problem& p, int64_t tile_index, int64_t t0) {
  const int64_t nb = p.K / kBlock;
  const uint8_t* vals = p.values + tile_index * p.tile_bytes;
  const Activations& a = *p.act;
  for (int t = 0; t < NT; ++t) {
    const int64_t tok = t0 + t;
    float y[kRows];
    for (int r = 0; r < kRows; ++r) {
      float sum = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot[2] = {0, 0};
        for (int k = 0; k < kBlock; ++k) {
          const int32_t q = value_at(vals, kBits, b, r, k);
          dot[k / 16] += (kTable ? p.s.table[q] : q) * a.q[tok * p.K + b * kBlock + k];
        }
        for (int h = 0; h < 2; ++h) dot[h] -= a.offsets[tok * 2 * nb + 2 * b + h];
        const float dx = a.d[tok * nb + b];
        if constexpr (kGroup == 32) {
          sum += scale_at(p.s, tile_index, r, b) * dx * (dot[0] + dot[1]);
        } else {
          sum += scale_at(p.s, tile_index, r, 2 * b) * dx * dot[0] +
                 scale_at(p.s, tile_index, r, 2 * b + 1) * dx * dot[1];
        }
      }
      if (p.s.has_constants()) {
        const std::vector<float>& sums = kGroup == 32 ? a.s32 : a.s16;
        for (int64_t g = 0; g < p.s.groups; ++g)
          sum += constant_at(p.s, tile_index, r, g) * sums[tok * p.s.groups + g];
      }
      y[r] = sum;
    }
    store_rows(p, tile_index * kRows, tok, y);
  }
}
#endif

// Intel's tile registers (AMX-INT8), for passes of many tokens (min_tokens) on the CPUs
// that have them (Sapphire Rapids and later). The same integer dots and the same float
// epilogue as the AVX-512 path above, so a token's result is the same bits on either
// path: one tile multiply takes 16 tokens by a tile's 16 rows over a block (a group
// of 16 for Q6_K), its int32 sums go through memory, and each token's block is then
// scaled and added exactly as tile() adds it. Where the AVX-512 path spends 8
// vpdpbusd and 8 broadcasts a token and block, the tile unit takes the whole 16 x 16
// x 32 product in one instruction; what is left is the epilogue, one scale per
// (token, row, block), which both paths share.
// The B tile for a block is its 8 vectors (4 weights of each of 16 rows, in k order):
// int8 values (Q8_0) are read straight from the packed matrix; 4-6 bit values are
// unpacked first, a tile's whole row length at once, into a thread's buffer, with the
// offset taken off each (q - offset fits int8), so that the tile's sums are the
// vector path's after its subtraction of offset * sum(xq): the same integers, and no
// subtraction left for the epilogue. Signed by signed bytes either way.
// The kernel grants the tile state only on request (arch_prctl): some VMs list AMX and
// fault on its first instruction without it. TANDEM_AMX=0 declines it.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TANDEM_AMX 1
namespace amx {

constexpr int64_t kTokens = 16;  // an A tile's rows
// The fewest tokens a chunk takes the tiles for: unpacking a tile's 4-6 bit values
// costs what a few groups of 16 save (on a 4096 x 14336 matrix, Q4_0 and Q4_K at 32
// tokens measured 0.94-1.04x the vector path, at 48 1.06-1.23x, at 128 1.16-1.37x);
// int8 values need no unpacking (Q8_0 3.8x at 16).
template <int kBits>
constexpr int64_t min_tokens() { return kBits == 8 ? 16 : 48; }
constexpr int64_t kBlockBytes = 8 * 64;  // a block's B tile rows (the values' layout)

// -1: not yet decided; 0 off; 1 on.
inline std::atomic<int>& mode() {
  static std::atomic<int> m{-1};
  return m;
}

// Whether the kernel gives this process the tile state (asked once).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

inline bool active() {
  int m = mode().load(std::memory_order_relaxed);
  if (m < 0) {
    const char* env = std::getenv("TANDEM_AMX");
    m = (env == nullptr || std::strcmp(env, "0") != 0) && permitted() ? 1 : 0;
    mode().store(m);
  }
  return m == 1;
}

// Whether a pass of T tokens (the most an expert of the pass has) takes the tiles:
// enough of them, values the tiles multiply as they are or unpacked (int8 values only
// without an offset: Q8_0's is 0), and the tiles on.
template <int kBits>
inline bool takes(int64_t T, int32_t offset) {
  return T >= min_tokens<kBits>() && (kBits < 8 || offset == 0) && active();
}

struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: int32 sums [16 tokens, 16 rows]; 4, 5: activations [16 tokens, k_bytes];
// 6, 7: values [k_bytes / 4, 16 rows x 4]. Loaded on each thread at the start of a
// call: another library may have used the tiles in between.
inline void configure(int k_bytes) {
  Config c{};
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = i >= 6 ? k_bytes / 4 : 16;
    c.colsb[i] = i >= 4 && i < 6 ? k_bytes : 64;
  }
  // Not _tile_loadconfig: GCC 12 did not count its read of the whole struct and
  // dropped the stores of rows and colsb (ldtilecfg then faulted on the garbage). The
  // "m" operand says the instruction reads all 64 bytes.
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// A tile's 4-6 bit values as B tiles: block b's 8 rows of 64 bytes at dst + b * 512,
// row j holding weights 4j..4j+3 of each row, as int8 q - offset.
template <int kBits>
void unpack(const uint8_t* vals, int64_t nb, int32_t offset, int8_t* dst) {
  const __m512i off = _mm512_set1_epi8(static_cast<char>(offset));
  for (int64_t b = 0; b < nb; ++b) {
    const BlockValues<kBits> block(vals + b * kBits * 64);
    int8_t* out = dst + b * kBlockBytes;
    for (int pair = 0; pair < 4; ++pair) {
      __m512i lo, hi;
      block.pair(pair, lo, hi);
      _mm512_storeu_si512(out + pair * 64, _mm512_sub_epi8(lo, off));
      _mm512_storeu_si512(out + (4 + pair) * 64, _mm512_sub_epi8(hi, off));
    }
  }
}

// Block b's tile multiplies into sum tile set kSet (groups of 32: tile kSet from
// activations in tile 4 + kSet and values in 6 + kSet; groups of 16: tiles 2 kSet and
// 2 kSet + 1 from 4, 5 and 6, 7). GCC's tile intrinsics paste their register numbers
// into the instruction's text, so each is named here as a literal. Those intrinsics
// are asm statements that do not say they touch memory: ``fence`` (no instruction)
// keeps the compiler's stores before a tile load and its loads after a tile store.
#define TANDEM_TILE_BLOCK32(C, X, W)                 \
  do {                                               \
    _tile_zero(C);                                   \
    _tile_loadd(X, A + b * kBlock, K);               \
    _tile_loadd(W, B + b * kBlockBytes, 64);         \
    _tile_dpbssd(C, X, W);                           \
  } while (0)
#define TANDEM_TILE_BLOCK16(C0, C1)                        \
  do {                                                     \
    _tile_zero(C0);                                        \
    _tile_zero(C1);                                        \
    _tile_loadd(4, A + b * kBlock, K);                     \
    _tile_loadd(5, A + b * kBlock + 16, K);                \
    _tile_loadd(6, B + b * kBlockBytes, 64);               \
    _tile_loadd(7, B + b * kBlockBytes + 256, 64);         \
    _tile_dpbssd(C0, 4, 6);                                \
    _tile_dpbssd(C1, 5, 7);                                \
  } while (0)
inline void fence() { asm volatile("" ::: "memory"); }

template <int kGroup, int kSet>
inline void multiply(const int8_t* A, int64_t K, const int8_t* B, int64_t b) {
  if constexpr (kGroup == 32 && kSet == 0) TANDEM_TILE_BLOCK32(0, 4, 6);
  if constexpr (kGroup == 32 && kSet == 1) TANDEM_TILE_BLOCK32(1, 5, 7);
  if constexpr (kGroup == 16 && kSet == 0) TANDEM_TILE_BLOCK16(0, 1);
  if constexpr (kGroup == 16 && kSet == 1) TANDEM_TILE_BLOCK16(2, 3);
}
#undef TANDEM_TILE_BLOCK32
#undef TANDEM_TILE_BLOCK16

template <int kGroup, int kSet>
inline void store_sums(int32_t (*sums)[kTokens * kRows]) {
  if constexpr (kGroup == 32 && kSet == 0) _tile_stored(0, sums[0], 64);
  if constexpr (kGroup == 32 && kSet == 1) _tile_stored(1, sums[0], 64);
  if constexpr (kGroup == 16 && kSet == 0) {
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
  }
  if constexpr (kGroup == 16 && kSet == 1) {
    _tile_stored(2, sums[0], 64);
    _tile_stored(3, sums[1], 64);
  }
  fence();
}

// 16 tokens from t0 by one tile (16 rows) whose B tiles are at B: tile()'s result.
template <int kGroup, int kScales>
void tile16(const Problem& p, int64_t tile_index, const int8_t* B, int64_t t0) {
  const int64_t nb = p.K / kBlock;
  const int8_t* A = p.act->q.data() + t0 * p.K;
  __m512 acc[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  const bool constants = p.s.has_constants();
  alignas(64) int32_t sums[2][kTokens * kRows];  // [half][token][row]
  // Block b's sums, then its epilogue; the next block's multiply is issued before it
  // (into the other set of sum tiles) so that the tile unit works while the vector
  // units scale.
  auto finish = [&](int64_t b) {
    next_super<kScales>(p, tile_index, b, constants, d, dmin);
    add_block<kGroup, kScales, kTokens>(p, tile_index, b, t0, d, dmin, constants, acc, [&](int t, int j) {
      return _mm512_load_si512(sums[j] + t * kRows);
    });
  };
  multiply<kGroup, 0>(A, p.K, B, 0);
  for (int64_t b = 0; b < nb; b += 2) {
    if (b + 1 < nb) multiply<kGroup, 1>(A, p.K, B, b + 1);
    store_sums<kGroup, 0>(sums);
    finish(b);
    if (b + 1 < nb) {
      if (b + 2 < nb) multiply<kGroup, 0>(A, p.K, B, b + 2);
      store_sums<kGroup, 1>(sums);
      finish(b + 1);
    }
  }
  const int64_t n0 = tile_index * kRows;
  for (int t = 0; t < kTokens; ++t) {
    alignas(64) float y[kRows];
    _mm512_store_ps(y, acc[t]);
    store_rows(p, n0, t0 + t, y);
  }
}

// The tile registers configured for groups of ``group`` on this thread while it lives.
// Configured at the start of each call: another library may have used the tiles in
// between.
struct Tiles {
  explicit Tiles(int64_t group) { configure(group == 32 ? 32 : 16); }
  ~Tiles() { _tile_release(); }
};

}  // namespace amx
#endif

// Tile ``index`` of p for tokens [c0, c1), tokens_per_pass at a time.
template <int kBits, int kGroup, int kScales, bool kTable = false>
inline void tile_tokens(const Problem& p, int64_t index, int64_t c0, int64_t c1) {
  constexpr int64_t kTokens = tokens_per_pass<kBits>();
  int64_t t = c0;
  for (; t + kTokens <= c1; t += kTokens) tile<kBits, kGroup, kScales, kTokens, kTable>(p, index, t);
  if constexpr (kTokens > 4) {  // (at most once: fewer than kTokens are left)
    if (t + 4 <= c1) {
      tile<kBits, kGroup, kScales, 4, kTable>(p, index, t);
      t += 4;
    }
  }
  switch (c1 - t) {
    case 3: tile<kBits, kGroup, kScales, 3, kTable>(p, index, t); break;
    case 2: tile<kBits, kGroup, kScales, 2, kTable>(p, index, t); break;
    case 1: tile<kBits, kGroup, kScales, 1, kTable>(p, index, t); break;
    default: break;
  }
}

// Tile ``index`` of p for the chunk of tokens [c0, c1). Compact 2- and 3-bit values,
// for a chunk of at least kUnpackTokens on AVX2, are unpacked once into 4-bit values
// (the thread's buffer) and multiplied on the 4-bit path, whose vpmaddubsw pairs add
// in int16 and share each activation broadcast between the halves: 1.05-1.1x the
// compact loop at 128-512 tokens (4096 x 14336, Zen 3; below 16 tokens the unpacking
// costs what it saves). The same integer dots, so the same bits.
constexpr int64_t kUnpackTokens = 16;
template <int kBits, int kGroup, int kScales, bool kTable = false>
inline void tile_chunk(const Problem& p, int64_t index, int64_t c0, int64_t c1) {
  if constexpr (kBits == 8 && kGroup == 16 && kScales == kRecords) {
    if (p.s.codebook) {  // its blocks decoded into the thread's buffers, then int8 values
      static thread_local std::vector<int8_t> values;
      static thread_local std::vector<uint8_t> records;
      const int64_t supers = p.K / 256;
      values.resize(p.K * kRows);
      records.resize(supers * p.s.record);
      expand_codebook(p.s, p.values + index * p.tile_bytes, supers, values.data(), records.data());
      Problem expanded = p;
      expanded.values = reinterpret_cast<const uint8_t*>(values.data());
      expanded.tile_bytes = 0;  // tile ``index``'s values and records are the buffers
      expanded.s.scales = records.data();
      expanded.s.tile_stride = 0;
      expanded.s.codebook = 0;
      return tile_tokens<8, 16, kRecords>(expanded, index, c0, c1);
    }
  }
#ifdef TANDEM_UNPACKS_COMPACT
  if constexpr (kBits < 4) {
    if (c1 - c0 >= kUnpackTokens) {
      static thread_local std::vector<uint8_t> nibbles;
      const int64_t nb = p.K / kBlock;
      nibbles.resize(nb * 4 * 64);
      unpack_nibbles<kBits>(p.values + index * p.tile_bytes, nb, nibbles.data());
      Problem unpacked = p;
      unpacked.values = nibbles.data();
      unpacked.tile_bytes = 0;  // tile ``index``'s values are the buffer
      return tile_tokens<4, kGroup, kScales>(unpacked, index, c0, c1);
    }
  }
#endif
  tile_tokens<kBits, kGroup, kScales, kTable>(p, index, c0, c1);
}

#ifdef TANDEM_AMX
// Tiles [begin, end) of p for all T tokens, in chunks of kTokenChunk: a chunk of at
// least min_tokens takes the tile registers 16 tokens at a time (its values unpacked
// once into the thread's buffer), its last few tokens and smaller chunks the vector
// path. The caller holds an amx::Tiles.
template <int kBits, int kGroup, int kScales>
void amx_tokens(const Problem& p, int64_t begin, int64_t end, int64_t T) {
  static thread_local std::vector<int8_t> buffer;
  const int64_t nb = p.K / kBlock;
  for (int64_t c0 = 0; c0 < T; c0 += kTokenChunk) {
    const int64_t c1 = std::min(T, c0 + kTokenChunk);
    for (int64_t index = begin; index < end; ++index) {
      int64_t t = c0;
      if (c1 - c0 >= amx::min_tokens<kBits>()) {
        const uint8_t* vals = p.values + index * p.tile_bytes;
        const int8_t* B = reinterpret_cast<const int8_t*>(vals);  // Q8_0: as packed (offset 0)
        if constexpr (kBits < 8) {
          buffer.resize(nb * amx::kBlockBytes);
          amx::unpack<kBits>(vals, nb, p.offset, buffer.data());
          amx::fence();
          B = buffer.data();
        }
        for (; t + amx::kTokens <= c1; t += amx::kTokens) amx::tile16<kGroup, kScales>(p, index, B, t);
      }
      if (t < c1) tile_tokens<kBits, kGroup, kScales>(p, index, t, c1);
    }
  }
}
#endif

template <int kBits, int kGroup, int kScales, bool kTable = false>
void run(const Problem& p, int64_t T) {
  const int64_t tiles = (p.N + kRows - 1) / kRows;
#ifdef TANDEM_AMX
  if (!kTable && !p.s.codebook && amx::takes<kBits>(T, p.offset)) {
    work::share(tiles, kMinRun, [&](work::SharedRuns& runs) {
      const amx::Tiles registers(kGroup);
      for (int64_t begin, end; runs.next(begin, end);) amx_tokens<kBits, kGroup, kScales>(p, begin, end, T);
    });
    return;
  }
#endif
  work::share(tiles, kMinRun, [&](work::SharedRuns& runs) {
    for (int64_t begin, end; runs.next(begin, end);) {
      for (int64_t c0 = 0; c0 < T; c0 += kTokenChunk) {
        const int64_t c1 = std::min(T, c0 + kTokenChunk);
        for (int64_t index = begin; index < end; ++index) tile_chunk<kBits, kGroup, kScales, kTable>(p, index, c0, c1);
      }
    }
  });
}

// Several problems of one layout (a mixture's experts) in one parallel loop over all
// their tiles: threads go from one expert's tiles to the next without meeting.
template <int kBits, int kGroup, int kScales, bool kTable = false>
void run_many(const std::vector<Problem>& ps, const std::vector<int64_t>& Ts, int64_t tiles) {
  const int64_t jobs = static_cast<int64_t>(ps.size()) * tiles;
#ifdef TANDEM_AMX
  int64_t most = 0;
  for (const int64_t T : Ts) most = std::max(most, T);
  if (!kTable && !ps[0].s.codebook && amx::takes<kBits>(most, ps[0].offset)) {
    work::share(jobs, kMinRun, [&](work::SharedRuns& runs) {
      const amx::Tiles registers(kGroup);
      for (int64_t begin, end; runs.next(begin, end);)
        for (int64_t job = begin; job < end; ++job)
          amx_tokens<kBits, kGroup, kScales>(ps[job / tiles], job % tiles, job % tiles + 1, Ts[job / tiles]);
    });
    return;
  }
#endif
  work::share(jobs, kMinRun, [&](work::SharedRuns& runs) {
    for (int64_t begin, end; runs.next(begin, end);) {
      for (int64_t job = begin; job < end; ++job) {
        const Problem& p = ps[job / tiles];
        const int64_t T = Ts[job / tiles], index = job % tiles;
        for (int64_t c0 = 0; c0 < T; c0 += kTokenChunk)
          tile_chunk<kBits, kGroup, kScales, kTable>(p, index, c0, std::min(T, c0 + kTokenChunk));
      }
    }
  });
}

// A packed matrix's scales and constants, checked: float16 scales [tiles, K/group, 16]
// (corr float16 like them, or empty), or uint8 records [tiles, K/256 * R] (no corr;
// for groups of 16, R says whether they hold minimums: 320 bytes, Q2_K's, or 288), or
// none (a codebook type's blocks hold them); ``factor`` a power of two in 2**-8 .. 1,
// ``table`` 0, a row of kTables plus one, or a codebook type's GGML code (ScaleTable's).
ScaleTable scale_table(const torch::Tensor& scales, const c10::optional<torch::Tensor>& corr,
                       int64_t tiles, int64_t K, int64_t group, double factor, int64_t table) {
  TORCH_CHECK(group == 32 || group == 16, "group must be 32 or 16");
  TORCH_CHECK(scales.is_contiguous(), "scales: contiguous");
  int exponent = 0;
  TORCH_CHECK(factor >= 1.0 / 256 && factor <= 1 && std::frexp(factor, &exponent) == 0.5,
              "factor: a power of two in 2**-8 .. 1");
  const bool codebook = codebook::shape(table).entries > 0;
  TORCH_CHECK((table >= 0 && table <= 2) || codebook,
              "table: 0 (none), 1 (IQ4_NL's levels), 2 (MXFP4's values) or a codebook type's GGML code");
  ScaleTable s{scales.data_ptr(), nullptr, K / group, K / 256, 0, 0, static_cast<int>(group), false,
               static_cast<float>(factor), table == 1 || table == 2 ? kTables[table - 1] : nullptr, 0, nullptr};
  if (codebook) {
    TORCH_CHECK(group == 16 && K % 256 == 0 && scales.numel() == 0 && !(corr.has_value() && corr->numel() > 0),
                "a codebook type's blocks: groups of 16, whole super-blocks, no scales");
    s.grid = codebook::grid_of(table);
    TORCH_CHECK(s.grid != nullptr, "GGML type ", table, ": no grid given (set_codebook_grid)");
    s.codebook = table;
    s.record = record::bytes(16, false);  // what its tiles decode to
    return s;
  }
  if (scales.scalar_type() == torch::kByte) {
    const int64_t per = tiles * s.supers > 0 ? scales.numel() / (tiles * s.supers) : 0;
    TORCH_CHECK(K % 256 == 0 && record::kind(per, group, s.mins) && scales.numel() == tiles * s.supers * per,
                "scales: records [tiles, K / 256 * R] of groups of ", group);
    s.record = per;
    s.tile_stride = s.supers * per;
    TORCH_CHECK(!(corr.has_value() && corr->numel() > 0), "records hold their constants");
    return s;
  }
  TORCH_CHECK(scales.scalar_type() == torch::kHalf, "scales: float16 or uint8 records");
  TORCH_CHECK(scales.numel() == tiles * s.groups * kRows, "scales: [tiles, K / group, 16]");
  if (corr.has_value() && corr->numel() > 0) {
    TORCH_CHECK(corr->is_contiguous() && corr->numel() == scales.numel() &&
                corr->scalar_type() == torch::kHalf, "corr: like scales");
    s.corr = corr->data_ptr();
  }
  return s;
}

// Bits a weight's value takes in ``values`` (laid out at the top of this file) for K
// columns: 2 to 6 (uint8) or 8 (int8), checked against its bytes per tile; a codebook
// type's blocks (``s``) are 8, the int8 values they decode to.
int value_bits(const torch::Tensor& values, int64_t K, const ScaleTable& s) {
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features must be a positive multiple of 32");
  TORCH_CHECK(values.is_contiguous() && values.dim() == 2, "values: [tiles, bytes per tile]");
  if (s.codebook) {
    TORCH_CHECK(values.scalar_type() == torch::kByte &&
                    values.size(1) == K / 256 * kRows * codebook::shape(s.codebook).bytes,
                "a codebook type's values: uint8, its blocks, K / 256 * 16 a tile");
    return 8;
  }
  if (values.scalar_type() == torch::kChar) {
    TORCH_CHECK(values.size(1) == K * kRows, "int8 values: K * 16 bytes per tile");
    return 8;
  }
  TORCH_CHECK(values.scalar_type() == torch::kByte, "values: uint8 (2 to 6 bits) or int8");
  const int64_t bits = values.size(1) / (2 * K);
  TORCH_CHECK(bits >= 2 && bits <= 6 && values.size(1) == 2 * K * bits,
              "uint8 values: K * 2 * bits bytes per tile, 2 to 6 bits");
  return static_cast<int>(bits);
}

// The layouts the formats pack to (tandem/quant/packed.py's _LAYOUT), no others.
void check_format(int bits, int64_t group, bool records, bool table) {
  // Groups of 16, all with records: Q6_K's 6-bit values, Q3_K's (3 bits, or a nibble),
  // Q2_K's and the ternary types' (2 bits, or a nibble), IQ4_XS's int8 levels (or
  // table indices).
  const bool sixteen = bits != 5 && records;
  TORCH_CHECK((group == 16) ? sixteen : (bits == 4 || bits == 5 || (bits == 8 && !records)),
              "no format packs ", bits, "-bit values in groups of ", group,
              records ? " with records" : " with float16 scales");
  // Table indices: 4 bits, IQ4_NL's and MXFP4's float16 scales, IQ4_XS's records.
  TORCH_CHECK(!table || (bits == 4 && records == (group == 16)), "table values: 4 bits");
  TORCH_CHECK((!table && bits >= 4) || kCompactLayouts,
              "this build reads no table or 2- and 3-bit values (kCompactLayouts)");
}

// The values' offset: a whole number the kernel takes off in integers.
int32_t integer_offset(double offset) {
  TORCH_CHECK(offset >= 0 && offset <= 64 && offset == std::floor(offset),
              "offset: a whole number in 0..64");
  return static_cast<int32_t>(offset);
}

}  // namespace quant

// Whether this build's kernels read the compact layouts (quant::kCompactLayouts):
// tandem/quant/packed.py then packs IQ4_NL, IQ4_XS and MXFP4 at their 4 bits, Q2_K and
// the ternary types at 2, Q3_K at 3.
bool compact_layouts() { return quant::kCompactLayouts; }

// Whether passes of 16 tokens and more go through the tile registers: -1 asks, 0 or 1
// sets (1 only where the build has them and the kernel grants them); returns the
// state after. Tests and benchmarks compare the two paths in one process.
bool amx_mode(int64_t want) {
#ifdef TANDEM_AMX
  if (want >= 0) quant::amx::mode().store(want > 0 && quant::amx::permitted() ? 1 : 0);
  return quant::amx::active();
#else
  (void)want;
  return false;
#endif
}

// out [T, N] float32 (rows may be strided) = x [T, K] float32 @ W^T (+ bias), W packed
// as described at the top of this file; N is the true row count (the last tile may
// be padding); ``offset`` is the values' (Q4_0: 8, Q5_0: 16, Q6_K: 32), ``factor``
// the power of two beyond the scales (ScaleTable's; 1 but for the codebook i-quants),
// ``table`` the levels 4-bit values index (1: IQ4_NL's, 2: MXFP4's; 0: none).
void quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor values, torch::Tensor scales,
                  c10::optional<torch::Tensor> corr, c10::optional<torch::Tensor> bias,
                  int64_t N, int64_t group, double offset, double factor, int64_t table) {
  using quant::kRows;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat, "x: float32 rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == torch::kFloat, "out: float32 rows");
  const int64_t T = x.size(0), K = x.size(1), tiles = values.size(0);
  quant::Problem p;
  p.s = quant::scale_table(scales, corr, tiles, K, group, factor, table);
  const int bits = quant::value_bits(values, K, p.s);
  TORCH_CHECK(tiles * kRows >= N && (tiles - 1) * kRows < N, "values: ceil(N / 16) tiles");
  TORCH_CHECK(out.size(0) == T && out.size(1) == N, "out: [T, N]");
  p.offset = quant::integer_offset(offset);
  // Reused across calls (a decode step makes ~100 of them): no allocation per call.
  static thread_local quant::Activations act;
  quant::quantize_activations(x.data_ptr<float>(), x.stride(0), T, K, p.offset, act);
  p.values = static_cast<const uint8_t*>(values.data_ptr());
  p.tile_bytes = values.size(1);
  p.bias = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == torch::kFloat);
    p.bias = bias->data_ptr<float>();
  }
  p.N = N;
  p.K = K;
  p.act = &act;
  p.out = out.data_ptr<float>();
  p.out_stride = out.stride(0);
  using quant::kHalfScales;
  using quant::kRecords;
  const bool records = p.s.record != 0;
  quant::check_format(bits, group, records, p.s.table != nullptr);
  switch (bits) {
    case 2:
    case 3:
      if constexpr (quant::kCompactLayouts) bits == 2 ? quant::run<2, 16, kRecords>(p, T) : quant::run<3, 16, kRecords>(p, T);
      break;
    case 4:
      if constexpr (quant::kCompactLayouts) {
        if (table) {
          group == 16 ? quant::run<4, 16, kRecords, true>(p, T) : quant::run<4, 32, kHalfScales, true>(p, T);
          break;
        }
      }
      if (group == 16) quant::run<4, 16, kRecords>(p, T);
      else if (records) quant::run<4, 32, kRecords>(p, T);
      else quant::run<4, 32, kHalfScales>(p, T);
      break;
    case 5: records ? quant::run<5, 32, kRecords>(p, T) : quant::run<5, 32, kHalfScales>(p, T); break;
    case 6: quant::run<6, 16, kRecords>(p, T); break;
    default: records ? quant::run<8, 16, kRecords>(p, T) : quant::run<8, 32, kHalfScales>(p, T); break;
  }
}

// Several matrices of one packed layout (a mixture's experts: one GGUF stack shares a
// format and shape), each by its own activations, in one parallel loop over all their
// tiles; each output equals quant_linear's bit for bit. many_matrices takes one of
// them (its shapes are checked once); the others differ only in where their values,
// scales and corr are: ``where`` [P, 3] holds those addresses (corr: 0 for none), and
// the caller keeps the tensors alive and of that one's layout
// (runner/linear/experts.py checks it).
// Addresses, not lists of tensors, because converting 6 lists of 128 tensors from
// Python cost 140 us a call, more than a 30B-A3B layer's gate/up pass at batch 1.
namespace quant {

struct ManyMatrices {
  int bits;
  bool records;
  int64_t tiles, tile_bytes, K, N;
  int32_t offset;
  ScaleTable s;  // the example's, checked; each matrix's problem takes its own addresses
};

ManyMatrices many_matrices(const torch::Tensor& values, const torch::Tensor& scales,
                           const torch::Tensor& corr, int64_t K, int64_t N, int64_t group, double offset,
                           double factor, int64_t table) {
  ManyMatrices m;
  m.K = K;
  m.N = N;
  m.tiles = values.size(0);
  m.s = scale_table(scales, corr.numel() > 0 ? c10::optional<torch::Tensor>(corr) : c10::nullopt, m.tiles, K,
                    group, factor, table);
  m.bits = value_bits(values, K, m.s);
  TORCH_CHECK(m.tiles * kRows >= N && (m.tiles - 1) * kRows < N, "values: ceil(N / 16) tiles");
  m.tile_bytes = values.size(1);
  m.records = m.s.record != 0;
  check_format(m.bits, group, m.records, m.s.table != nullptr);
  m.offset = integer_offset(offset);
  return m;
}

// Matrix which[i] of ``where`` (addresses as above) over rows first[i] ..
// first[i] + count[i] of x [*, K] into the same rows of out [*, N], all in one loop;
// ``biases`` (or null): each matrix's float32 bias [N] by address, added as one
// matrix's call adds it.
void run_many(const ManyMatrices& m, const int64_t* where, const std::vector<int64_t>& which,
              const std::vector<int64_t>& first, const std::vector<int64_t>& count,
              const float* x, int64_t x_stride, float* out, int64_t out_stride,
              const int64_t* biases = nullptr) {
  const size_t P = which.size();
  static thread_local std::vector<Activations> acts;
  if (acts.size() < P) acts.resize(P);
  std::vector<Problem> ps(P);
  for (size_t i = 0; i < P; ++i) {
    const int64_t* at = where + 3 * which[i];
    TORCH_CHECK(at[0] != 0 && (at[1] != 0 || m.s.codebook) && (at[2] != 0) == (m.s.corr != nullptr),
                "where: one layout for all");
    Problem& p = ps[i];
    p.s = m.s;
    p.s.scales = reinterpret_cast<const void*>(at[1]);
    p.s.corr = reinterpret_cast<const void*>(at[2]);
    p.values = reinterpret_cast<const uint8_t*>(at[0]);
    p.tile_bytes = m.tile_bytes;
    p.offset = m.offset;
    p.bias = biases != nullptr ? reinterpret_cast<const float*>(biases[which[i]]) : nullptr;
    p.N = m.N;
    p.K = m.K;
    quantize_activations(x + first[i] * x_stride, x_stride, count[i], m.K, m.offset, acts[i]);
    p.act = &acts[i];
    p.out = out + first[i] * out_stride;
    p.out_stride = out_stride;
  }
  switch (m.bits) {
    case 2:
    case 3:
      if constexpr (kCompactLayouts)
        m.bits == 2 ? run_many<2, 16, kRecords>(ps, count, m.tiles) : run_many<3, 16, kRecords>(ps, count, m.tiles);
      break;
    case 4:
      if constexpr (kCompactLayouts) {
        if (m.s.table) {
          m.s.group == 16 ? run_many<4, 16, kRecords, true>(ps, count, m.tiles)
                          : run_many<4, 32, kHalfScales, true>(ps, count, m.tiles);
          break;
        }
      }
      if (m.s.group == 16) run_many<4, 16, kRecords>(ps, count, m.tiles);
      else if (m.records) run_many<4, 32, kRecords>(ps, count, m.tiles);
      else run_many<4, 32, kHalfScales>(ps, count, m.tiles);
      break;
    case 5: m.records ? run_many<5, 32, kRecords>(ps, count, m.tiles) : run_many<5, 32, kHalfScales>(ps, count, m.tiles); break;
    case 6: run_many<6, 16, kRecords>(ps, count, m.tiles); break;
    default:
      m.records ? run_many<8, 16, kRecords>(ps, count, m.tiles) : run_many<8, 32, kHalfScales>(ps, count, m.tiles);
      break;
  }
}

}  // namespace quant

// out [n, K] float32 = rows ids[0..n) of a packed matrix, dequantized (an embedding
// lookup): w = scale * factor * (q - offset) + constant, read straight from the tiled
// layout.
void quant_rows(torch::Tensor out, torch::Tensor ids, torch::Tensor values, torch::Tensor scales,
                c10::optional<torch::Tensor> corr, int64_t group, double offset, double factor,
                int64_t table) {
  using quant::kBlock;
  using quant::kRows;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kFloat, "out: float32");
  TORCH_CHECK(ids.is_contiguous() && ids.scalar_type() == torch::kLong, "ids: int64");
  const int64_t n = ids.size(0), K = out.size(1);
  const int64_t tiles = values.size(0);
  const quant::ScaleTable s = quant::scale_table(scales, corr, tiles, K, group, factor, table);
  const int bits = quant::value_bits(values, K, s);
  const int32_t shift = quant::integer_offset(offset);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < tiles * kRows, "row id out of range");
  const uint8_t* vals = static_cast<const uint8_t*>(values.data_ptr());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = id[i] / kRows, r = id[i] % kRows;
      const uint8_t* tv = vals + tile * values.size(1);
      if (s.codebook) {  // w = d * sub * factor * v, as scale_at multiplies them
        codebook::Decoded c;
        const int64_t bytes = codebook::shape(s.codebook).bytes;
        for (int64_t sb = 0; sb < K / 256; ++sb) {
          codebook::decode(s.codebook, s.grid, tv + quant::codebook_offset(bytes, sb, r), c);
          const float d = static_cast<float>(c10::Half(c.d, c10::Half::from_bits()));
          for (int64_t k = 0; k < 256; ++k)
            dst[i * K + sb * 256 + k] = d * static_cast<float>(c.sub[k / 16]) * s.factor * static_cast<float>(c.v[k]);
        }
        continue;
      }
      for (int64_t g = 0; g < s.groups; ++g) {
        const float scale = quant::scale_at(s, tile, r, g) * s.factor;
        const float constant = quant::constant_at(s, tile, r, g);
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const int32_t v = quant::value_at(tv, bits, k / kBlock, r, k % kBlock);
          const int32_t q = (s.table != nullptr ? s.table[v] : v) - shift;
          dst[i * K + k] = scale * static_cast<float>(q) + constant;
        }
      }
    }
  });
}
