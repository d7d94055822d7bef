// Lookup-table (T-MAC style) key scores against the integer key loop of the fused decode attention (issue 70): a
// measured prototype, not wired into the kernel. The cache of int8_loop_cycles.cpp (2-bit keys, float16 scales and
// zeros, 3 query rows per kv head, 64 groups read warm), head_dim and group size from the arguments (default 64, 32):
//   int8        key_factors_in_place + int8_key_group (decode_int8.h), as the kernel runs them;
//   lut         per row, group and channel quad a 16-entry int8 table, T[idx] = round(sum of q * s over the channels
//               whose bit is set in idx, * 127 / M), M = the row and group's max |subset sum| (T-MAC's table
//               quantization); the index of a token's code plane is its 4 channels' bits of that plane (tile4x8,
//               then a GFNI 8 x 8 bit transpose of every qword), looked up with vpshufb; vpmaddubsw sums the two
//               planes of a token as T[lo] + 2 T[hi] into int16;
//   lut shifts  lut with the bit transpose done in shifts and masks: the index cost on a CPU without GFNI (Zen 3);
//   lut exact   tables of the int8 factors' subset sums in int16, looked up as two byte tables (low, high): the
//               integer path's sums exactly (its scores, bit for bit), the cost of exactness.
// Each method's "prep" (factors / tables, per block of 8 groups) and "scores" (per group) are core cycles per key
// group, the best of the rounds, which alternate the methods in one process; the errors are against a scalar
// reference in double, sum_d q_d (s_d c_td + z_d), over all groups. The clock calibration (the best of 10 dependent
// add chains) cannot undo a core shared during the timed rounds: compare quiet runs only.
// Measured on Zen 4 (best of 5 quiet runs, head_dim 128, G = 32, cycles per group, prep + scores): avx512_vnni int8
// 170 + 270, lut 408 + 346; avx2 int8 160 + 510, lut 417 + 350. The tables cost 2.4x the factors; the lookups beat
// vpmaddubsw but not vpdpbusd. At G = 128 (tables per 4 tiles) lut wins on avx2 (1907 vs 2260), not with VNNI.
//   g++ -O3 -std=c++17 [-DLOOPS_AVX512_VNNI] -Icsrc/cpu benchmarks/lut_key_cycles.cpp -o lut_key_cycles
//   taskset -c 1 ./lut_key_cycles 128 [32]
#include <immintrin.h>
#include <x86intrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "decode_attention.h"

#include "loop_harness.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The kernel's code under the kernel's target (no gfni: the baseline compiles as it ships)
#pragma GCC push_options
#if defined(LOOPS_AVX512_VNNI)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
#define KIVI_SIMD_AVX512 1
#define KIVI_SIMD_VNNI 1
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#define KIVI_SIMD_AVX2 1
#endif
#define KIVI_DA_ENTRY chunk_loops
#define KIVI_DA_ROWS_TIMES rows_times_loops
#define KIVI_DA_ROTATE_ROWS rotate_rows_loops
#include "decode_attention_impl.h"
#pragma GCC pop_options

#pragma GCC push_options  // the same target with gfni for the prototype
#if defined(LOOPS_AVX512_VNNI)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2,gfni")
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,gfni")
#endif
namespace kivi::cpu::decode {
namespace {

constexpr int kRows = 3;
constexpr int64_t kQuads = kMaxDim / 4;

// A block's tables, dense in [group][row][channel quad] (a group stride of a power of two would put a block's stores
// in one L1 set): per quad 16 int8 entries, or with `exact` 16 low bytes (unsigned) then 16 high bytes (signed) of
// the int16 entries; a = the score per table unit, bias = q . zero, per row and group.
struct KeyBlockTables {
  alignas(64) int8_t bytes[kBlockGroups * 4 * kQuads * 32];
  alignas(32) float a[4][kBlockGroups], bias[4][kBlockGroups];
  int64_t quad_bytes, row_bytes, group_bytes;

  void layout(int rows, int64_t D, bool exact) {
    quad_bytes = exact ? 32 : 16, row_bytes = D / 4 * quad_bytes, group_bytes = rows * row_bytes;
  }
  int8_t* at(int64_t g, int r, int64_t x) { return bytes + g * group_bytes + r * row_bytes + x * quad_bytes; }
  const int8_t* at(int64_t g, int r, int64_t x) const {
    return bytes + g * group_bytes + r * row_bytes + x * quad_bytes;
  }
};

// Bytes b[m] from packs of 16 entries e[k] of 8 groups (int32 lane g: group g), i.e. byte 4k + g of half h = entry
// 4m + k of group 4h + g -> the 16 bytes of group g at dst + g * stride.
inline void store_tables(const __m256i* b, int8_t* dst, int64_t stride) {
  const __m256i by_group = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,  //
                                            0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m256i s[4];
  for (int m = 0; m < 4; ++m) s[m] = _mm256_shuffle_epi8(b[m], by_group);  // int32 lane g: entries 4m..4m+3
  const __m256i t0 = _mm256_unpacklo_epi32(s[0], s[1]), t1 = _mm256_unpackhi_epi32(s[0], s[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(s[2], s[3]), t3 = _mm256_unpackhi_epi32(s[2], s[3]);
  const __m256i g[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                        _mm256_unpackhi_epi64(t1, t3)};
  for (int k = 0; k < 4; ++k) {
    _mm_store_si128((__m128i*)(dst + k * stride), _mm256_castsi256_si128(g[k]));
    _mm_store_si128((__m128i*)(dst + (k + 4) * stride), _mm256_extracti128_si256(g[k], 1));
  }
}

// The subset sums of a quad, e[idx] = sum of v[c] over the channels c whose bit 3 - c is set in idx: the GFNI
// transpose (tile_indices) puts channel c of a quad at bit 3 - c of the index.
inline __m256 lanes_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256i lanes_add(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
template <typename V>
inline void subset_sums(const V* v, V zero, V* e) {
  e[0] = zero;
  for (int b = 0; b < 4; ++b) {
    e[1 << b] = v[3 - b];
    for (int j = 1; j < (1 << b); ++j) e[(1 << b) + j] = lanes_add(e[j], v[3 - b]);
  }
}

// The lut tables of NR rows for a block of kBlockGroups groups, groups in the lanes as in key_block_factors (meta8:
// channel d's scales / zeros of the block's groups in fp32). The max |subset sum| of a quad is the larger of its
// positive and negative parts' sums, (sum |qs| + |sum qs|) / 2. (No NaN / Inf handling: a prototype.)
template <int NR, typename Meta8>
inline void key_block_tables(const float* const* q, Meta8 meta8, int64_t D, KeyBlockTables* T) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m[NR], bias[NR];
  alignas(32) float qs[NR][kMaxDim][kBlockGroups];
  for (int r = 0; r < NR; ++r) m[r] = bias[r] = _mm256_setzero_ps();
  for (int64_t x = 0; x < D / 4; ++x) {
    __m256 sum[NR], abs[NR];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 s = meta8(0, 4 * x + c), z = meta8(1, 4 * x + c);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m256 qd = _mm256_set1_ps(q[r][4 * x + c]), v = _mm256_mul_ps(qd, s);
        _mm256_store_ps(qs[r][4 * x + c], v);
        sum[r] = c == 0 ? v : _mm256_add_ps(sum[r], v);
        abs[r] = c == 0 ? _mm256_andnot_ps(sign, v) : _mm256_add_ps(abs[r], _mm256_andnot_ps(sign, v));
        bias[r] = _mm256_fmadd_ps(qd, z, bias[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) m[r] = _mm256_max_ps(m[r], _mm256_add_ps(abs[r], _mm256_andnot_ps(sign, sum[r])));
  }
  T->layout(NR, D, false);
  for (int r = 0; r < NR; ++r) {  // m = 2 M: a = M / 127, entries scaled by 127 / M (0 where M == 0)
    _mm256_store_ps(T->a[r], _mm256_div_ps(m[r], _mm256_set1_ps(254.0f)));
    _mm256_store_ps(T->bias[r], bias[r]);
    const __m256 positive = _mm256_cmp_ps(m[r], _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(254.0f), m[r]), positive);
    for (int64_t x = 0; x < D / 4; ++x) {
      __m256 v[4], e[16];
      for (int c = 0; c < 4; ++c) v[c] = _mm256_mul_ps(_mm256_load_ps(qs[r][4 * x + c]), inv);
      subset_sums(v, _mm256_setzero_ps(), e);  // |e| <= 127 (up to the fp32 rounding of the scaled sums)
      __m256i w[8], b[4];
      for (int k = 0; k < 8; ++k) {
        w[k] = _mm256_packs_epi32(_mm256_cvtps_epi32(e[2 * k]), _mm256_cvtps_epi32(e[2 * k + 1]));  // nearest even
      }
      for (int k = 0; k < 4; ++k) b[k] = _mm256_packs_epi16(w[2 * k], w[2 * k + 1]);
      store_tables(b, T->at(0, r, x), T->group_bytes);
    }
  }
}

template <int NR>
inline void key_tables_in_place(const float* const* q, const Packed& K, int64_t offset, int64_t D, KeyBlockTables* T) {
  with_dtype(K.meta, [&](auto set) {
    const auto meta8 = [&](int array, int64_t d) {
      return load_dtype<Vec256>(array == 0 ? K.scales : K.zeros, decltype(set)::kDtype, offset + d * K.meta_row);
    };
    key_block_tables<NR>(q, meta8, D, T);
  });
}

// The exact tables: the int16 subset sums of the int8 factors (|sum| <= 4 * 127), split into low bytes (unsigned)
// and high bytes (signed): entry = lo + 256 hi.
template <int NR>
inline void tables_from_factors(const KeyBlockFactors& f, int64_t D, KeyBlockTables* T) {
  const __m256i low = _mm256_set1_epi16(0xFF);
  T->layout(NR, D, true);
  for (int r = 0; r < NR; ++r) {
    _mm256_store_ps(T->a[r], _mm256_load_ps(f.a[r]));
    _mm256_store_ps(T->bias[r], _mm256_load_ps(f.bias[r]));
    for (int64_t x = 0; x < D / 4; ++x) {
      const __m256i fq = _mm256_load_si256((const __m256i*)f.q[r][x]);  // byte 4g + c: channel 4x + c, group g
      __m256i v[4], e[16], w[8], lo[4], hi[4];
      v[0] = _mm256_srai_epi32(_mm256_slli_epi32(fq, 24), 24);
      v[1] = _mm256_srai_epi32(_mm256_slli_epi32(fq, 16), 24);
      v[2] = _mm256_srai_epi32(_mm256_slli_epi32(fq, 8), 24);
      v[3] = _mm256_srai_epi32(fq, 24);
      subset_sums(v, _mm256_setzero_si256(), e);
      for (int k = 0; k < 8; ++k) w[k] = _mm256_packs_epi32(e[2 * k], e[2 * k + 1]);
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm256_packus_epi16(_mm256_and_si256(w[2 * k], low), _mm256_and_si256(w[2 * k + 1], low));
        hi[k] = _mm256_packs_epi16(_mm256_srai_epi16(w[2 * k], 8), _mm256_srai_epi16(w[2 * k + 1], 8));
      }
      store_tables(lo, T->at(0, r, x), T->group_bytes);
      store_tables(hi, T->at(0, r, x) + 16, T->group_bytes);
    }
  }
}

// The 4-bit indices of a tile (tile4x8: int32 lane j = byte j of the quad's 4 channels): byte m = 2k + b of qword w
// holds in `even` the plane-b bits of token 4j + k of the 4 channels for j = 2w, in `odd` for j = 2w + 1, channel c
// at bit 3 - c. vgf2p8affineqb with the tile as the matrix sets bit i of output byte m to bit m of the qword's byte
// 7 - i: a bit transpose that reverses the byte order; the shifts variant reverses the bytes first (vpshufb), then
// transposes in three delta swaps (Hacker's Delight 7-3: output byte m bit i = input byte i bit m).
template <bool GFNI>
inline void tile_indices(__m256i tile, __m256i* even, __m256i* odd) {
  __m256i bits;
  if constexpr (GFNI) {
    bits = _mm256_gf2p8affine_epi64_epi8(_mm256_set1_epi64x(0x8040201008040201), tile, 0);  // byte m = 1 << m
  } else {
    const __m256i reverse = _mm256_setr_epi8(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8,  //
                                             7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
    __m256i x = _mm256_shuffle_epi8(tile, reverse), t;
    t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi64(x, 7)), _mm256_set1_epi64x(0x00AA00AA00AA00AA));
    x = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi64(t, 7)));
    t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi64(x, 14)), _mm256_set1_epi64x(0x0000CCCC0000CCCC));
    x = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi64(t, 14)));
    t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi64(x, 28)), _mm256_set1_epi64x(0x00000000F0F0F0F0));
    bits = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi64(t, 28)));
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  *odd = _mm256_and_si256(bits, nibble);
  *even = _mm256_and_si256(_mm256_srli_epi16(bits, 4), nibble);
}

// int16 lanes 4w + k of even / odd (tokens 8w + k / 8w + 4 + k) -> int32 tokens 0-7, 8-15, 16-23, 24-31.
inline void widen_tokens(__m256i even, __m256i odd, __m256i* s) {
  // a = tokens [0-7 | 16-23], b = [8-15 | 24-31]
  const __m256i a = _mm256_unpacklo_epi64(even, odd), b = _mm256_unpackhi_epi64(even, odd);
  s[0] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a));
  s[1] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(b));
  s[2] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1));
  s[3] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b, 1));
}

// Scores of group i of a block for NR rows from its tables: out[r][t] = a * sum_quads (T[lo] + 2 T[hi]) + bias.
// codes points at channel 0's first byte of the group, channels code_row bytes apart; G a multiple of 32, D of 4.
template <int NR, bool GFNI, bool EXACT>
inline void lut_key_group(const KeyBlockTables& T, int64_t i, const uint8_t* codes, int64_t code_row, int64_t D,
                          int64_t G, float* const* out) {
  // Quads summed in int16: |T[lo] + 2 T[hi]| <= 381 (exact: low bytes <= 765, high bytes <= 384)
  constexpr int64_t flush = EXACT ? 32 : 64;
  constexpr int A = EXACT ? 4 : 2;             // accumulators per row: even, odd (exact: low, then high bytes)
  const __m256i weights = _mm256_set1_epi16(0x0201);  // bytes 1, 2, 1, 2...: plane 0 + 2 * plane 1 of a token
  for (int64_t tile = 0; tile * 32 < G; ++tile) {
    const uint8_t* c = codes + tile * 8;
    alignas(32) int32_t sum[NR][32];  // token order
    for (int64_t q0 = 0; q0 < D / 4; q0 += flush) {
      const int64_t q1 = min64(q0 + flush, D / 4);
      __m256i acc[NR][A];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
        for (int k = 0; k < A; ++k) acc[r][k] = _mm256_setzero_si256();
      for (int64_t q = q0; q < q1; ++q) {
        __m256i even, odd;
        tile_indices<GFNI>(tile4x8(c + 4 * q * code_row, code_row), &even, &odd);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
          const __m256i lo = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)T.at(i, r, q)));
          if constexpr (!EXACT) {  // signed entries: the second operand
            acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(weights, _mm256_shuffle_epi8(lo, even)));
            acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(weights, _mm256_shuffle_epi8(lo, odd)));
          } else {  // unsigned low bytes: the first operand
            const __m256i hi = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)(T.at(i, r, q) + 16)));
            acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(_mm256_shuffle_epi8(lo, even), weights));
            acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(_mm256_shuffle_epi8(lo, odd), weights));
            acc[r][2] = _mm256_add_epi16(acc[r][2], _mm256_maddubs_epi16(weights, _mm256_shuffle_epi8(hi, even)));
            acc[r][3] = _mm256_add_epi16(acc[r][3], _mm256_maddubs_epi16(weights, _mm256_shuffle_epi8(hi, odd)));
          }
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        __m256i s[4];
        widen_tokens(acc[r][0], acc[r][1], s);
        if constexpr (EXACT) {
          __m256i h[4];
          widen_tokens(acc[r][2], acc[r][3], h);
          for (int n = 0; n < 4; ++n) s[n] = _mm256_add_epi32(s[n], _mm256_slli_epi32(h[n], 8));
        }
        for (int n = 0; n < 4; ++n) {
          __m256i* to = (__m256i*)(sum[r] + 8 * n);
          _mm256_store_si256(to, q0 == 0 ? s[n] : _mm256_add_epi32(_mm256_load_si256(to), s[n]));
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 a = _mm256_set1_ps(T.a[r][i]), b = _mm256_set1_ps(T.bias[r][i]);
      for (int n = 0; n < 4; ++n) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(sum[r] + 8 * n)));
        _mm256_storeu_ps(out[r] + tile * 32 + 8 * n, _mm256_fmadd_ps(s, a, b));
      }
    }
  }
}

// tile_indices against the bits it should gather, on random tiles.
template <bool GFNI>
bool indices_ok() {
  for (int trial = 0; trial < 100; ++trial) {
    alignas(32) uint8_t tile[32], even[32], odd[32];
    for (auto& byte : tile) byte = uint8_t(rand());
    __m256i e, o;
    tile_indices<GFNI>(_mm256_load_si256((const __m256i*)tile), &e, &o);
    _mm256_store_si256((__m256i*)even, e);
    _mm256_store_si256((__m256i*)odd, o);
    for (int w = 0; w < 4; ++w)
      for (int m = 0; m < 8; ++m) {
        int want_even = 0, want_odd = 0;  // lane j = bytes 4j..4j+3 (channels 0-3) of the tile
        for (int c = 0; c < 4; ++c) {
          want_even |= ((tile[8 * w + c] >> m) & 1) << (3 - c);
          want_odd |= ((tile[8 * w + 4 + c] >> m) & 1) << (3 - c);
        }
        if (even[8 * w + m] != want_even || odd[8 * w + m] != want_odd) return false;
      }
  }
  return true;
}

volatile int64_t head_dim = 64, group_size = 32;  // sizes the compiler cannot fold, as in the kernel
double cycles_per_tick = 1.0;

float random_unit() { return float(rand() % 20001 - 10000) * 1e-4f; }

enum Method { kInt8, kLut, kLutShifts, kLutExact, kMethods };
const char* const kNames[kMethods] = {"int8", "lut", "lut shifts", "lut exact"};

struct Cache {
  Packed K{};
  int64_t groups = 0;
  float q[kRows][kMaxDim];
  const float* rows[kRows];
  std::vector<float> scores[kMethods];
  std::vector<double> reference;  // [row][token]
};

void make_cache(Cache* cache, int64_t groups) {
  const int64_t D = head_dim, G = group_size;
  Packed& K = cache->K;
  K.group = G, K.bits = 2, K.meta = kF16, K.count = groups * G;
  K.code_row = groups * G / 4 + 64, K.meta_row = groups + 16;  // rows padded as the cache pads them
  K.code_head = D * K.code_row, K.meta_head = D * K.meta_row;
  uint8_t* codes = static_cast<uint8_t*>(aligned_alloc(64, K.code_head));
  uint16_t* scales = static_cast<uint16_t*>(aligned_alloc(64, K.meta_head * 2));
  uint16_t* zeros = static_cast<uint16_t*>(aligned_alloc(64, K.meta_head * 2));
  for (int64_t i = 0; i < K.code_head; ++i) codes[i] = uint8_t(rand());
  for (int64_t i = 0; i < K.meta_head; ++i) {
    scales[i] = _cvtss_sh(0.05f + 0.04f * random_unit(), 0), zeros[i] = _cvtss_sh(random_unit(), 0);
  }
  K.codes = codes, K.scales = scales, K.zeros = zeros;
  cache->groups = groups;
  for (int r = 0; r < kRows; ++r) {
    for (int64_t d = 0; d < D; ++d) cache->q[r][d] = random_unit();
    cache->rows[r] = cache->q[r];
  }
  for (auto& s : cache->scores) s.assign(kRows * groups * G, 0.0f);
  cache->reference.assign(kRows * groups * G, 0.0);
  for (int r = 0; r < kRows; ++r)
    for (int64_t t = 0; t < groups * G; ++t) {
      double score = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const int code = (codes[d * K.code_row + t / 4] >> (2 * (t % 4))) & 3;
        const int64_t meta = d * K.meta_row + t / G;
        score += double(cache->q[r][d]) * (double(_cvtsh_ss(scales[meta])) * code + double(_cvtsh_ss(zeros[meta])));
      }
      cache->reference[r * groups * G + t] = score;
    }
}

// Cycles per key group of one method over all groups, reps times: prep per block of kBlockGroups groups, then the
// scores of its groups.
void time_method(Cache* cache, Method method, int reps, double* prep, double* scores) {
  const Packed& K = cache->K;
  const int64_t D = head_dim, G = group_size, groups = cache->groups;
  static KeyBlockFactors f;
  static KeyBlockTables T;
  uint64_t ticks[2] = {};
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    for (int64_t gb = 0; gb < groups; gb += kBlockGroups) {
      const uint64_t t1 = __rdtsc();
      if (method == kInt8 || method == kLutExact) key_factors_in_place<kRows>(cache->rows, K, gb, D, &f);
      if (method == kLutExact) tables_from_factors<kRows>(f, D, &T);
      if (method == kLut || method == kLutShifts) key_tables_in_place<kRows>(cache->rows, K, gb, D, &T);
      const uint64_t t2 = __rdtsc();
      for (int64_t i = 0; i < kBlockGroups; ++i) {
        const uint8_t* codes = K.codes + (gb + i) * G / 4;
        float* out[kRows];
        for (int r = 0; r < kRows; ++r) out[r] = cache->scores[method].data() + (r * groups + gb + i) * G;
        switch (method) {
          case kInt8: int8_key_group<2, kRows>(f, i, codes, K.code_row, D, G, out); break;
          case kLut: lut_key_group<kRows, true, false>(T, i, codes, K.code_row, D, G, out); break;
          case kLutShifts: lut_key_group<kRows, false, false>(T, i, codes, K.code_row, D, G, out); break;
          default: lut_key_group<kRows, true, true>(T, i, codes, K.code_row, D, G, out); break;
        }
      }
      const uint64_t t3 = __rdtsc();
      if (rep > 0) ticks[0] += t2 - t1, ticks[1] += t3 - t2;
    }
  }
  *prep = ticks[0] * cycles_per_tick / double(groups * reps);
  *scores = ticks[1] * cycles_per_tick / double(groups * reps);
}

// Max |error| / max |reference| and RMS error / RMS reference of a method's last scores.
void errors(const Cache& cache, Method method, double* max_rel, double* rms_rel, double* max_vs_int8) {
  double max_err = 0, max_ref = 0, sq_err = 0, sq_ref = 0, vs_int8 = 0;
  for (size_t t = 0; t < cache.reference.size(); ++t) {
    const double ref = cache.reference[t], err = cache.scores[method][t] - ref;
    max_err = std::fmax(max_err, std::fabs(err)), max_ref = std::fmax(max_ref, std::fabs(ref));
    sq_err += err * err, sq_ref += ref * ref;
    vs_int8 = std::fmax(vs_int8, std::fabs(double(cache.scores[method][t]) - double(cache.scores[kInt8][t])));
  }
  *max_rel = max_err / max_ref, *rms_rel = std::sqrt(sq_err / sq_ref), *max_vs_int8 = vs_int8;
}

}  // namespace
}  // namespace kivi::cpu::decode
#pragma GCC pop_options

int main(int argc, char** argv) {
  using namespace kivi::cpu::decode;
  if (argc > 1) head_dim = std::atol(argv[1]);    // a multiple of 4, at most kMaxDim
  if (argc > 2) group_size = std::atol(argv[2]);  // a multiple of 32
  if (!indices_ok<true>() || !indices_ok<false>()) {
    std::printf("tile_indices: wrong bits\n");
    return 1;
  }
  cycles_per_tick = core_cycles_per_tick();
#if defined(LOOPS_AVX512_VNNI)
  const char* isa = "avx512_vnni";
#else
  const char* isa = "avx2";
#endif
  std::printf("%s, head_dim %ld, group %ld, %d rows: core cycles per TSC tick %.3f\n", isa, long(head_dim),
              long(group_size), kRows, cycles_per_tick);
  static Cache cache;
  make_cache(&cache, 64);
  constexpr int kRounds = 7, kReps = 1000;
  double best[kMethods][3];
  for (auto& b : best) b[0] = b[1] = b[2] = 1e30;
  for (int round = 0; round < kRounds; ++round)
    for (int m = 0; m < kMethods; ++m) {  // alternating: every round runs every method
      double prep, scores;
      time_method(&cache, Method(m), kReps, &prep, &scores);
      best[m][0] = std::fmin(best[m][0], prep), best[m][1] = std::fmin(best[m][1], scores);
      best[m][2] = std::fmin(best[m][2], prep + scores);
    }
  std::printf("%-11s %8s %8s %8s  %12s %12s %12s\n", "method", "prep", "scores", "total", "max err/max", "rms err/rms",
              "max |- int8|");
  for (int m = 0; m < kMethods; ++m) {
    double max_rel, rms_rel, vs_int8;
    errors(cache, Method(m), &max_rel, &rms_rel, &vs_int8);
    std::printf("%-11s %8.0f %8.0f %8.0f  %12.2e %12.2e %12.2e\n", kNames[m], best[m][0], best[m][1], best[m][2],
                max_rel, rms_rel, vs_int8);
  }
  return 0;
}
