// The values of a chunk: exact values (sinks, tail) and packed values, contiguous or paged, on fp32 or, where the
// ISA has it, on integer arithmetic (int8_value_rows in decode_int8.h).
// A part of the chunk kernel, not a standalone header: decode_attention_impl.h includes it inside its anonymous
// namespace, after simd.h and the parts before it, once per ISA translation unit.
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
// epilogue for each.
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
