// One task: a chunk's softmax (softcap, mask, exp against the chunk max) and run_chunk, the driver that scores
// the chunk's keys, takes the softmax and sums its values into the task's partial.
// A part of the chunk kernel, not a standalone header: decode_attention_impl.h includes it inside its anonymous
// namespace, after simd.h and the parts before it, once per ISA translation unit.

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
