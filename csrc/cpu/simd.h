// Tiny vector API the native CPU kernels are written against, once, and compiled per ISA.
//
// Usage (the translation units of each ISA, see isa_kernels.h and isa_quantize.h): include <immintrin.h>, <cstdint>,
// <cstring> and dtype.h FIRST, then open the ISA's target region (isa_list.h: KIVI_TARGET_FEATURES), define
// KIVI_SIMD_AVX512 or KIVI_SIMD_AVX2 (neither: baseline), and include this file INSIDE
// `namespace kivi::cpu::<...> { namespace {`. Everything here then has internal linkage, so the linker can never hand
// an AVX-512 instance of an inline function to code running on an AVX2-only CPU.
// No headers are included and no std templates are used here for the same reason.
//
// Policies: `Scalar` (1 lane, exact software conversions) always exists, for tails and the baseline; `Vec` is the
// widest policy of the ISA (16 lanes AVX-512, 8 lanes AVX2, Scalar on baseline). Kernels are templates over a policy
// (F float lanes, I int32 lanes, M lane mask), so the policies share their function names; the codes loads and pow2
// are the vector policies' only. `FloatVec`, the policy of the float-only decode attention, is Vec, or on the baseline
// `Vec4`: 4 lanes in plain C++ with just the float ops it needs (one lane would serialise its sums).
// Conversions are bit-exact with kivi_xpu/ops/reference.py: fp16 and bf16 round to nearest even, fp16 overflows to
// Inf, NaN becomes sign|0x7E00 (fp16) or 0x7FC0 (bf16); fp16/bf16 -> fp32 is exact.

// Element type tags: storage type of each supported dtype.
struct F32 {
  using T = float;
};
struct F16 {
  using T = uint16_t;
};
struct BF16 {
  using T = uint16_t;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// fp16 -> fp32, exact (software decode: the baseline has no F16C).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) return bits_float(sign | float_bits((float)mantissa * bits_float(0x33800000u)));  // m * 2^-24
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// fp32 -> fp16, round to nearest even, overflow to Inf, gradual underflow, NaN -> sign|0x7E00.
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
  if (abs_bits >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520: Inf
  if (abs_bits >= 0x38800000u) {                                   // normal fp16 (>= 2^-14)
    const uint32_t rounded = abs_bits + 0xFFFu + ((abs_bits >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
  }
  // Subnormal or zero: m * 2^-24 with m = rint(|f| * 2^24), exact in fp32; rint rounds half to even.
  return (uint16_t)(sign | (uint16_t)__builtin_rintf(bits_float(abs_bits) * bits_float(0x4B800000u)));
}

inline float bf16_to_float(uint16_t b) { return bits_float((uint32_t)b << 16); }

// fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (torch's c10::BFloat16 rule).
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// exp(x) for x <= 0 or NaN (all a softmax needs) on a vector policy: 0 below -87, NaN stays NaN. Cephes'
// polynomial, ~2 ulp; written once over the policy's lane ops (V::pow2 builds 2^n from the exponent bits).
template <class V>
inline typename V::F exp_nonpositive(typename V::F x) {
  using F = typename V::F;
  const F clamped = V::max(V::set1(-87.0f), x);  // maxps returns its second operand for a NaN: NaN flows through
  const F n = V::round_even(V::mul(clamped, V::set1(1.44269504088896341f)));  // x / ln 2
  F r = V::fma(n, V::set1(-0.693359375f), clamped);  // x - n ln 2, ln 2 split in two for precision
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  F y = V::set1(1.9875691500e-4f);
  y = V::fma(y, r, V::set1(1.3981999507e-3f));
  y = V::fma(y, r, V::set1(8.3334519073e-3f));
  y = V::fma(y, r, V::set1(4.1665795894e-2f));
  y = V::fma(y, r, V::set1(1.6666665459e-1f));
  y = V::fma(y, r, V::set1(5.0000001201e-1f));
  y = V::fma(y, V::mul(r, r), V::add(r, V::set1(1.0f)));
  y = V::mul(y, V::pow2(n));
  return V::select(V::lt(x, V::set1(-87.0f)), V::set1(0.0f), y);  // (NaN is not below: it stays)
}

struct Scalar {
  static constexpr int kWidth = 1;
  using F = float;
  using I = int32_t;
  using M = bool;

  static F load(const float* p) { return *p; }
#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
  static F load(const uint16_t* p, F16) { return _cvtsh_ss(*p); }  // F16C: one instruction
#else
  static F load(const uint16_t* p, F16) { return half_to_float(*p); }
#endif
  static F load(const uint16_t* p, BF16) { return bf16_to_float(*p); }
  static void store(float* p, F v) { *p = v; }
  static void store(uint16_t* p, F v, F16) { *p = float_to_half(v); }
  static void store(uint16_t* p, F v, BF16) { *p = float_to_bf16(v); }

  static F set1(float v) { return v; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }  // fused where the TU's fp-contract allows
  static F div(F a, F b) { return a / b; }
  static F min(F a, F b) { return a < b ? a : b; }  // minps semantics
  static F max(F a, F b) { return a > b ? a : b; }
  static F round_even(F v) { return __builtin_rintf(v); }  // default rounding mode: nearest even
  static M eq(F a, F b) { return a == b; }                  // ordered: false if either is NaN
  static M gt(F a, F b) { return a > b; }
  static M lt(F a, F b) { return a < b; }
  static M both(M a, M b) { return a && b; }
  static bool all(M m) { return m; }
  static F abs(F v) { return __builtin_fabsf(v); }
  static F select(M m, F a, F b) { return m ? a : b; }
  static F exp(F v) { return __builtin_expf(v); }  // libm: exact enough for any x
  static float reduce_min(F v) { return v; }  // across lanes (order unspecified)
  static float reduce_max(F v) { return v; }
  static float reduce_add(F v) { return v; }

  static I set1_i(int32_t v) { return v; }
  static I to_int(F v) { return (int32_t)v; }  // truncates; used on integral values only
  static F to_float(I v) { return (float)v; }
  static I and_i(I a, I b) { return a & b; }
  static I or_i(I a, I b) { return a | b; }
  static I shl(I v, int n) { return (int32_t)((uint32_t)v << n); }
  static I shr(I v, int n) { return (int32_t)((uint32_t)v >> n); }  // logical
  static I select_i(M m, I a, I b) { return m ? a : b; }
  static I load_i(const int32_t* p) { return *p; }
  static void store_i(int32_t* p, I v) { *p = v; }
  static I load_u8(const uint8_t* p) { return *p; }                      // kWidth bytes -> lanes
  static void store_u8(uint8_t* p, I v) { *p = (uint8_t)v; }            // lanes (< 256) -> kWidth bytes
};

// The 256-bit policy: the widest of the AVX2 build, and in the AVX-512 build what code written for 8 lanes uses
// (decode_int8.h's integer dot products).
#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
struct Vec256 {
  static constexpr int kWidth = 8;
  using F = __m256;
  using I = __m256i;
  using M = __m256;  // all-ones / all-zeros lanes

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p, F16) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F load(const uint16_t* p, BF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store(uint16_t* p, F v, F16) {
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256 quiet = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
    v = _mm256_blendv_ps(v, quiet, nan);
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(uint16_t* p, F v, BF16) {
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7FC0),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // Values < 2^16 in 32-bit lanes: unsigned-saturating pack is exact; the permute undoes its lane interleave.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
  }

  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round_even(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static M eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M both(M a, M b) { return _mm256_and_ps(a, b); }
  static bool all(M m) { return _mm256_movemask_ps(m) == 0xFF; }
  static F abs(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }
  static F exp(F x) { return exp_nonpositive<Vec256>(x); }
  static F pow2(F n) {  // 2^n for integral n in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static float reduce_min(F v) {
    __m128 r = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_min_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_min_ss(r, _mm_movehdup_ps(r)));
  }
  static float reduce_max(F v) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
  }
  static float reduce_add(F v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
  }

  static I set1_i(int32_t v) { return _mm256_set1_epi32(v); }
  static I to_int(F v) { return _mm256_cvttps_epi32(v); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_i(I a, I b) { return _mm256_or_si256(a, b); }
  static I shl(I v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shr(I v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I select_i(M m, I a, I b) { return _mm256_blendv_epi8(b, a, _mm256_castps_si256(m)); }
  static I load_i(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static void store_i(int32_t* p, I v) { _mm256_storeu_si256((__m256i*)p, v); }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  // kWidth codes packed little-end first (pack_codes' layout) at p, kWidth * bits / 8 bytes -> lanes.
  static I load_codes(const uint8_t* p, int bits) {
    if (bits == 8) return load_u8(p);
    int32_t word = 0;  // kWidth * bits / 8 bytes: 2 bits: 2 bytes, 4 bits: 4 bytes
    __builtin_memcpy(&word, p, (size_t)bits);
    const __m256i shifts = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                     : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32((1 << bits) - 1));
  }
  template <int BITS>  // load_codes as floats
  static F load_codes_float(const uint8_t* p) {
    return to_float(load_codes(p, BITS));
  }
  // 2 * kWidth codes into two vectors; 2 bits: one 32-bit word feeds both.
  template <int BITS>
  static void load_codes_float2(const uint8_t* p, F& lo, F& hi) {
    if (BITS != 2) {
      lo = load_codes_float<BITS>(p);
      hi = load_codes_float<BITS>(p + kWidth * BITS / 8);
      return;
    }
    int32_t word;
    __builtin_memcpy(&word, p, 4);
    const __m256i words = _mm256_set1_epi32(word), three = _mm256_set1_epi32(3);
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shifts), three));
    hi = _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_add_epi32(shifts, _mm256_set1_epi32(16))), three));
  }
  static void store_u8(uint8_t* p, I v) {
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i*)p, _mm_packus_epi16(words, words));
  }
};
#endif

#if defined(KIVI_SIMD_AVX512)
struct Vec {
  static constexpr int kWidth = 16;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p, F16) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F load(const uint16_t* p, BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store(uint16_t* p, F v, F16) {
    // Hardware RNE with overflow to Inf; NaN payloads are replaced first so every NaN becomes sign|0x7E00.
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)),
                                          _mm512_set1_epi32(0x7FC00000));
    v = _mm512_mask_blend_ps(nan, v, _mm512_castsi512_ps(quiet));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(uint16_t* p, F v, BF16) {
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_srli_epi32(r, 16),
                                _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
  }

  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round_even(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M both(M a, M b) { return (M)(a & b); }
  static bool all(M m) { return m == 0xFFFF; }
  static F abs(F v) { return _mm512_abs_ps(v); }
  static F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  static F exp(F x) { return exp_nonpositive<Vec>(x); }
  static F pow2(F n) {  // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static float reduce_min(F v) { return _mm512_reduce_min_ps(v); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }

  static I set1_i(int32_t v) { return _mm512_set1_epi32(v); }
  static I to_int(F v) { return _mm512_cvttps_epi32(v); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_i(I a, I b) { return _mm512_or_si512(a, b); }
  static I shl(I v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shr(I v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I select_i(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  static I load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store_i(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  // kWidth codes packed little-end first (pack_codes' layout) at p, kWidth * bits / 8 bytes -> lanes.
  static I load_codes(const uint8_t* p, int bits) {
    if (bits == 8) return load_u8(p);
    if (bits == 4) {  // 8 bytes: lanes 0-7 from the low 32-bit word, 8-15 from the high one
      int64_t qword;
      __builtin_memcpy(&qword, p, 8);
      const __m512i word_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m512i words = _mm512_permutexvar_epi32(word_of_lane, _mm512_castsi128_si512(_mm_cvtsi64_si128(qword)));
      const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
      return _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(15));
    }
    int32_t word;  // 2 bits: 4 bytes, one 32-bit word for all lanes
    __builtin_memcpy(&word, p, 4);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(word), shifts), _mm512_set1_epi32(3));
  }
  // load_codes as floats: vpermps reads the low 4 bits of each shifted lane, the code (for 2 bits plus the next
  // code's bits, which the table's repetition ignores), so a table lookup replaces the mask and the conversion.
  template <int BITS>
  static F load_codes_float(const uint8_t* p) {
    if (BITS == 8) return to_float(load_u8(p));
    __m512i words;
    if (BITS == 2) {
      int32_t w;
      __builtin_memcpy(&w, p, 4);
      words = _mm512_set1_epi32(w);
    } else {
      int64_t w;
      __builtin_memcpy(&w, p, 8);
      words = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                       _mm512_castsi128_si512(_mm_cvtsi64_si128(w)));
    }
    constexpr int B = BITS;  // lane i shifts by (i * BITS) mod 32 within its word
    const __m512i shift = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, (8 * B) & 31, (9 * B) & 31,
                                            (10 * B) & 31, (11 * B) & 31, (12 * B) & 31, (13 * B) & 31, (14 * B) & 31,
                                            (15 * B) & 31);
    constexpr int K = (1 << BITS) - 1;  // lane k of the table holds k & K
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4 & K, 5 & K, 6 & K, 7 & K, 8 & K, 9 & K, 10 & K, 11 & K, 12 & K,
                                        13 & K, 14 & K, 15 & K);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(words, shift), table);
  }
  template <int BITS>
  static void load_codes_float2(const uint8_t* p, F& lo, F& hi) {  // 2 * kWidth codes
    lo = load_codes_float<BITS>(p);
    hi = load_codes_float<BITS>(p + kWidth * BITS / 8);
  }
  static void store_u8(uint8_t* p, I v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(v)); }
};
#elif defined(KIVI_SIMD_AVX2)
using Vec = Vec256;
#else
using Vec = Scalar;

// 4 float lanes in plain C++, lane ops Scalar's, left to the compiler's default (SSE2) vectorisation: the baseline's
// FloatVec. Its exp is libm's, its sums pairwise.
struct Vec4 {
  static constexpr int kWidth = 4;
  struct F {
    float v[4];
  };

  static F load(const float* p) { return F{{p[0], p[1], p[2], p[3]}}; }
  template <class X>
  static F load(const uint16_t* p, X dtype) {  // F16 or BF16
    F a;
    for (int i = 0; i < 4; ++i) a.v[i] = Scalar::load(p + i, dtype);
    return a;
  }
  static void store(float* p, F a) {
    for (int i = 0; i < 4; ++i) p[i] = a.v[i];
  }
  static F set1(float x) { return F{{x, x, x, x}}; }
  static F add(F a, F b) {
    for (int i = 0; i < 4; ++i) a.v[i] = Scalar::add(a.v[i], b.v[i]);
    return a;
  }
  static F mul(F a, F b) {
    for (int i = 0; i < 4; ++i) a.v[i] = Scalar::mul(a.v[i], b.v[i]);
    return a;
  }
  static F fma(F a, F b, F c) {
    for (int i = 0; i < 4; ++i) c.v[i] = Scalar::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static F max(F a, F b) {
    for (int i = 0; i < 4; ++i) a.v[i] = Scalar::max(a.v[i], b.v[i]);
    return a;
  }
  static F exp(F x) {
    for (int i = 0; i < 4; ++i) x.v[i] = Scalar::exp(x.v[i]);
    return x;
  }
  static float reduce_add(F a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
  static float reduce_max(F a) { return Scalar::max(Scalar::max(a.v[0], a.v[1]), Scalar::max(a.v[2], a.v[3])); }
  template <int BITS>
  static F load_codes_float(const uint8_t* p) {  // 4 codes = BITS / 2 bytes
    uint32_t w = 0;
    __builtin_memcpy(&w, p, BITS / 2);
    F a;
    for (int i = 0; i < 4; ++i) a.v[i] = (float)((w >> (i * BITS)) & ((1u << BITS) - 1u));
    return a;
  }
  template <int BITS>
  static void load_codes_float2(const uint8_t* p, F& lo, F& hi) {
    lo = load_codes_float<BITS>(p);
    hi = load_codes_float<BITS>(p + kWidth * BITS / 8);
  }
};
#endif

#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
using FloatVec = Vec;
#else
using FloatVec = Vec4;
#endif

// kWidth elements of X's storage type at p as fp32 lanes, and back (F32 has no conversion, so no tag overload).
template <class V, class X>
inline typename V::F load_as_float(const typename X::T* p) {
  if constexpr (sizeof(typename X::T) == 4) {
    return V::load(p);
  } else {
    return V::load(p, X{});
  }
}
template <class V, class X>
inline void store_from_float(typename X::T* p, typename V::F v) {
  if constexpr (sizeof(typename X::T) == 4) {
    V::store(p, v);
  } else {
    V::store(p, v, X{});
  }
}

// load_as_float for a dtype known only at run time: base[index, index + kWidth).
template <class V>
inline typename V::F load_dtype(const void* base, Dtype dtype, int64_t index) {
  switch (dtype) {
    case kF32:
      return load_as_float<V, F32>(static_cast<const float*>(base) + index);
    case kF16:
      return load_as_float<V, F16>(static_cast<const uint16_t*>(base) + index);
    default:
      return load_as_float<V, BF16>(static_cast<const uint16_t*>(base) + index);
  }
}

// Codes <-> packed bytes, little-end first (2-bit byte = q0 | q1<<2 | q2<<4 | q3<<6). `q` holds one code per byte;
// `n` codes (a multiple of 8 / bits) become n * bits / 8 bytes.
inline void pack_codes(const uint8_t* q, int64_t n, int bits, uint8_t* out) {
  int64_t i = 0;
#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
  if (bits == 8) {
    __builtin_memcpy(out, q, (size_t)n);
    return;
  }
  // 16 codes at a time: multiply-add adjacent codes into 16-bit (and for 2 bits 32-bit) lanes, then narrow.
  const __m128i pairs = _mm_set1_epi16((short)(1 | (1 << (8 + bits))));
  for (; i + 16 <= n; i += 16) {
    const __m128i codes = _mm_loadu_si128((const __m128i*)(q + i));
    __m128i words = _mm_maddubs_epi16(codes, pairs);  // q0 + q1 << bits
    if (bits == 4) {
      _mm_storel_epi64((__m128i*)(out + i / 2), _mm_packus_epi16(words, words));
    } else {
      words = _mm_madd_epi16(words, _mm_set1_epi32(1 | (16 << 16)));  // + (q2 + q3 << 2) << 4
      const __m128i halves = _mm_packus_epi32(words, words);
      const int32_t packed = _mm_cvtsi128_si32(_mm_packus_epi16(halves, halves));
      __builtin_memcpy(out + i / 4, &packed, 4);
    }
  }
#endif
  const int per = 8 / bits;
  for (; i < n; i += per) {
    unsigned byte = 0;
    for (int k = 0; k < per; ++k) byte |= (unsigned)q[i + k] << (k * bits);
    out[i / per] = (uint8_t)byte;
  }
}

// Inverse of pack_codes: n codes (a multiple of 8 / bits) from n * bits / 8 bytes, one code per byte of `q`.
inline void unpack_codes(const uint8_t* in, int64_t n, int bits, uint8_t* q) {
  int64_t i = 0;
#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
  if (bits == 8) {
    __builtin_memcpy(q, in, (size_t)n);
    return;
  }
  if (bits == 4) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (; i + 16 <= n; i += 16) {  // 8 bytes -> 16 codes: low nibble first
      const __m128i bytes = _mm_loadl_epi64((const __m128i*)(in + i / 2));
      _mm_storeu_si128((__m128i*)(q + i),
                       _mm_unpacklo_epi8(_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
    }
  } else {
    // 4 bytes -> 16 codes: byte j goes to lanes 4j..4j+3, and lane l keeps (byte >> 2 * (l % 4)) & 3 (SSE has no
    // per-byte variable shift: four shifted copies, blended by lane).
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m128i three = _mm_set1_epi8(3);
    const __m128i lane_mod = _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    for (; i + 16 <= n; i += 16) {
      int32_t word;
      __builtin_memcpy(&word, in + i / 4, 4);
      const __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(word), spread);
      // Shifting 16-bit lanes leaks bits across bytes; the & 3 after each shift removes them.
      const __m128i s0 = _mm_and_si128(bytes, three);
      const __m128i s2 = _mm_and_si128(_mm_srli_epi16(bytes, 2), three);
      const __m128i s4 = _mm_and_si128(_mm_srli_epi16(bytes, 4), three);
      const __m128i s6 = _mm_and_si128(_mm_srli_epi16(bytes, 6), three);
      const __m128i is1 = _mm_cmpeq_epi8(lane_mod, _mm_set1_epi8(1));
      const __m128i is2 = _mm_cmpeq_epi8(lane_mod, _mm_set1_epi8(2));
      const __m128i is3 = _mm_cmpeq_epi8(lane_mod, _mm_set1_epi8(3));
      __m128i codes = _mm_blendv_epi8(s0, s2, is1);
      codes = _mm_blendv_epi8(codes, s4, is2);
      codes = _mm_blendv_epi8(codes, s6, is3);
      _mm_storeu_si128((__m128i*)(q + i), codes);
    }
  }
#endif
  const int per = 8 / bits;
  const unsigned mask = (1u << bits) - 1u;
  for (; i < n; i += per) {
    const unsigned byte = in[i / per];
    for (int k = 0; k < per; ++k) q[i + k] = (uint8_t)((byte >> (k * bits)) & mask);
  }
}
