// Integer dot products of the fused decode attention on packed 2- and 4-bit codes (the `int8` arithmetic of
// KIVI_XPU_CPU_DOT). Included by decode_attention_impl.h inside its anonymous namespace, after its vector layer, in
// the AVX2 and AVX-512 translation units (AVX2 instructions on 256-bit vectors; both ISAs run this code).
// The pure-PyTorch twin is kivi_xpu/ops/integer_twin.py: same rounding, same blocks, same fallbacks.
//
// Both products multiply the unsigned codes by 8-bit factors with vpmaddubsw (adjacent pairs summed into int16),
// add the int16 lanes over a few steps, widen them with vpmaddwd and convert once per key group / value block; with
// AVX-512 VNNI (the avx512_vnni ISA) one vpdpbusd sums the same 4 products straight into int32 (`DotSum`: the same
// integers, one instruction instead of three):
//   keys, group g, query row r:   score_t = a_rg * sum_d qi_rgd * c_td + sum_d q_rd * z_gd        (zeros in fp32)
//     qi_rgd = round(q_rd * s_gd * 127 / m_rg) in [-127, 127], a_rg = m_rg / 127, m_rg = max_d |q_rd * s_gd|
//   values, block B of tokens, channel group g:   out_rd += b_rBg * sum_{t in B} wi_rtg * c_td  (zeros in fp32)
//     wi_rtg = round(p_rt * s_tg * 255 / m_rBg) in [0, 255], b_rBg = m_rBg / 255, m_rBg = max_{t in B} p_rt * s_tg
// (round: to nearest, ties to even). Each key group's qi and each value block's wi are computed from fp32 values the
// fp32 path would use, so the only extra error is their 8-bit rounding: at most half a step per factor.
//
// The codes are read in place: a tile is 4 rows of 8 bytes `row` bytes apart (4 key channels of 8P tokens, or 4
// value tokens of 8P channels; P = 8 / BITS codes per byte), transposed in registers so that int32 lane j holds the
// 4 rows' byte j; plane k of the tile (bits [k*BITS, (k+1)*BITS) of every byte) then holds in lane j the 4 rows'
// codes number P*j + k, which vpmaddubsw multiplies by 4 factors of the reduction axis at once.
#if !defined(KIVI_SIMD_AVX512) && !defined(KIVI_SIMD_AVX2)
#error "decode_int8.h needs AVX2"
#endif

// Tokens of a key tile and of a value block; channels of a value tile. Blocks keep the int16 sums exact:
// 2 bits: 8 steps of at most 2 * 3 * 255 = 1530; 4 bits: 4 steps of at most 2 * 15 * 255 = 7650 (< 32767).
template <int BITS>
constexpr int64_t kTileCodes = 64 / BITS;
template <int BITS>
constexpr int64_t kValueBlock = BITS == 2 ? 32 : 16;
// Channel quads of a key tile summed in int16 before widening: 2 * (2^BITS - 1) * 127 per step.
template <int BITS>
constexpr int64_t kKeyFlush = BITS == 2 ? 32 : 8;

// Whether the integer path serves the packed keys / values of these settings (else the fp32 path does).
inline bool integer_keys(int64_t bits, int64_t group, int64_t head_dim) {
  return (bits == 2 || bits == 4) && head_dim % 4 == 0 && group % (64 / bits) == 0;
}
inline bool integer_values(int64_t bits, int64_t group) { return (bits == 2 || bits == 4) && group % (64 / bits) == 0; }

// int32 lane j (< 8) = bytes [p[j], p[row + j], p[2 row + j], p[3 row + j]].
inline __m256i tile4x8(const uint8_t* p, int64_t row) {
  const __m128i r0 = _mm_loadl_epi64((const __m128i*)p), r1 = _mm_loadl_epi64((const __m128i*)(p + row));
  const __m128i r2 = _mm_loadl_epi64((const __m128i*)(p + 2 * row));
  const __m128i r3 = _mm_loadl_epi64((const __m128i*)(p + 3 * row));
  const __m128i a = _mm_unpacklo_epi8(r0, r1), b = _mm_unpacklo_epi8(r2, r3);
  return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}

// Plane k of a tile: every byte's code number k (a logical shift of 16-bit lanes moves the next byte's low bits into
// this byte's high bits; the mask drops them), as c * 2^e with e = plane_exponent<BITS, LIMIT>(k). With int32 sums
// (VNNI) a code stays where it is in its byte as far as its operand allows (LIMIT bits: 8 as the unsigned operand, 7 as
// the signed one), and the caller multiplies the plane's scale by 2^-e: the sum is 2^e times the codes' sum, exact in
// fp32 (below 2^24 for every shape integer_keys / integer_values admit), so the results are the same unless a scale is
// below ~2^-120. The saved shifts made the key groups measurably faster (values, which keep one shift for 2-bit codes,
// did not change; docs/measurements.md). Without VNNI, vpmaddubsw's int16 pair sums would overflow: every plane is
// shifted down (e = 0).
template <int BITS, int LIMIT>
constexpr int plane_exponent(int k) {
#if defined(KIVI_SIMD_VNNI)
  return k * BITS <= LIMIT - BITS ? k * BITS : LIMIT - BITS;
#else
  return 0 * k;
#endif
}
template <int BITS, int LIMIT>
inline __m256i plane(__m256i tile, int k) {
  const int e = plane_exponent<BITS, LIMIT>(k), shift = k * BITS - e;
  const __m256i shifted = shift == 0 ? tile : _mm256_srl_epi16(tile, _mm_cvtsi32_si128(shift));
  return _mm256_and_si256(shifted, _mm256_set1_epi8((char)(((1 << BITS) - 1) << e)));
}
// 2^-e for plane k (see plane).
template <int BITS, int LIMIT>
inline float plane_weight(int k) {
  return 1.0f / float(1 << plane_exponent<BITS, LIMIT>(k));
}

// Sums of u8 x s8 products, 4 adjacent bytes per int32 lane: add() accumulates, widen() turns the accumulator into
// int32 lanes. Without VNNI the accumulator is int16 pairs (exact while the kKeyFlush / kValueBlock bounds hold).
struct DotSum {
#if defined(KIVI_SIMD_VNNI)
  // In asm, the accumulator tied to its register: with _mm256_dpbusd_epi32, GCC 12 copied every accumulator of the
  // tile loops to another register and back around each vpdpbusd (24 extra moves per 12 products in the 3-row loops),
  // which made the warm op measurably slower (in the model: within the noise; docs/measurements.md).
  static __m256i add(__m256i acc, __m256i u8, __m256i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));  // AT&T order: s8, u8, acc
    return acc;
  }
  static __m256i widen(__m256i acc) { return acc; }
#else
  static __m256i add(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(u8, s8), acc);
  }
  static __m256i widen(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif
};

inline __m256i broadcast4(const void* p) {
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

// ---- keys -------------------------------------------------------------------------------------------------------

// The key factors of up to 4 query rows for a block of kBlockGroups key groups, the groups in the vector lanes (the
// metadata's channel-major order: no horizontal reductions, no transposes of the metadata). For row r, channel quad
// x and group i, q[r][x][i] holds the int8 factors of channels 4x..4x+3 as one int32 (what the dot loop broadcasts);
// a[r][i] = max |qs| / 127 and bias[r][i] = q . zero of group i; bit i of `finite` is set when group i's q * s are
// finite for every row (else the fp32 path scores that group).
constexpr int64_t kBlockGroups = 8;
struct KeyBlockFactors {
  alignas(32) int32_t q[4][kMaxDim / 4][kBlockGroups];
  alignas(32) float a[4][kBlockGroups], bias[4][kBlockGroups];
  int finite;
};

// Fills `f` for NR rows q[r] (D floats each) from the block's scales and zeros, channel-major: meta8(0, d) and
// meta8(1, d) give channel d's scales and zeros of the block's groups in fp32 (lane i: group i; zeros in the lanes of
// absent groups): qs = q * s, m = max |qs|, factors round(qs * (127 / m)) to nearest even, a = m / 127 (all zero where
// m == 0). The loader reads contiguous storage in place (a channel's groups are side by side), converting as it loads.
template <int NR, typename Meta8>
inline void key_block_factors(const float* const* q, Meta8 meta8, int64_t D, KeyBlockFactors* f) {
  static_assert(kBlockGroups == 8, "a block's groups are the 8 lanes of one __m256");
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // Chains per row: with AVX-512's 32 registers two (the max and the FMA wait on their previous channel); AVX2's 16
  // hold one, beside the scales and zeros converted in the loop (two spilled).
#if defined(KIVI_SIMD_AVX512)
  constexpr int C = 2;
#else
  constexpr int C = 1;
#endif
  __m256 m[NR][2], bias[NR][2];
  alignas(32) float qs[NR][kMaxDim][kBlockGroups];  // q * s, kept for the rounding below (a load, not two and a mul)
  for (int r = 0; r < NR; ++r) m[r][0] = m[r][1] = bias[r][0] = bias[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += C) {  // D % 4 == 0
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      const __m256 s = meta8(0, d + c), z = meta8(1, d + c);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m256 qd = _mm256_set1_ps(q[r][d + c]), x = _mm256_mul_ps(qd, s);
        _mm256_store_ps(qs[r][d + c], x);
        m[r][c] = _mm256_max_ps(_mm256_andnot_ps(sign, x), m[r][c]);  // a NaN lane is dropped: the rounding catches it
        bias[r][c] = _mm256_fmadd_ps(qd, z, bias[r][c]);
      }
    }
  }
  // int32 lane i of a 4x4 byte transpose within each 128-bit half: the 4 channels' factors of group i
  const __m256i by_group = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,  //
                                            0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256 limit = _mm256_set1_ps(__FLT_MAX__);
  int finite = (1 << kBlockGroups) - 1;
  for (int r = 0; r < NR; ++r) {
    const __m256 mx = _mm256_max_ps(m[r][0], m[r][1]);
    _mm256_store_ps(f->a[r], _mm256_div_ps(mx, _mm256_set1_ps(127.0f)));
    _mm256_store_ps(f->bias[r], _mm256_add_ps(bias[r][0], bias[r][1]));
    // 127 / m, 0 where m == 0 (all factors 0); an Inf m gives 0 too, and Inf * 0 = NaN is caught below
    const __m256 positive = _mm256_cmp_ps(mx, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(127.0f), mx), positive);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(mx, limit, _CMP_LE_OQ));
    __m256i bad = _mm256_setzero_si256();
    for (int64_t x = 0; x < D / 4; ++x) {
      __m256i v[4];
      for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(qs[r][4 * x + k]), inv));
      }
      // packs keep 128-bit halves: bytes 4k + i (i < 4) of each half come from v[k] lane i (low half) or 4 + i
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      // vcvtps2dq gives INT32_MIN for NaN, which saturates to -128: a finite |qs * inv| <= 127 never does
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(bytes, _mm256_set1_epi8(-128)));
      _mm256_store_si256((__m256i*)f->q[r][x], _mm256_shuffle_epi8(bytes, by_group));
    }
    // bad bytes sit at bytes 4k + i of each half, i.e. in no fixed lane: shuffle them by group too
    bad = _mm256_shuffle_epi8(bad, by_group);
    finite &= _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bad, _mm256_setzero_si256())));
  }
  f->finite = finite;
}

// Scores of group i of a block for NR rows, G tokens (a multiple of kTileCodes): out[r][t] = a * sum_d qi_d * c_td +
// bias with row r's factors of that group in f. codes points at channel 0's first byte of the group, channels
// `code_row` bytes apart; D % 4 == 0.
template <int BITS, int NR>
inline void int8_key_group(const KeyBlockFactors& f, int64_t i, const uint8_t* codes, int64_t code_row, int64_t D,
                           int64_t G, float* const* out) {
  constexpr int P = 8 / BITS;
  // Planes per pass: up to 12 int16 sums in registers (with 3 rows a few spill, which measured faster than a second
  // pass over the tiles); 4 rows of 2-bit codes take two passes of 2 planes.
  constexpr int KH = NR * P <= 12 ? P : P / 2;
  // int32 sums (VNNI) need no flush
#if defined(KIVI_SIMD_VNNI)
  const int64_t flush = D / 4;
#else
  const int64_t flush = kKeyFlush<BITS>;
#endif
  for (int64_t tile = 0; tile * kTileCodes<BITS> < G; ++tile) {
    const uint8_t* c = codes + tile * 8;
    alignas(32) int32_t sum[NR][P][8];  // in memory: only the int16 sums of one pass live in registers
#pragma GCC unroll 2
    for (int k0 = 0; k0 < P; k0 += KH) {
      for (int64_t q0 = 0; q0 < D / 4; q0 += flush) {
        const int64_t q1 = min64(q0 + flush, D / 4);
        __m256i acc[NR][KH];
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
          for (int k = 0; k < KH; ++k) acc[r][k] = _mm256_setzero_si256();
        for (int64_t q = q0; q < q1; ++q) {
          const __m256i t = tile4x8(c + 4 * q * code_row, code_row);
          __m256i w[NR];
#pragma GCC unroll 16
          for (int r = 0; r < NR; ++r) w[r] = _mm256_set1_epi32(f.q[r][q][i]);
#pragma GCC unroll 16
          for (int k = 0; k < KH; ++k) {
            const __m256i pl = plane<BITS, 8>(t, k0 + k);  // the codes are the unsigned operand
#pragma GCC unroll 16
            for (int r = 0; r < NR; ++r) acc[r][k] = DotSum::add(acc[r][k], pl, w[r]);
          }
        }
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
          for (int k = 0; k < KH; ++k) {
            __m256i* to = (__m256i*)sum[r][k0 + k];
            const __m256i widened = DotSum::widen(acc[r][k]);
            _mm256_store_si256(to, q0 == 0 ? widened : _mm256_add_epi32(_mm256_load_si256(to), widened));
          }
      }
    }
    // Lane j of plane k is token P * j + k of the tile: transpose the planes back into token order.
    for (int r = 0; r < NR; ++r) {
      const float a = f.a[r][i];
      const __m256 b = _mm256_set1_ps(f.bias[r][i]);
      __m256 f[P];
      for (int k = 0; k < P; ++k) {
        const __m256 scale = _mm256_set1_ps(a * plane_weight<BITS, 8>(k));
        f[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)sum[r][k])), scale, b);
      }
      float* o = out[r] + tile * kTileCodes<BITS>;
      if (P == 4) {  // f[k][j] -> o[4 j + k]
        const __m256 t0 = _mm256_unpacklo_ps(f[0], f[1]), t1 = _mm256_unpackhi_ps(f[0], f[1]);
        const __m256 t2 = _mm256_unpacklo_ps(f[2 % P], f[3 % P]), t3 = _mm256_unpackhi_ps(f[2 % P], f[3 % P]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u1, 0x20));
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
        _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
        _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
      } else {  // P == 2: f[k][j] -> o[2 j + k]
        const __m256 lo = _mm256_unpacklo_ps(f[0], f[1 % P]), hi = _mm256_unpackhi_ps(f[0], f[1 % P]);
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
    }
  }
}

// ---- values -----------------------------------------------------------------------------------------------------

constexpr int64_t kMaxValueGroups = kMaxDim / 16;  // integer_values: a group holds at least 16 channels

// Per 128-bit half: max(a0, a1), max(a2, a3), max(b0, b1), max(b2, b3).
inline __m256 max_pairs(__m256 a, __m256 b) {
  return _mm256_max_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}
// The max over the lanes of each of m[0, 8) -> lane i of the result (a transpose that reduces as it goes: 7 maxes and
// 14 shuffles for 8 vectors, against 6 operations and a dependent chain per vector for Vec256::reduce_max).
inline __m256 lane_maxes8(const __m256 m[8]) {
  const __m256 m0123 = max_pairs(max_pairs(m[0], m[1]), max_pairs(m[2], m[3]));  // per half: m0..m3's maxes over it
  const __m256 m4567 = max_pairs(max_pairs(m[4], m[5]), max_pairs(m[6], m[7]));
  return _mm256_max_ps(_mm256_permute2f128_ps(m0123, m4567, 0x20), _mm256_permute2f128_ps(m0123, m4567, 0x31));
}

// A row's factors of a value block, [quad][group][token]: the byte offset of group g's factors of tokens
// [4q, 4q + 4) (one int32, what the products broadcast). In this order a block's factors are one run, written by
// value_factors_in_order without a transpose of the metadata.
constexpr int64_t kValueFactorBytes = 32 * kMaxValueGroups;
inline int64_t factor_quad(int64_t q, int64_t g, int64_t groups) { return (q * groups + g) * 4; }

// Block factors of NR rows and `groups` value groups, TB tokens, the metadata by group (block_meta): for row r and
// group g, w[0, TB) = p_r * s_g -> wi[r] (factor_quad) = round(w * 255 / max w), b[r][g] = max w / 255, and
// zsum[r][g] += p_r * z_g (lane-wise). False when a weight is not finite. Eight (row, group) pairs at a time share one
// reduction of their maxes and two vector divisions (one max reduction and two scalar divisions per pair took a
// quarter of the factors' time).
template <int64_t TB, int NR>
inline bool value_block_factors(const float* const* p, const float (*scale)[TB], const float (*zero)[TB],
                                int64_t groups, uint8_t (*wi)[kValueFactorBytes], float (*b)[kMaxValueGroups],
                                __m256 (*zsum)[kMaxValueGroups]) {
  static_assert(TB == 16 || TB == 32, "two or four vectors of 8 factors");
  constexpr int V = TB / 8;
  const __m256i nan_code = _mm256_set1_epi16(-32768);
  __m256i bad = _mm256_setzero_si256();
  const int64_t pairs = NR * groups;
  for (int64_t i0 = 0; i0 < pairs; i0 += 8) {
    const int n = (int)min64(8, pairs - i0);
    __m256 w[8][V], m[8];
    for (int j = 0; j < 8; ++j) m[j] = _mm256_setzero_ps();
    for (int j = 0; j < n; ++j) {
      const int64_t r = (i0 + j) / groups, g = (i0 + j) % groups;
      for (int v = 0; v < V; ++v) {
        const __m256 pv = _mm256_loadu_ps(p[r] + 8 * v);
        w[j][v] = _mm256_mul_ps(pv, _mm256_loadu_ps(scale[g] + 8 * v));
        m[j] = _mm256_max_ps(w[j][v], m[j]);  // a NaN weight is dropped here and caught below
        zsum[r][g] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(zero[g] + 8 * v), zsum[r][g]);
      }
    }
    const __m256 mx = lane_maxes8(m);
    // 255 / max, 0 where max == 0 (all factors 0); an Inf max gives 0 too, and Inf * 0 is NaN below
    const __m256 positive = _mm256_cmp_ps(mx, _mm256_setzero_ps(), _CMP_GT_OQ);
    alignas(32) float inv[8], step[8];
    _mm256_store_ps(inv, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(255.0f), mx), positive));
    _mm256_store_ps(step, _mm256_div_ps(mx, _mm256_set1_ps(255.0f)));
    for (int j = 0; j < n; ++j) {
      const int64_t r = (i0 + j) / groups, g = (i0 + j) % groups;
      b[r][g] = step[j];
      const __m256 scale_j = _mm256_set1_ps(inv[j]);
      __m256i q[4];
      for (int v = 0; v < V; ++v) q[v] = _mm256_cvtps_epi32(_mm256_mul_ps(w[j][v], scale_j));  // nearest even, <= 255
      if (V == 2) q[2] = q[0], q[3] = q[1];
      const __m256i words01 = _mm256_packs_epi32(q[0], q[1]), words23 = _mm256_packs_epi32(q[2], q[3]);
      // vcvtps2dq gives INT32_MIN for NaN, saturated to -32768 here; a finite factor is 0..255
      bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpeq_epi16(words01, nan_code),
                                                 _mm256_cmpeq_epi16(words23, nan_code)));
      // packs interleave 128-bit lanes: the 4-byte units come out as q0lo q1lo q2lo q3lo q0hi q1hi q2hi q3hi
      const __m256i bytes = _mm256_packus_epi16(words01, words23);
      const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      alignas(32) uint8_t in_order[32];
      _mm256_store_si256((__m256i*)in_order, ordered);
      for (int64_t q = 0; q < TB / 4; ++q) __builtin_memcpy(wi[r] + factor_quad(q, g, groups), in_order + 4 * q, 4);
    }
  }
  return _mm256_testz_si256(bad, bad);
}

// Lane l = p[l / GROUPS]: a row's probabilities spread over the lanes of GROUPS groups (8 / GROUPS tokens).
template <int GROUPS>
inline __m256 spread_probs(const float* p) {
  if constexpr (GROUPS == 1) return _mm256_loadu_ps(p);
  if constexpr (GROUPS == 8) return _mm256_broadcast_ss(p);
  if constexpr (GROUPS == 2) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));  // GROUPS == 4
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Lane l = the max of the lanes of x that hold l's group (those l % GROUPS apart).
template <int GROUPS>
inline __m256 group_maxes(__m256 x) {
  if constexpr (GROUPS <= 4) x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
  if constexpr (GROUPS <= 2) x = _mm256_max_ps(x, _mm256_permute_ps(x, 0x4E));
  if constexpr (GROUPS == 1) x = _mm256_max_ps(x, _mm256_permute_ps(x, 0xB1));
  return x;
}

// value_block_factors for GROUPS (1, 2, 4 or 8) groups with the metadata in its storage order, [token][group]:
// meta8(array, v) gives elements [8v, 8v + 8) of the block's scales (array 0) or zeros (1) in fp32, so lane l of every
// vector is group l % GROUPS, and each row's probabilities are spread to match (spread_probs). The maxima, the
// rounding and the zero sums then work lane by lane: no transpose of the metadata, and one reduction per row.
// zsum[r] collects p * z with lane l in group l % GROUPS.
template <int64_t TB, int NR, int GROUPS, typename Meta8>
inline bool value_factors_in_order(const float* const* p, Meta8 meta8, uint8_t (*wi)[kValueFactorBytes],
                                   float (*b)[kMaxValueGroups], __m256* zsum) {
  constexpr int V = int(TB) * GROUPS / 8, PER = 8 / GROUPS;  // vectors of a row's block; tokens per vector
  static_assert(V == 2 || V % 4 == 0, "whole batches of 4 vectors (or the 16 factors of one group)");
  alignas(32) float w[NR][V][8];
  __m256 m[NR];
  for (int r = 0; r < NR; ++r) m[r] = _mm256_setzero_ps();
  for (int v = 0; v < V; ++v) {
    const __m256 s = meta8(0, v), z = meta8(1, v);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m256 pv = spread_probs<GROUPS>(p[r] + v * PER), x = _mm256_mul_ps(pv, s);
      _mm256_store_ps(w[r][v], x);
      m[r] = _mm256_max_ps(x, m[r]);  // a NaN weight is dropped here and caught below
      zsum[r] = _mm256_fmadd_ps(pv, z, zsum[r]);
    }
  }
  const __m256i nan_code = _mm256_set1_epi16(-32768);
  __m256i bad = _mm256_setzero_si256();
  // packs interleave 128-bit lanes: 4 vectors' int32 units come out as v0lo v1lo v2lo v3lo v0hi v1hi v2hi v3hi
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // then, per 128-bit lane, [token][group] bytes -> [group][token] (4 tokens of a group are one int32)
  const __m256i by_group = GROUPS == 2 ? _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,  //
                                                          0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                       : _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,  //
                                                          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int r = 0; r < NR; ++r) {
    const __m256 peak = group_maxes<GROUPS>(m[r]);
    // 255 / max, 0 where max == 0 (all factors 0); an Inf max gives 0 too, and Inf * 0 is NaN below
    const __m256 positive = _mm256_cmp_ps(peak, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(255.0f), peak), positive);
    alignas(32) float step[8];
    _mm256_store_ps(step, _mm256_div_ps(peak, _mm256_set1_ps(255.0f)));
    for (int g = 0; g < GROUPS; ++g) b[r][g] = step[g];
    for (int v0 = 0; v0 < V; v0 += 4) {
      __m256i q[4];
      for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(w[r][v0 + k % V]), inv));
      const __m256i words01 = _mm256_packs_epi32(q[0], q[1]), words23 = _mm256_packs_epi32(q[2], q[3]);
      // vcvtps2dq gives INT32_MIN for NaN, saturated to -32768 here; a finite factor is 0..255
      bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpeq_epi16(words01, nan_code),
                                                 _mm256_cmpeq_epi16(words23, nan_code)));
      __m256i bytes = _mm256_packus_epi16(words01, words23);
      if constexpr (GROUPS != 8) bytes = _mm256_permutevar8x32_epi32(bytes, in_order);  // 8 groups: a token a vector
      if constexpr (GROUPS != 1) bytes = _mm256_shuffle_epi8(bytes, by_group);
      if constexpr (V == 2)
        _mm_storeu_si128((__m128i*)wi[r], _mm256_castsi256_si128(bytes));
      else
        _mm256_storeu_si256((__m256i*)(wi[r] + 8 * v0), bytes);  // elements [8 v0, 8 v0 + 32): the same bytes
    }
  }
  return _mm256_testz_si256(bad, bad);
}

// Metadata of a block's tokens by group: out[g][0, TB) = meta of tokens [t, t + n) in group g (fp32, zeros past n),
// through `buffer`, zero-padded. Only for group counts value_factors_in_order does not take (3, 5-7, 9 or more).
template <int64_t TB>
inline void block_meta(const void* base, Dtype dtype, int64_t offset, int64_t n, int64_t groups, float* buffer,
                       float (*out)[TB]) {
  load_row_padded(base, dtype, offset, n * groups, TB * groups, buffer);  // [token][group]
  const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)groups));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < TB; t += 8) _mm256_storeu_ps(out[g] + t, _mm256_i32gather_ps(buffer + t * groups + g, index, 4));
}

// value_factors_in_order for the block of n tokens whose metadata starts at element `meta`: read in place (the dtype a
// constant of the loop) when the block is whole, else from zero-padded copies in `buffer`.
template <int64_t TB, int NR, int GROUPS>
inline bool in_order_factors(const Packed& V, int64_t meta, int64_t n, const float* const* p,
                             float (*buffer)[TB * kMaxValueGroups], uint8_t (*wi)[kValueFactorBytes],
                             float (*b)[kMaxValueGroups], __m256* zsum) {
  const void* base[2] = {V.scales, V.zeros};
  if (n == TB) {
    return with_dtype(V.meta, [&](auto set) {
      const auto meta8 = [&](int array, int v) {
        return load_dtype<Vec256>(base[array], decltype(set)::kDtype, meta + 8 * v);
      };
      return value_factors_in_order<TB, NR, GROUPS>(p, meta8, wi, b, zsum);
    });
  }
  for (int array = 0; array < 2; ++array)
    load_row_padded(base[array], V.meta, meta, n * GROUPS, TB * GROUPS, buffer[array]);
  const auto copied = [&](int array, int v) { return _mm256_loadu_ps(buffer[array] + 8 * v); };
  return value_factors_in_order<TB, NR, GROUPS>(p, copied, wi, b, zsum);
}

// acc[r][0, Dv) += the packed values of NR rows over packed tokens [t0, t1): sum_t p_rt * (s_tg * c_td + z_tg), the
// codes' part in blocks of kValueBlock tokens from t0 (see the top of this file), the zeros' part in fp32; prob[r] is
// indexed by packed token. locate(tb, &codes, &meta) gives the storage of the block from token tb: its first token's
// codes and the element offset of its metadata, the block's tokens `code_row` bytes / `meta_row` elements apart. False,
// with `acc` untouched, when a weight p * s is not finite (the caller then takes the fp32 path). GROUPS is the number
// of value groups when it is 1, 2, 4 or 8 (the factors read the metadata in storage order: value_factors_in_order),
// else 0 (by group: block_meta, value_block_factors). Needs integer_values(BITS, V.group).
template <int BITS, int NR, int GROUPS, typename Locate>
inline bool int8_value_rows_of(const Packed& V, Locate locate, int64_t t0, int64_t t1, int64_t Dv,
                               const float* const* prob, float* const* acc) {
  constexpr int P = 8 / BITS;
  // Planes per pass: up to 12 int16 sums in registers (with 3 rows a few spill, which measured faster than a second
  // pass over the tiles); 4 rows of 2-bit codes take two passes of 2 planes.
  constexpr int KH = NR * P <= 12 ? P : P / 2;
  constexpr int64_t TB = kValueBlock<BITS>;
  const int64_t groups = GROUPS > 0 ? GROUPS : V.meta_row, G = V.group, tiles = Dv / (8 * P);
  // Sums in tile-plane-lane order: channel P * (8 x + j) + k at sums[r][(x * P + k) * 8 + j].
  float sums[NR][kMaxDim];
  for (int r = 0; r < NR; ++r)
    for (int64_t i = 0; i < Dv; ++i) sums[r][i] = 0.0f;
  float buffer[2][TB * kMaxValueGroups], padded[NR][TB];
  alignas(32) uint8_t wi[NR][kValueFactorBytes];  // factor_quad order
  float b[NR][kMaxValueGroups];
  // p * z: by group, lanes over tokens (GROUPS == 0), or one vector of group-cyclic lanes (value_factors_in_order)
  __m256 zsum[NR][GROUPS > 0 ? 1 : kMaxValueGroups];
  for (int r = 0; r < NR; ++r)
    for (int64_t g = 0; g < (GROUPS > 0 ? 1 : groups); ++g) zsum[r][g] = _mm256_setzero_ps();
  uint8_t ragged[4 * kMaxDim / 2];  // the last tokens of a block that is not a whole number of 4 tokens, zero-padded
  for (int64_t tb = t0; tb < t1; tb += TB) {
    const int64_t n = min64(TB, t1 - tb), quads = (n + 3) / 4;
    const uint8_t* block;
    int64_t meta;
    locate(tb, &block, &meta);
    const float* p[NR];
    for (int r = 0; r < NR; ++r) {
      p[r] = prob[r] + tb;
      if (n < TB) {
        for (int64_t t = 0; t < TB; ++t) padded[r][t] = t < n ? p[r][t] : 0.0f;
        p[r] = padded[r];
      }
    }
    bool finite;
    if constexpr (GROUPS > 0) {
      PhaseTimer timer(kPhaseValueFactors);  // (the metadata is read inside)
      finite = in_order_factors<TB, NR, GROUPS>(V, meta, n, p, buffer, wi, b, &zsum[0][0]);
    } else {
      float scale[kMaxValueGroups][TB], zero[kMaxValueGroups][TB];
      {
        PhaseTimer timer(kPhaseValueMeta);
        block_meta<TB>(V.scales, V.meta, meta, n, groups, buffer[0], scale);
        block_meta<TB>(V.zeros, V.meta, meta, n, groups, buffer[0], zero);
      }
      PhaseTimer timer(kPhaseValueFactors);
      finite = value_block_factors<TB, NR>(p, scale, zero, groups, wi, b, zsum);
    }
    if (!finite) return false;
    const int64_t whole = n / 4;  // quads read in place; a ragged last one from a zero-padded copy
    if (whole < quads) {
      for (int64_t i = 0; i < 4 * V.code_row; ++i) ragged[i] = 0;
      __builtin_memcpy(ragged, block + 4 * whole * V.code_row, (size_t)((n % 4) * V.code_row));
    }
    for (int64_t x = 0; x < tiles; ++x) {
      const int64_t g = x * 8 * P / G;
#pragma GCC unroll 2
      for (int k0 = 0; k0 < P; k0 += KH) {
        __m256i accum[NR][KH];
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
          for (int k = 0; k < KH; ++k) accum[r][k] = _mm256_setzero_si256();
        for (int64_t q = 0; q < quads; ++q) {
          const __m256i t = q < whole ? tile4x8(block + 4 * q * V.code_row + 8 * x, V.code_row)
                                      : tile4x8(ragged + 8 * x, V.code_row);
          __m256i w[NR];
#pragma GCC unroll 16
          for (int r = 0; r < NR; ++r) w[r] = broadcast4(wi[r] + factor_quad(q, g, groups));
#pragma GCC unroll 16
          for (int k = 0; k < KH; ++k) {
            const __m256i pl = plane<BITS, 7>(t, k0 + k);  // the codes are the signed operand
#pragma GCC unroll 16
            for (int r = 0; r < NR; ++r)
              accum[r][k] = DotSum::add(accum[r][k], w[r], pl);
          }
        }
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 16
          for (int k = 0; k < KH; ++k) {
            float* s = sums[r] + (x * P + k0 + k) * 8;
            const __m256 f = _mm256_cvtepi32_ps(DotSum::widen(accum[r][k]));
            const __m256 scale_b = _mm256_set1_ps(b[r][g] * plane_weight<BITS, 7>(k0 + k));
            _mm256_storeu_ps(s, _mm256_fmadd_ps(f, scale_b, _mm256_loadu_ps(s)));
          }
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int64_t x = 0; x < tiles; ++x)
      for (int k = 0; k < P; ++k)
        for (int j = 0; j < 8; ++j) acc[r][P * (8 * x + j) + k] += sums[r][(x * P + k) * 8 + j];
    alignas(32) float lanes[8];  // (GROUPS > 0) lane l of zsum[r][0] belongs to group l % GROUPS
    if (GROUPS > 0) _mm256_store_ps(lanes, zsum[r][0]);
    for (int64_t g = 0; g < groups; ++g) {  // the zeros: sum_t p_t z_tg once per group, added to its channels
      float zs = 0.0f;
      if (GROUPS > 0)
        for (int64_t l = g; l < 8; l += groups) zs += lanes[l];
      else
        zs = Vec256::reduce_add(zsum[r][g]);
      for (int64_t d = g * G; d < (g + 1) * G; ++d) acc[r][d] += zs;
    }
  }
  return true;
}

// int8_value_rows_of for the value groups of V.
template <int BITS, int NR, typename Locate>
inline bool int8_value_rows(const Packed& V, Locate locate, int64_t t0, int64_t t1, int64_t Dv,
                            const float* const* prob, float* const* acc) {
  switch (V.meta_row) {  // groups per token
    case 1: return int8_value_rows_of<BITS, NR, 1>(V, locate, t0, t1, Dv, prob, acc);
    case 2: return int8_value_rows_of<BITS, NR, 2>(V, locate, t0, t1, Dv, prob, acc);
    case 4: return int8_value_rows_of<BITS, NR, 4>(V, locate, t0, t1, Dv, prob, acc);
    case 8: return int8_value_rows_of<BITS, NR, 8>(V, locate, t0, t1, Dv, prob, acc);
    default: return int8_value_rows_of<BITS, NR, 0>(V, locate, t0, t1, Dv, prob, acc);
  }
}
