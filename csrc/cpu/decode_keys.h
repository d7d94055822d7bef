// The scores of a chunk: exact keys (sinks, tail) and packed keys, on fp32 or, where the ISA has it, on integer
// arithmetic (int8_packed_scores, over decode_int8.h).
// A part of the chunk kernel, not a standalone header: decode_attention_impl.h includes it inside its anonymous
// namespace, after simd.h and the parts before it, once per ISA translation unit.

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
  with_dtype(dtype, [&](auto set) {
    load_key_meta_rows<decltype(set)::kDtype>(base, offset, row, D, count, out);
  });
}

#if defined(KIVI_DA_INTEGER)
// Key metadata of groups [gb, gb + block) (block <= kBlockGroups) channel-major in fp32, what key_block_factors
// reads: out[d * kBlockGroups + i] = channel d of group gb + i, zeros for i >= block. For the blocks the factors do
// not read in place (key_factors_in_place): a ragged last block of contiguous storage (a channel's groups side by
// side), and pages (a page holds its groups' D channels one group after another: 8 channels of each group converted
// as they load and transposed 8 x 8 in registers, without a buffer of the whole rows).
inline void load_key_meta_by_channel(const Packed& K, const void* base, int64_t bh, int64_t gb, int64_t block,
                                     int64_t D, float* out) {
  constexpr int64_t W = kBlockGroups;
  if (K.pages == nullptr) {
    const int64_t offset = bh * K.meta_head + gb;
    for (int64_t d = 0; d < D; ++d)  // the last block of a range: only its groups are read
      for (int64_t i = 0; i < W; ++i)
        out[d * W + i] = i < block ? load_scalar(base, K.meta, offset + d * K.meta_row + i) : 0.0f;
    return;
  }
  int64_t row[W];  // group gb + i's channel 0 (an absent group reads group gb's row, zeroed below)
  for (int64_t i = 0; i < W; ++i) row[i] = K.page_key_meta(gb + (i < block ? i : 0), bh, D);
  const __m256 present = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32((int)block), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  with_dtype(K.meta, [&](auto set) {
    constexpr Dtype DT = decltype(set)::kDtype;
    int64_t d0 = 0;
    for (; d0 + 8 <= D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load_dtype<Vec256>(base, DT, row[i] + d0);
      transpose8x8(r);
      for (int k = 0; k < 8; ++k) _mm256_store_ps(out + (d0 + k) * W, _mm256_and_ps(r[k], present));
    }
    for (; d0 < D; ++d0)
      for (int64_t i = 0; i < W; ++i) out[d0 * W + i] = i < block ? load_scalar(base, DT, row[i] + d0) : 0.0f;
  });
}

// key_block_factors of a whole block of contiguous storage, read in place from element `offset` (channel d's groups
// at offset + d * meta_row), the dtype a constant of the loop.
template <int NR>
inline void key_factors_in_place(const float* const* q, const Packed& K, int64_t offset, int64_t D,
                                 KeyBlockFactors* f) {
  with_dtype(K.meta, [&](auto set) {
    const auto meta8 = [&](int array, int64_t d) {
      return load_dtype<Vec256>(array == 0 ? K.scales : K.zeros, decltype(set)::kDtype, offset + d * K.meta_row);
    };
    key_block_factors<NR>(q, meta8, D, f);
  });
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
    // A whole block of contiguous storage is read in place by the factors (a channel's 8 groups are one vector,
    // converted as it is loaded); pages and the last block of a range are copied channel-major first.
    const bool in_place = K.pages == nullptr && block == kBlockGroups;
    const int64_t meta0 = bh * K.meta_head + gb;  // (contiguous) channel d's groups from meta0 + d * meta_row
    if (!in_place) {
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
          if (in_place) {
            key_factors_in_place<NR>(qr, K, meta0, D, &f);
          } else {
            const auto copied = [&](int array, int64_t d) {
              return _mm256_load_ps((array == 0 ? scale : zero) + d * kBlockGroups);
            };
            key_block_factors<NR>(qr, copied, D, &f);
          }
        }
        for (int64_t i = 0; i < block; ++i) {
          const int64_t g = gb + i;
          const uint8_t* codes =
              K.pages == nullptr ? K.codes + bh * K.code_head + g * (G * BITS / 8) : K.page_key_codes(g, bh);
          float* out[NR];
          for (int j = 0; j < NR; ++j) out[j] = scores + (r0 + j) * P.score_row + pos0 + (g - g0) * G;
          if ((f.finite >> i) & 1) {
            int8_key_group<BITS, NR>(f, i, codes, K.code_row, D, G, out);
            continue;
          }
          float qs[NR][kMaxDim], bias[NR];  // a non-finite q * s: the fp32 products, as the dense product would meet it
          for (int j = 0; j < NR; ++j) {
            for (int64_t d = 0; d < D; ++d) {
              const float s = in_place ? load_scalar(K.scales, K.meta, meta0 + d * K.meta_row + i)
                                       : scale[d * kBlockGroups + i];
              qs[j][d] = qr[j][d] * s;
            }
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
        const int64_t meta = K.page_key_meta(gb + i, bh, D);
        load_row(K.scales, K.meta, meta, D, scales + i * kMaxDim);
        load_row(K.zeros, K.meta, meta, D, zeros + i * kMaxDim);
      }
    }
    for (int64_t i = 0; i < block; ++i) {
      const int64_t g = gb + i;
      const uint8_t* group_codes = K.pages == nullptr ? codes + g * (G * BITS / 8) : K.page_key_codes(g, bh);
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
