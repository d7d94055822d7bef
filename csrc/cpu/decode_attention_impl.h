// Chunk kernel of the fused decode attention, written once over a small vector layer and compiled once per ISA:
// each decode_attention_<isa>.cpp defines KIVI_SIMD_AVX512 / KIVI_SIMD_AVX2 (neither: baseline) as simd.h wants
// and KIVI_DA_ENTRY, opens its `#pragma GCC target` region and includes this file. Everything here has internal
// linkage (anonymous namespace) and uses no std templates, so no instruction of one ISA can leak into another TU
// through a shared symbol.
//
// One chunk = the positions [p0, p1) of one (batch, kv head); all query rows of that kv head are handled together
// so each packed byte comes from memory once. Keys use KIVI's factored dequantization per group g and channel d:
//   score_t = sum_d (q_d * s_gd) * c_td + sum_d q_d * z_gd       (vectorised along tokens)
// values per token t and channel group g:
//   out_d  += p_t * (s_tg * c_td)  and  zsum_g += p_t * z_tg     (vectorised along channels; zsum added at the end)
// The chunk's scores become exp(score - chunk max) in place; the chunk max, sum and unnormalised output go to its
// partial, merged in order by the dispatcher.
#if !defined(KIVI_DA_ENTRY) || !defined(KIVI_DA_ROWS_TIMES) || !defined(KIVI_DA_ROTATE_ROWS)
#error "define KIVI_DA_ENTRY, KIVI_DA_ROWS_TIMES, KIVI_DA_ROTATE_ROWS (<name>_<isa>) before including this file"
#endif

namespace kivi::cpu::decode {
namespace {

#include "simd.h"         // the vector layer, with internal linkage here
#include "phase_timer.h"  // PhaseTimer, likewise

using FV = FloatVec;  // 16 lanes AVX-512, 8 AVX2, 4 baseline (Vec4)
using vf = FV::F;
constexpr int VW = FV::kWidth;

inline float load_scalar(const void* base, Dtype dtype, int64_t index) {
  return load_dtype<Scalar>(base, dtype, index);
}

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
constexpr float kNegInf = -__builtin_inff();

template <int BITS>
inline float scalar_code(const uint8_t* p, int64_t i) {
  constexpr int P = 8 / BITS;
  return (float)((p[i / P] >> ((i % P) * BITS)) & ((1 << BITS) - 1));
}

// out[0, count) = row converted to fp32.
inline void load_row(const void* base, Dtype dtype, int64_t offset, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + VW <= count; i += VW) FV::store(out + i, load_dtype<FV>(base, dtype, offset + i));
  for (; i < count; ++i) out[i] = load_scalar(base, dtype, offset + i);
}

inline float dot(const float* a, const float* b, int64_t count) {
  vf acc = FV::set1(0.0f), acc1 = FV::set1(0.0f);  // two chains: a head_dim of 64 is only 4-8 vectors
  int64_t i = 0;
  for (; i + 2 * VW <= count; i += 2 * VW) {
    acc = FV::fma(FV::load(a + i), FV::load(b + i), acc);
    acc1 = FV::fma(FV::load(a + i + VW), FV::load(b + i + VW), acc1);
  }
  acc = FV::add(acc, acc1);
  for (; i + VW <= count; i += VW) acc = FV::fma(FV::load(a + i), FV::load(b + i), acc);
  float s = FV::reduce_add(acc);
  for (; i < count; ++i) s += a[i] * b[i];
  return s;
}

// acc[0, count) += p * x[0, count)
inline void axpy(float p, const float* x, float* acc, int64_t count) {
  const vf pv = FV::set1(p);
  int64_t i = 0;
  for (; i + VW <= count; i += VW) FV::store(acc + i, FV::fma(pv, FV::load(x + i), FV::load(acc + i)));
  for (; i < count; ++i) acc[i] += p * x[i];
}

// The kernels take the number of query rows they handle together (1-4) as a template argument, so their sums stay in
// registers: with_row_count(nr, f) calls f(RowSet<nr>{}), and f reads the count as decltype(rows)::kRows.
template <int N>
struct RowSet {
  static constexpr int kRows = N;
};
template <typename F>
inline void with_row_count(int nr, F f) {
  switch (nr) {
    case 1: f(RowSet<1>{}); break;
    case 2: f(RowSet<2>{}); break;
    case 3: f(RowSet<3>{}); break;
    default: f(RowSet<4>{}); break;
  }
}

// The query rows in sets of up to 4 (what the kernels take as NR): for each set f(RowSet<NR>{}, x, y) with x[i] / y[i]
// row r0 + i of `xs` / `ys` (rows `x_row` / `y_row` elements apart), e.g. the probabilities and sums of a value pass.
template <typename X, typename Y, typename F>
inline void for_row_sets(const Problem& P, X* xs, int64_t x_row, Y* ys, int64_t y_row, F f) {
  X* x[4];
  Y* y[4];
  for (int64_t r0 = 0; r0 < P.rows; r0 += 4) {
    const int nr = (int)min64(4, P.rows - r0);
    for (int i = 0; i < nr; ++i) {
      x[i] = xs + (r0 + i) * x_row;
      y[i] = ys + (r0 + i) * y_row;
    }
    with_row_count(nr, [&](auto rows) { f(rows, x, y); });
  }
}

#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
#define KIVI_DA_INTEGER 1
#include "decode_int8.h"  // the integer dot products (KIVI_XPU_CPU_DOT=int8)
#endif

// ---- keys ---------------------------------------------------------------------------------------------------------

// Scores of TB exact keys (rows `stride` elements apart from `offset`) for NR query rows: out[r][t] = q[r] . key t.
// Each key vector is loaded once for the NR rows and the NR * TB sums are independent chains (a dot product per token
// and row, each waiting on its previous channel vector, left the exact phases latency-bound).
template <int NR, int TB>
inline void exact_score_tokens(const float* const* q, const Exact& keys, int64_t offset, int64_t D, float* const* out) {
  vf acc[NR][TB];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = FV::set1(0.0f);
  int64_t d = 0;
  for (; d + VW <= D; d += VW) {
    vf k[TB];
    for (int t = 0; t < TB; ++t) k[t] = load_dtype<FV>(keys.data, keys.dtype, offset + t * keys.stride_t + d);
    for (int r = 0; r < NR; ++r) {
      const vf qv = FV::load(q[r] + d);
      for (int t = 0; t < TB; ++t) acc[r][t] = FV::fma(qv, k[t], acc[r][t]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < NR; ++r) {
      float s = FV::reduce_add(acc[r][t]);
      for (int64_t e = d; e < D; ++e) s += q[r][e] * load_scalar(keys.data, keys.dtype, offset + t * keys.stride_t + e);
      out[r][t] = s;
    }
}

// Scores of an exact key range: tokens [t0, t0 + count) of (b, h) in `keys` -> positions pos0.. of the score rows.
inline void exact_scores(const Problem& P, const Exact& keys, int64_t b, int64_t h, int64_t t0, int64_t count,
                         const float* q, float* scores, int64_t pos0) {
  const int64_t D = P.head_dim, first = b * keys.stride_b + h * keys.stride_h + t0 * keys.stride_t;
  for_row_sets(P, q, D, scores + pos0, P.score_row, [&](auto rows, const float* const* qr, float* const* out) {
    constexpr int NR = decltype(rows)::kRows;
    // tokens per pass: the NR * TB sums, TB keys and a query vector in the registers (16 with AVX2, 32 with AVX-512)
    constexpr int TB = VW >= 16 ? 4 : (NR <= 2 ? 4 : (NR == 3 ? 3 : 2));
    float* o[NR];
    int64_t t = 0;
    for (; t + TB <= count; t += TB) {
      for (int r = 0; r < NR; ++r) o[r] = out[r] + t;
      exact_score_tokens<NR, TB>(qr, keys, first + t * keys.stride_t, D, o);
    }
    for (; t < count; ++t) {
      for (int r = 0; r < NR; ++r) o[r] = out[r] + t;
      exact_score_tokens<NR, 1>(qr, keys, first + t * keys.stride_t, D, o);
    }
  });
}

// One packed key group for NR rows: qs [NR][kMaxDim] = q * scale, bias[NR] = q . zero; codes points at channel 0's
// first byte of the group (channels `code_row` bytes apart); out[r] at the group's first score.
template <int BITS, int NR>
inline void key_group(const float (*qs)[kMaxDim], const float* bias, const uint8_t* codes, int64_t code_row,
                      int64_t D, int64_t G, float* const* out) {
  constexpr int P = 8 / BITS;
  int64_t j = 0;
  for (; j + 2 * VW <= G; j += 2 * VW) {
    vf acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = FV::set1(bias[r]);
    const uint8_t* c = codes + j / P;
    for (int64_t d = 0; d < D; ++d, c += code_row) {
      vf c0, c1;
      FV::load_codes_float2<BITS>(c, c0, c1);
      for (int r = 0; r < NR; ++r) {
        const vf w = FV::set1(qs[r][d]);
        acc[r][0] = FV::fma(w, c0, acc[r][0]);
        acc[r][1] = FV::fma(w, c1, acc[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      FV::store(out[r] + j, acc[r][0]);
      FV::store(out[r] + j + VW, acc[r][1]);
    }
  }
  for (; j + VW <= G; j += VW) {
    vf acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = FV::set1(bias[r]);
    const uint8_t* c = codes + j / P;
    for (int64_t d = 0; d < D; ++d, c += code_row) {
      const vf c0 = FV::load_codes_float<BITS>(c);
      for (int r = 0; r < NR; ++r) acc[r] = FV::fma(FV::set1(qs[r][d]), c0, acc[r]);
    }
    for (int r = 0; r < NR; ++r) FV::store(out[r] + j, acc[r]);
  }
  for (; j < G; ++j) {  // a group that is not a whole number of vectors
    for (int r = 0; r < NR; ++r) {
      float s = bias[r];
      for (int64_t d = 0; d < D; ++d) s += qs[r][d] * scalar_code<BITS>(codes + d * code_row, j);
      out[r][j] = s;
    }
  }
}

#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
// r[i] lane j -> r[j] lane i for 8 vectors of 8 floats.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // lane i of rows 0..3 (u[i]) and of rows 4..7 (u[i + 4])
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// Key metadata of `count` consecutive groups for channels [0, D): channel d's row starts at `offset + d * row` (its
// groups contiguous) -> out[i * kMaxDim + d] in fp32 (group-major: each group's values are one contiguous vector). One
// pass over each channel's row serves every group of the block (the rows lie `row` elements apart, so reading them
// group by group touched D cache lines per group); the dtype switch is resolved once, outside the loops.
constexpr int64_t kMetaGroups = 8;
template <Dtype DT>
inline void load_key_meta_rows(const void* base, int64_t offset, int64_t row, int64_t D, int64_t count, float* out) {
  int64_t d0 = 0;
#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
  if (count == 8) {  // a whole block: 8 channels x 8 groups at a time, converted as rows and transposed in registers
    for (; d0 + 8 <= D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load_dtype<Vec256>(base, DT, offset + (d0 + i) * row);
      transpose8x8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + i * kMaxDim + d0, r[i]);
    }
  }
#endif
  for (int64_t d = d0; d < D; ++d)
    for (int64_t i = 0; i < count; ++i) out[i * kMaxDim + d] = load_scalar(base, DT, offset + d * row + i);
}
inline void load_key_meta(const void* base, Dtype dtype, int64_t offset, int64_t row, int64_t D, int64_t count,
                          float* out) {
  switch (dtype) {
    case kF32: load_key_meta_rows<kF32>(base, offset, row, D, count, out); break;
    case kF16: load_key_meta_rows<kF16>(base, offset, row, D, count, out); break;
    default: load_key_meta_rows<kBF16>(base, offset, row, D, count, out); break;
  }
}

#if defined(KIVI_DA_INTEGER)
// Key metadata of groups [gb, gb + block) (block <= kBlockGroups) channel-major in fp32, what key_block_factors
// reads: out[d * kBlockGroups + i] = channel d of group gb + i, zeros for i >= block. Contiguous storage keeps a
// channel's groups side by side (one vector load per channel); a page holds one group's D channels (each page's row
// loaded, then transposed in 8 x 8 blocks).
template <Dtype DT>
inline void load_key_meta_channels(const void* base, int64_t offset, int64_t row, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d)
    _mm256_store_ps(out + d * kBlockGroups, load_dtype<Vec256>(base, DT, offset + d * row));
}
inline void load_key_meta_by_channel(const Packed& K, const void* base, int64_t bh, int64_t gb, int64_t block,
                                     int64_t D, float* out) {
  constexpr int64_t W = kBlockGroups;
  if (K.pages == nullptr) {
    const int64_t offset = bh * K.meta_head + gb;
    if (block == W) {  // the dtype switch outside the loop
      switch (K.meta) {
        case kF32: return load_key_meta_channels<kF32>(base, offset, K.meta_row, D, out);
        case kF16: return load_key_meta_channels<kF16>(base, offset, K.meta_row, D, out);
        default: return load_key_meta_channels<kBF16>(base, offset, K.meta_row, D, out);
      }
    }
    for (int64_t d = 0; d < D; ++d)  // the last block of a range: only its groups are read
      for (int64_t i = 0; i < W; ++i)
        out[d * W + i] = i < block ? load_scalar(base, K.meta, offset + d * K.meta_row + i) : 0.0f;
    return;
  }
  alignas(32) float rows[W][kMaxDim];
  for (int64_t i = 0; i < W; ++i) {
    if (i < block)
      load_row(base, K.meta, K.pages[gb + i] * K.meta_page + bh * K.meta_head, D, rows[i]);
    else
      for (int64_t d = 0; d < D; ++d) rows[i][d] = 0.0f;
  }
  int64_t d0 = 0;
  for (; d0 + 8 <= D; d0 += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(rows[i] + d0);
    transpose8x8(r);
    for (int k = 0; k < 8; ++k) _mm256_store_ps(out + (d0 + k) * W, r[k]);
  }
  for (; d0 < D; ++d0)
    for (int64_t i = 0; i < W; ++i) out[d0 * W + i] = rows[i][d0];
}

// Packed key groups [g0, g1) of (batch, kv head) bh on integer arithmetic (needs integer_keys), kBlockGroups groups
// at a time: the block's metadata channel-major, each set of up to 4 query rows' factors for the whole block, then
// each group's dot products. A group where one of the set's q * s is not finite takes the fp32 path (key_group), as
// the integer twin says.
template <int BITS>
void int8_packed_scores(const Problem& P, int64_t bh, int64_t g0, int64_t g1, const float* q, float* scores,
                        int64_t pos0) {
  const Packed& K = P.keys;
  const int64_t D = P.head_dim, G = K.group;
  alignas(32) float scale[kMaxDim * kBlockGroups], zero[kMaxDim * kBlockGroups];
  KeyBlockFactors f;
  for (int64_t gb = g0; gb < g1; gb += kBlockGroups) {
    const int64_t block = min64(kBlockGroups, g1 - gb);
    {
      PhaseTimer timer(kPhaseKeyMeta);
      load_key_meta_by_channel(K, K.scales, bh, gb, block, D, scale);
      load_key_meta_by_channel(K, K.zeros, bh, gb, block, D, zero);
    }
    for (int64_t r0 = 0; r0 < P.rows; r0 += 4) {
      const int nr = (int)min64(4, P.rows - r0);
      const float* qr[4];
      for (int j = 0; j < nr; ++j) qr[j] = q + (r0 + j) * D;
      with_row_count(nr, [&](auto rows) {
        constexpr int NR = decltype(rows)::kRows;
        {
          PhaseTimer timer(kPhaseKeyFactors);
          key_block_factors<NR>(qr, scale, zero, D, &f);
        }
        for (int64_t i = 0; i < block; ++i) {
          const int64_t g = gb + i;
          const uint8_t* codes = K.pages == nullptr ? K.codes + bh * K.code_head + g * (G * BITS / 8)
                                                    : K.codes + K.pages[g] * K.code_page + bh * K.code_head;
          float* out[NR];
          for (int j = 0; j < NR; ++j) out[j] = scores + (r0 + j) * P.score_row + pos0 + (g - g0) * G;
          if ((f.finite >> i) & 1) {
            int8_key_group<BITS, NR>(f, i, codes, K.code_row, D, G, out);
            continue;
          }
          float qs[NR][kMaxDim], bias[NR];  // a non-finite q * s: the fp32 products, as the dense product would meet it
          for (int j = 0; j < NR; ++j) {
            for (int64_t d = 0; d < D; ++d) qs[j][d] = qr[j][d] * scale[d * kBlockGroups + i];
            bias[j] = f.bias[j][i];
          }
          key_group<BITS, NR>(qs, bias, codes, K.code_row, D, G, out);
        }
      });
    }
  }
}
#endif

// Packed key groups [g0, g1) of (batch, kv head) bh -> scores from position pos0: on integer arithmetic where the
// ISA and the settings allow (int8_packed_scores), else on fp32 with the metadata group-major.
template <int BITS>
void packed_scores(const Problem& P, int64_t bh, int64_t g0, int64_t g1, const float* q, float* scores,
                   int64_t pos0) {
  const Packed& K = P.keys;
  const int64_t D = P.head_dim, G = K.group;
#if defined(KIVI_DA_INTEGER)
  if (BITS != 8 && P.integer && integer_keys(BITS, G, D))
    return int8_packed_scores<(BITS < 8 ? BITS : 2)>(P, bh, g0, g1, q, scores, pos0);
#endif
  const uint8_t* codes = K.codes + bh * K.code_head;
  float scales[kMaxDim * kMetaGroups], zeros[kMaxDim * kMetaGroups], qs[4][kMaxDim], bias[4];
  float* out[4];
  // (decode_tasks.cpp read this chunk's codes and metadata into the caches when the task started)
  for (int64_t gb = g0; gb < g1; gb += kMetaGroups) {
    const int64_t block = min64(kMetaGroups, g1 - gb);
    if (K.pages == nullptr) {
      load_key_meta(K.scales, K.meta, bh * K.meta_head + gb, K.meta_row, D, block, scales);
      load_key_meta(K.zeros, K.meta, bh * K.meta_head + gb, K.meta_row, D, block, zeros);
    } else {  // a page's group: its D channels' metadata are contiguous
      for (int64_t i = 0; i < block; ++i) {
        const int64_t meta = K.pages[gb + i] * K.meta_page + bh * K.meta_head;
        load_row(K.scales, K.meta, meta, D, scales + i * kMaxDim);
        load_row(K.zeros, K.meta, meta, D, zeros + i * kMaxDim);
      }
    }
    for (int64_t i = 0; i < block; ++i) {
      const int64_t g = gb + i;
      const uint8_t* group_codes =
          K.pages == nullptr ? codes + g * (G * BITS / 8) : K.codes + K.pages[g] * K.code_page + bh * K.code_head;
      const int64_t pos = pos0 + (g - g0) * G;
      const float *scale = scales + i * kMaxDim, *zero = zeros + i * kMaxDim;
      for (int64_t r0 = 0; r0 < P.rows; r0 += 4) {
        const int nr = (int)min64(4, P.rows - r0);
        for (int j = 0; j < nr; ++j) {
          out[j] = scores + (r0 + j) * P.score_row + pos;
          const float* qr = q + (r0 + j) * D;
          for (int64_t d = 0; d < D; ++d) qs[j][d] = qr[d] * scale[d];
          bias[j] = dot(qr, zero, D);
        }
        with_row_count(nr, [&](auto rows) {
          key_group<BITS, decltype(rows)::kRows>(qs, bias, group_codes, K.code_row, D, G, out);
        });
      }
    }
  }
}

// ---- values -------------------------------------------------------------------------------------------------------

// Channels [ch, ch + NV * VW) of the exact values (token t's row at offset + t * stride_t) for NR rows:
// acc[r][ch..] += sum_t prob[r][t] * value_t, the sums in registers, token by token in order.
template <int NR, int NV>
inline void exact_value_channels(const Exact& values, int64_t offset, int64_t count, int64_t ch,
                                 const float* const* prob, float* const* acc) {
  vf a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = FV::load(acc[r] + ch + v * VW);
  for (int64_t t = 0; t < count; ++t) {
    vf x[NV];
    for (int v = 0; v < NV; ++v)
      x[v] = load_dtype<FV>(values.data, values.dtype, offset + t * values.stride_t + ch + v * VW);
    for (int r = 0; r < NR; ++r) {
      const vf p = FV::set1(prob[r][t]);
      for (int v = 0; v < NV; ++v) a[r][v] = FV::fma(p, x[v], a[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) FV::store(acc[r] + ch + v * VW, a[r][v]);
}

// Exact values, tokens [t0, t0 + count) of (b, h), probabilities at prob[r * score_row + pos0 + t]; acc rows `acc_row`
// floats apart.
inline void exact_values(const Problem& P, const Exact& values, int64_t b, int64_t h, int64_t t0, int64_t count,
                         const float* prob, int64_t pos0, float* acc, int64_t acc_row) {
  const int64_t Dv = P.value_dim, first = b * values.stride_b + h * values.stride_h + t0 * values.stride_t;
  for_row_sets(P, prob + pos0, P.score_row, acc, acc_row, [&](auto rows, const float* const* p, float* const* a) {
    constexpr int NR = decltype(rows)::kRows;
    constexpr int NV = VW >= 16 || NR <= 2 ? 4 : 2;  // the NR * NV sums, NV values and a weight in the registers
    int64_t ch = 0;
    for (; ch + NV * VW <= Dv; ch += NV * VW) exact_value_channels<NR, NV>(values, first, count, ch, p, a);
    for (; ch + VW <= Dv; ch += VW) exact_value_channels<NR, 1>(values, first, count, ch, p, a);
    for (; ch < Dv; ++ch)
      for (int r = 0; r < NR; ++r)
        for (int64_t t = 0; t < count; ++t)
          a[r][ch] += p[r][t] * load_scalar(values.data, values.dtype, first + t * values.stride_t + ch);
  });
}

// Tokens whose converted value metadata one block holds (their meta rows are adjacent: one vector conversion).
constexpr int64_t kMetaBlock = 1024;

// NV vectors of channels [ch, ch + NV * VW) of packed tokens [t0, t1) for NR rows: acc[r][ch..] += sum_t p_rt *
// scale_t(channel) * code_t(channel); prob[r] is indexed by packed token. Each vector lies in one value group.
// With ZEROS (when a token's zeros fit one vector) it also sums p_rt * zero_tg into zsum[r][g], interleaved with
// the codes' FMAs so that its dependency chains hide behind them.
template <int BITS, int NR, int NV, bool ZEROS>
inline void value_block(const Packed& V, const uint8_t* codes, int64_t meta0, int64_t t0, int64_t t1, int64_t ch,
                        const float* const* prob, float* const* acc, float (*zsum)[kMaxDim]) {
  constexpr int P = 8 / BITS;
  const int64_t row = V.meta_row;  // groups per token
  const int64_t block = max64(1, min64(64, kMetaBlock / row));
  int64_t group[NV];
  for (int v = 0; v < NV; ++v) group[v] = (ch + v * VW) / V.group;
  float scale[kMetaBlock + VW], zero[kMetaBlock + VW];  // + VW: a zero row is read as one whole vector
  vf a[NR][NV], z[NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    z[r] = FV::set1(0.0f);
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) a[r][v] = FV::set1(0.0f);
  }
  for (int64_t tb = t0; tb < t1; tb += block) {
    const int64_t te = min64(tb + block, t1);
    load_row(V.scales, V.meta, meta0 + tb * row, (te - tb) * row, scale);
    if (ZEROS) load_row(V.zeros, V.meta, meta0 + tb * row, (te - tb) * row, zero);
    for (int64_t t = tb; t < te; ++t) {
      const uint8_t* c = codes + t * V.code_row + ch / P;
      const float* s = scale + (t - tb) * row;
      vf p[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) p[r] = FV::set1(prob[r][t]);
      if (ZEROS) {  // lanes past the token's groups collect the next token's zeros: never read
        const vf zv = FV::load(zero + (t - tb) * row);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) z[r] = FV::fma(p[r], zv, z[r]);
      }
      vf code[NV];
      if (NV % 2 == 0) {
#pragma GCC unroll 16
        for (int v = 0; v < NV; v += 2) FV::load_codes_float2<BITS>(c + v * (VW / P), code[v], code[v + 1]);
      } else {
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) code[v] = FV::load_codes_float<BITS>(c + v * (VW / P));
      }
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const vf cs = FV::mul(code[v], FV::set1(s[group[v]]));
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) a[r][v] = FV::fma(p[r], cs, a[r][v]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) FV::store(acc[r] + ch + v * VW, FV::add(FV::load(acc[r] + ch + v * VW), a[r][v]));
  if (ZEROS)
    for (int r = 0; r < NR; ++r) FV::store(zsum[r], z[r]);
}

// zsum[r][g] = sum_t p_rt * zero_tg over packed tokens [t0, t1): in registers when a token's zeros fit a vector.
template <int NR>
inline void zero_sums(const Packed& V, int64_t meta0, int64_t t0, int64_t t1, int64_t groups,
                      const float* const* prob, float (*zsum)[kMaxDim]) {
  float zero[kMaxDim];
  if (groups <= VW) {
    for (int i = 0; i < VW; ++i) zero[i] = 0.0f;
    vf z[NR];
    for (int r = 0; r < NR; ++r) z[r] = FV::set1(0.0f);
    for (int64_t t = t0; t < t1; ++t) {
      load_row(V.zeros, V.meta, meta0 + t * V.meta_row, groups, zero);
      const vf zv = FV::load(zero);
      for (int r = 0; r < NR; ++r) z[r] = FV::fma(FV::set1(prob[r][t]), zv, z[r]);
    }
    for (int r = 0; r < NR; ++r) FV::store(zsum[r], z[r]);
    return;
  }
  for (int r = 0; r < NR; ++r)
    for (int64_t g = 0; g < groups; ++g) zsum[r][g] = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    load_row(V.zeros, V.meta, meta0 + t * V.meta_row, groups, zero);
    for (int r = 0; r < NR; ++r) axpy(prob[r][t], zero, zsum[r], groups);
  }
}

// Packed tokens [t0, t1) whose token t has its codes at codes + t * code_row and metadata at meta0 + t * meta_row.
template <int BITS, int NR>
void value_rows(const Problem& P, const uint8_t* codes, int64_t meta0, int64_t t0, int64_t t1,
                const float* const* prob, float* const* acc) {
  const Packed& V = P.values;
  const int64_t Dv = P.value_dim, G = V.group, groups = Dv / G;
  constexpr int NV = VW >= 16 ? 4 : 2;  // accumulators NR * NV stay in registers
  float zsum[NR][kMaxDim];
  bool zeros_done = false;
  int64_t ch = 0;
#if defined(KIVI_DA_INTEGER)
  const auto locate = [&](int64_t t, const uint8_t** at, int64_t* meta) {
    *at = codes + t * V.code_row;
    *meta = meta0 + t * V.meta_row;
  };
  if (BITS != 8 && P.integer && integer_values(BITS, G) &&
      int8_value_rows<(BITS < 8 ? BITS : 2), NR>(V, locate, t0, t1, Dv, prob, acc))
    return;
#endif
  if (G % VW == 0) {  // whole vectors per group; the first block also sums the zeros when they fit a vector
    for (; ch + NV * VW <= Dv; ch += NV * VW) {
      if (!zeros_done && groups <= VW) {
        value_block<BITS, NR, NV, true>(V, codes, meta0, t0, t1, ch, prob, acc, zsum);
        zeros_done = true;
      } else {
        value_block<BITS, NR, NV, false>(V, codes, meta0, t0, t1, ch, prob, acc, zsum);
      }
    }
    for (; ch + VW <= Dv; ch += VW) {
      if (!zeros_done && groups <= VW) {
        value_block<BITS, NR, 1, true>(V, codes, meta0, t0, t1, ch, prob, acc, zsum);
        zeros_done = true;
      } else {
        value_block<BITS, NR, 1, false>(V, codes, meta0, t0, t1, ch, prob, acc, zsum);
      }
    }
  }
  for (; ch < Dv; ++ch) {  // small groups, or channels past the last whole vector
    for (int r = 0; r < NR; ++r) {
      float s = 0.0f;
      for (int64_t t = t0; t < t1; ++t)
        s += prob[r][t] * (load_scalar(V.scales, V.meta, meta0 + t * V.meta_row + ch / G) *
                           scalar_code<BITS>(codes + t * V.code_row, ch));
      acc[r][ch] += s;
    }
  }
  // The zeros: sum_t p_t * z_tg once per group, added to the group's channels.
  if (!zeros_done) zero_sums<NR>(V, meta0, t0, t1, groups, prob, zsum);
  for (int r = 0; r < NR; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t d = g * G; d < (g + 1) * G; ++d) acc[r][d] += zsum[r][g];
}

// Paged packed tokens [t0, t1) of (batch, kv head) bh for NR rows, prob[r] indexed by packed token: one pass of the
// integer path over all their pages when each page holds whole blocks of its factors (else, or for a non-finite
// weight, page by page): a page of 32 tokens is one block, and a call per page repeated the sums' set-up and
// epilogue for each. In one process (4 requests x 8064 tokens of SmolLM2-135M histories, Zen 4, 30 layers in turn):
// 1.18 -> 1.11 ms per call; 1 request: 0.312 -> 0.300 ms.
template <int BITS, int NR>
void paged_value_rows(const Problem& P, int64_t bh, int64_t t0, int64_t t1, const float* const* prob,
                      float* const* acc) {
  const Packed& V = P.values;
  const int64_t T = V.page_tokens;
#if defined(KIVI_DA_INTEGER)
  if (BITS != 8 && P.integer && integer_values(BITS, V.group) && T % kValueBlock<(BITS < 8 ? BITS : 2)> == 0 &&
      t0 % T == 0) {
    const auto locate = [&](int64_t t, const uint8_t** at, int64_t* meta) {
      const int64_t page = t / T, block = V.pages[page], row = t - page * T;
      *at = V.codes + block * V.code_page + bh * V.code_head + row * V.code_row;
      *meta = block * V.meta_page + bh * V.meta_head + row * V.meta_row;
    };
    if (int8_value_rows<(BITS < 8 ? BITS : 2), NR>(V, locate, t0, t1, P.value_dim, prob, acc)) return;
  }
#endif
  for (int64_t first = t0; first < t1;) {
    const int64_t page = first / T, last = min64(t1, (page + 1) * T), block = V.pages[page];
    const float* page_prob[NR];
    for (int r = 0; r < NR; ++r) page_prob[r] = prob[r] + page * T;
    value_rows<BITS, NR>(P, V.codes + block * V.code_page + bh * V.code_head, block * V.meta_page + bh * V.meta_head,
                         first - page * T, last - page * T, page_prob, acc);
    first = last;
  }
}

// Packed tokens [t0, t1) of (batch, kv head) bh, probabilities at prob[r * score_row + pos_of_t0 + t - t0]: one run
// of contiguous storage, or the pages of paged storage.
template <int BITS>
void packed_values(const Problem& P, int64_t bh, int64_t t0, int64_t t1, const float* prob, int64_t pos_of_t0,
                   float* acc, int64_t acc_row) {
  const Packed& V = P.values;
  const float* prob_of_token0 = prob + pos_of_t0 - t0;  // indexed by packed token
  for_row_sets(P, prob_of_token0, P.score_row, acc, acc_row, [&](auto rows, const float* const* p, float* const* a) {
    constexpr int NR = decltype(rows)::kRows;
    if (V.pages == nullptr)
      value_rows<BITS, NR>(P, V.codes + bh * V.code_head, bh * V.meta_head, t0, t1, p, a);
    else
      paged_value_rows<BITS, NR>(P, bh, t0, t1, p, a);
  });
}

// ---- softmax of one chunk -----------------------------------------------------------------------------------------

// Softcap and mask on row r's scores [p0, p1), then exp(score - max) in place. Returns the chunk max (-inf if all
// are masked; NaN if all are masked or NaN and one is NaN) and stores the sum of the exponentials in `sum`. The max
// ignores NaN, but exp(NaN - max) is NaN, so a NaN score still reaches the sum and the output.
inline float chunk_softmax(const Problem& P, int64_t b, int64_t h, int64_t r, float* s, int64_t p0, int64_t p1,
                           float* sum) {
  const int64_t hq = h * P.q_per_kv + r / P.length, l = r % P.length;
  if (P.softcap != 0.0f)
    for (int64_t i = p0; i < p1; ++i) s[i] = P.softcap * __builtin_tanhf(s[i] / P.softcap);
  const int64_t mask_base = b * P.mask_sb + hq * P.mask_sh + l * P.mask_sl + P.mask_col0 * P.mask_sc;
  if (P.mask_kind == kMaskBool) {
    const uint8_t* mask = static_cast<const uint8_t*>(P.mask) + mask_base;
    for (int64_t i = p0; i < p1; ++i) s[i] = mask[i * P.mask_sc] ? s[i] : kNegInf;
  } else if (P.mask_kind == kMaskFloat) {
    const float* mask = static_cast<const float*>(P.mask) + mask_base;
    for (int64_t i = p0; i < p1; ++i) s[i] += mask[i * P.mask_sc];
  } else if (P.length > 1) {  // no mask: the queries are the last L positions, causal
    for (int64_t i = max64(p0, P.n - P.length + l + 1); i < p1; ++i) s[i] = kNegInf;
  }
  vf mv = FV::set1(kNegInf);
  int64_t i = p0;
  for (; i + VW <= p1; i += VW) mv = FV::max(FV::load(s + i), mv);  // maxps: mv where s is NaN
  float m = FV::reduce_max(mv);
  for (; i < p1; ++i) m = s[i] > m ? s[i] : m;
  if (m == kNegInf) {  // all masked, or NaN: weight 0 (the values still meet them, as 0 * value, like a dense product)
    bool nan = false;
    for (int64_t k = p0; k < p1; ++k) nan |= s[k] != s[k];
    if (nan) m = __builtin_nanf("");
    for (int64_t k = p0; k < p1; ++k) s[k] = nan ? m : 0.0f;
    *sum = nan ? m : 0.0f;
    return m;
  }
  const vf minus_m = FV::set1(-m);
  vf acc = FV::set1(0.0f);
  for (i = p0; i + VW <= p1; i += VW) {
    const vf e = FV::exp(FV::add(FV::load(s + i), minus_m));
    FV::store(s + i, e);
    acc = FV::add(acc, e);
  }
  float total = FV::reduce_add(acc);
  for (; i < p1; ++i) {
    s[i] = __builtin_expf(s[i] - m);
    total += s[i];
  }
  *sum = total;
  return m;
}

// ---- one task -----------------------------------------------------------------------------------------------------

inline void run_chunk(const Problem& P, int64_t task) {
  const TaskSpan span = task_span(P, task);
  const int64_t bh = span.bh, b = bh / P.kv_heads, h = bh % P.kv_heads, p0 = span.p0, p1 = span.p1;
  const int64_t S = P.sinks, D = P.head_dim;
  const float* q = P.query + bh * P.rows * D;
  const float* packed_q = P.packed_query + bh * P.rows * D;
  float* scores = task_scores(P, p0);
  const int64_t acc_row = P.acc_row;
  float* partial = P.partials + task * P.rows * acc_row;

  // Scores: sinks [0, S), packed [S, S + kc), tail [S + kc, n), each clipped to the chunk.
  const int64_t kc = P.keys.count, k0 = max64(p0, S), k1 = min64(p1, S + kc), tail0 = max64(p0, S + kc);
  {
    PhaseTimer timer(kPhaseExactScores);
    if (p0 < S) exact_scores(P, P.key_sinks, b, h, p0, min64(p1, S) - p0, q, scores, p0);
    if (tail0 < p1) exact_scores(P, P.key_tail, b, h, tail0 - S - kc, p1 - tail0, q, scores, tail0);
  }
  if (k0 < k1) {
    PhaseTimer timer(kPhasePackedScores);
    const int64_t g0 = (k0 - S) / P.keys.group, g1 = (k1 - S) / P.keys.group;
    switch (P.keys.bits) {
      case 2: packed_scores<2>(P, bh, g0, g1, packed_q, scores, k0); break;
      case 4: packed_scores<4>(P, bh, g0, g1, packed_q, scores, k0); break;
      default: packed_scores<8>(P, bh, g0, g1, packed_q, scores, k0); break;
    }
  }

  {
    PhaseTimer timer(kPhaseSoftmax);
    for (int64_t r = 0; r < P.rows; ++r) {
      float* out = partial + r * acc_row;
      out[0] = chunk_softmax(P, b, h, r, scores + r * P.score_row, p0, p1, out + 1);
      for (int64_t d = 0; d < P.acc_width; ++d) out[kAccOffset + d] = 0.0f;
    }
  }

  // Values: sinks [0, S), packed [S, S + vc), tail [S + vc, n).
  const int64_t vc = P.values.count, v0 = max64(p0, S), v1 = min64(p1, S + vc), vt0 = max64(p0, S + vc);
  float* acc = partial + kAccOffset;
  float* packed_acc = acc + P.packed_acc;  // a separate sum for rotated packed values (or the same)
  if (p0 < S) {
    PhaseTimer timer(kPhaseExactValues);
    exact_values(P, P.value_sinks, b, h, p0, min64(p1, S) - p0, scores, p0, acc, acc_row);
  }
  if (v0 < v1) {
    PhaseTimer timer(kPhasePackedValues);
    switch (P.values.bits) {
      case 2: packed_values<2>(P, bh, v0 - S, v1 - S, scores, v0, packed_acc, acc_row); break;
      case 4: packed_values<4>(P, bh, v0 - S, v1 - S, scores, v0, packed_acc, acc_row); break;
      default: packed_values<8>(P, bh, v0 - S, v1 - S, scores, v0, packed_acc, acc_row); break;
    }
  }
  if (vt0 < p1) {  // (after the packed values, which may add to the same sums: the order the twins add in)
    PhaseTimer timer(kPhaseExactValues);
    exact_values(P, P.value_tail, b, h, vt0 - S - vc, p1 - vt0, scores, vt0, acc, acc_row);
  }
}

}  // namespace

void KIVI_DA_ENTRY(const Problem& p, int64_t task) { run_chunk(p, task); }

// Columns [j, j + NV * VW) of each row: o_j += sum_d x_d * m_dj, d in order (as an axpy per d would add them), the
// sums in registers across d. An axpy per d into the output row in memory chained every d on a store and a reload of
// the row: in the model (SmolLM2-135M, batch 4 / 8064, Zen 4; 36 rows) the query rows with their key rotation took
// 17.5 us per call and the rotation back of the packed sums 11.5 us; with the sums in registers 7.8 and 4.5 us.
template <int NV>
inline void column_block(const float* x, const float* m, int64_t dim, int64_t j, float* o, bool accumulate) {
  vf acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = accumulate ? FV::load(o + j + c * VW) : FV::set1(0.0f);
  for (int64_t d = 0; d < dim; ++d) {
    const vf xd = FV::set1(x[d]);
    for (int c = 0; c < NV; ++c) acc[c] = FV::fma(xd, FV::load(m + d * dim + j + c * VW), acc[c]);
  }
  for (int c = 0; c < NV; ++c) FV::store(o + j + c * VW, acc[c]);
}

void KIVI_DA_ROWS_TIMES(const float* x, const float* m, int64_t rows, int64_t dim, float* out, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    int64_t j = 0;
    for (; j + 4 * VW <= dim; j += 4 * VW) column_block<4>(xr, m, dim, j, o, accumulate);
    for (; j + VW <= dim; j += VW) column_block<1>(xr, m, dim, j, o, accumulate);
    for (; j < dim; ++j) {
      float sum = accumulate ? o[j] : 0.0f;
      for (int64_t d = 0; d < dim; ++d) sum += xr[d] * m[d * dim + j];
      o[j] = sum;
    }
  }
}

void KIVI_DA_ROTATE_ROWS(const void* x, Dtype dtype, int64_t rows, int64_t dim, const float* m, float* out) {
  float row[kMaxDim];
  for (int64_t r = 0; r < rows; ++r) {
    load_row(x, dtype, r * dim, dim, row);
    KIVI_DA_ROWS_TIMES(row, m, 1, dim, out + r * dim, false);
  }
}

}  // namespace kivi::cpu::decode
