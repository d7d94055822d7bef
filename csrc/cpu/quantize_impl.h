// KIVI quantize / dequantize kernels, written once against simd.h and compiled per ISA (isa_quantize.h, the body of
// every isa_<name>_quantize.cpp, includes this file after simd.h inside an anonymous namespace). Semantics are
// kivi_xpu/ops/reference.py's, bit for bit:
//   scale = meta((mx - mn) / qmax), zero = meta(mn)        (meta = round to the metadata dtype and back)
//   q     = clamp(rint((x - zero) / scale), 0, qmax)        (a real division; q = 0 where scale == 0)
//   a group with a non-finite element, scale or zero: codes 0, scale = zero = NaN
//   x'    = q * scale + zero                                 (two roundings: the TU is built with fp-contract=off)
//   fit="least_squares" (job.refit): the line refit to the min-max codes, then quantized again (refit_params)
// Keys put SIMD lanes on channels (a group runs along tokens, i.e. down a column of x); values put lanes along the
// group's channels (a group is a contiguous piece of a row).

// Rounds to the metadata dtype and back, as torch's `.to(meta_dtype).float()` does.
template <class V, class M>
inline typename V::F round_to(typename V::F v) {
  if constexpr (sizeof(typename M::T) == 4) {
    return v;
  } else {
    alignas(64) uint16_t tmp[16];
    V::store(tmp, v, M{});
    return V::load(tmp, M{});
  }
}

// Per-lane statistics of a group while it is read: min, max, and the sum of (x - x), which is 0 if every element is
// finite and NaN otherwise (min/max alone may drop a NaN).
template <class V>
struct Range {
  typename V::F lo, hi, check;
  void start(typename V::F v) {
    lo = hi = v;
    check = V::sub(v, v);
  }
  void add(typename V::F v) {
    lo = V::min(lo, v);
    hi = V::max(hi, v);
    check = V::add(check, V::sub(v, v));
  }
};

// Stored scale and zero of a group (NaN if invalid) and what quantization needs: `use` (valid and scale > 0), a
// divisor that is the scale where used (1 elsewhere, so no lane divides by zero) and its reciprocal.
template <class V>
struct Params {
  typename V::F scale, zero, divisor, inverse, qmax;
  typename V::M use;
};

template <class V, class M>
inline Params<V> group_params(const Range<V>& r, float qmax) {
  using F = typename V::F;
  const F zero_f = V::set1(0.0f), nan = V::set1(bits_float(0x7FC00000u));
  const F scale = round_to<V, M>(V::div(V::sub(r.hi, r.lo), V::set1(qmax)));
  const F zero = round_to<V, M>(r.lo);
  const F check = V::add(r.check, V::add(V::sub(scale, scale), V::sub(zero, zero)));
  const typename V::M valid = V::eq(check, zero_f);
  Params<V> p;
  p.use = V::both(valid, V::gt(scale, zero_f));
  p.divisor = V::select(p.use, scale, V::set1(1.0f));
  p.inverse = V::div(V::set1(1.0f), p.divisor);
  p.scale = V::select(valid, scale, nan);
  p.zero = V::select(valid, zero, nan);
  p.qmax = V::set1(qmax);
  return p;
}

// Sums of a group's min-max codes q and elements x for the least-squares refit: added in element order, each product
// rounded, as reference.py adds them.
template <class V>
struct FitSums {
  // From +0: 0 + a == a for every a but -0, and a sum left at +/-0 leaves the line unusable either way.
  typename V::F q = V::set1(0.0f), qq = V::set1(0.0f), x = V::set1(0.0f), qx = V::set1(0.0f);
  void add(typename V::F xi, typename V::F qi) {
    q = V::add(q, qi), qq = V::add(qq, V::mul(qi, qi)), x = V::add(x, xi), qx = V::add(qx, V::mul(qi, xi));
  }
};

// fit="least_squares": the group's line becomes the least-squares line through (q_i, x_i) of its min-max codes, where
// that line is usable (reference.py's _refit, operation for operation); `count` is the group's size.
template <class V, class M>
inline void refit_params(Params<V>& p, const FitSums<V>& s, float count) {
  using F = typename V::F;
  const F n = V::set1(count), zero_f = V::set1(0.0f);
  const F det = V::sub(V::mul(n, s.qq), V::mul(s.q, s.q));
  const typename V::M solvable = V::gt(det, zero_f);
  const F slope = V::div(V::sub(V::mul(n, s.qx), V::mul(s.q, s.x)), V::select(solvable, det, V::set1(1.0f)));
  const F scale = round_to<V, M>(slope);
  const F zero = round_to<V, M>(V::div(V::sub(s.x, V::mul(slope, s.q)), n));
  const typename V::M finite = V::both(V::eq(V::sub(scale, scale), zero_f), V::eq(V::sub(zero, zero), zero_f));
  const typename V::M usable = V::both(V::both(solvable, V::gt(scale, zero_f)), finite);
  p.scale = V::select(usable, scale, p.scale);
  p.zero = V::select(usable, zero, p.zero);
  p.divisor = V::select(usable, scale, p.divisor);
  p.inverse = V::div(V::set1(1.0f), p.divisor);
}

// A division per element is the most expensive step of quantization. The product with the reciprocal differs from
// the exact quotient by at most 2^-15 for quotients up to 255 (two roundings), so it rounds to the same integer
// unless it lies that close to a half-integer: only vectors with a lane within kTieSlack of one (or a non-finite
// lane) are divided for real, which keeps the codes bit-identical to the reference's division.
constexpr float kTieSlack = 1.0f / 4096;

template <class V>
inline typename V::I quantize_lanes(typename V::F v, const Params<V>& p) {
  using F = typename V::F;
  const F shifted = V::sub(v, p.zero);
  F q;
  if constexpr (V::kWidth == 1) {
    q = V::round_even(V::div(shifted, p.divisor));
  } else {
    const F y = V::mul(shifted, p.inverse);
    q = V::round_even(y);
    if (!V::all(V::lt(V::abs(V::sub(y, q)), V::set1(0.5f - kTieSlack))))
      q = V::round_even(V::div(shifted, p.divisor));
  }
  q = V::min(V::max(q, V::set1(0.0f)), p.qmax);
  return V::select_i(p.use, V::to_int(q), V::set1_i(0));
}

template <class V>
inline typename V::F dequantize_lanes(typename V::I q, typename V::F scale, typename V::F zero) {
  return V::add(V::mul(V::to_float(q), scale), zero);  // not contracted into an fma (fp-contract=off)
}

// ---- keys: lanes = channels c0 .. c0 + W - 1 of one (head, group) ------------------------------------------------

// Key codes and metadata are [head, channel, ...] rows of which a task reads (or writes) a few bytes in every
// channel of its tile: dozens of concurrent streams, more than the hardware prefetchers follow (at 8k tokens this
// tripled the time per element). When a task enters a new cache line of its rows, the lines kPrefetchAhead bytes
// further on are prefetched, one per row (a prefetch past the end of a buffer is harmless).
constexpr int64_t kLine = 64, kPrefetchAhead = 4 * kLine;

template <bool kWrite>
inline void prefetch_rows(const void* first_row, int64_t row_bytes, int64_t rows, int64_t offset, int64_t step) {
  if (offset % kLine >= step) return;
  const char* p = static_cast<const char*>(first_row) + offset + kPrefetchAhead;
  for (int64_t r = 0; r < rows; ++r) __builtin_prefetch(p + r * row_bytes, kWrite ? 1 : 0, 2);
}

// A tile is up to kTileVectors vectors of channels of one (head, group); its G rows are read and written in order,
// a whole row of the tile at a time (which the hardware prefetchers follow), not column by column.
constexpr int kTileVectors = 8;

template <class V, class X, class M>
inline void quantize_key_tile(const QuantizeJob& j, int64_t head, int64_t group, int64_t c0, int vectors) {
  constexpr int W = V::kWidth;
  const int64_t d = j.head_dim, g = j.group, bits = j.bits;
  const auto* x = static_cast<const typename X::T*>(j.x) + (head * j.tokens + group * g) * d + c0;
  Range<V> r[kTileVectors];
  for (int v = 0; v < vectors; ++v) r[v].start(load_as_float<V, X>(x + v * W));
  for (int64_t t = 1; t < g; ++t)
    for (int v = 0; v < vectors; ++v) r[v].add(load_as_float<V, X>(x + t * d + v * W));
  Params<V> p[kTileVectors];
  for (int v = 0; v < vectors; ++v) p[v] = group_params<V, M>(r[v], (float)((1 << bits) - 1));
  if (j.refit) {
    FitSums<V> sums[kTileVectors];
    for (int64_t t = 0; t < g; ++t)
      for (int v = 0; v < vectors; ++v) {
        const typename V::F xt = load_as_float<V, X>(x + t * d + v * W);
        sums[v].add(xt, V::to_float(quantize_lanes<V>(xt, p[v])));
      }
    for (int v = 0; v < vectors; ++v) refit_params<V, M>(p[v], sums[v], (float)g);
  }

  // Metadata [heads, D, groups]: lanes are `groups` elements apart.
  const int64_t groups = j.tokens / g, meta0 = (head * d + c0) * groups + group;
  const int64_t rows = (int64_t)vectors * W, meta_row = groups * (int64_t)sizeof(typename M::T);
  prefetch_rows<true>(static_cast<typename M::T*>(j.scales) + (meta0 - group), meta_row, rows,
                      group * (int64_t)sizeof(typename M::T), sizeof(typename M::T));
  prefetch_rows<true>(static_cast<typename M::T*>(j.zeros) + (meta0 - group), meta_row, rows,
                      group * (int64_t)sizeof(typename M::T), sizeof(typename M::T));
  for (int v = 0; v < vectors; ++v) {
    alignas(64) typename M::T scale[16], zero[16];
    store_from_float<V, M>(scale, p[v].scale);
    store_from_float<V, M>(zero, p[v].zero);
    for (int l = 0; l < W; ++l) {
      static_cast<typename M::T*>(j.scales)[meta0 + (v * W + l) * groups] = scale[l];
      static_cast<typename M::T*>(j.zeros)[meta0 + (v * W + l) * groups] = zero[l];
    }
  }

  // Codes [heads, D, tokens*bits/8]: each lane packs 32/bits tokens into a 32-bit word, written to its channel row.
  const int64_t row = j.tokens * bits / 8;
  uint8_t* out = j.codes + (head * d + c0) * row + group * g * bits / 8;
  prefetch_rows<true>(j.codes + (head * d + c0) * row, row, rows, group * g * bits / 8, g * bits / 8);
  const int64_t per_word = 32 / bits;
  for (int64_t t = 0; t < g; t += per_word) {
    const int64_t n = t + per_word <= g ? per_word : g - t;  // a multiple of 8 / bits
    typename V::I word[kTileVectors];
    for (int v = 0; v < vectors; ++v) word[v] = V::set1_i(0);
    for (int64_t k = 0; k < n; ++k)
      for (int v = 0; v < vectors; ++v)
        word[v] = V::or_i(word[v], V::shl(quantize_lanes<V>(load_as_float<V, X>(x + (t + k) * d + v * W), p[v]),
                                          (int)(k * bits)));
    for (int v = 0; v < vectors; ++v) {
      alignas(64) int32_t words[16];
      V::store_i(words, word[v]);
      uint8_t* lane_out = out + v * W * row + t * bits / 8;
      if (n == per_word) {  // a constant size: a plain 4-byte store, not a memcpy call
        for (int l = 0; l < W; ++l) __builtin_memcpy(lane_out + l * row, &words[l], 4);
      } else {
        for (int l = 0; l < W; ++l) __builtin_memcpy(lane_out + l * row, &words[l], (size_t)(n * bits / 8));
      }
    }
  }
}

template <class V, class M, class O>
inline void dequantize_key_tile(const DequantizeJob& j, int64_t head, int64_t group, int64_t c0, int vectors) {
  constexpr int W = V::kWidth;
  const int64_t d = j.head_dim, g = j.group, bits = j.bits;
  typename V::F scale[kTileVectors], zero[kTileVectors];
  const int64_t meta0 = (head * d + c0) * j.meta_len + group;
  const int64_t rows = (int64_t)vectors * W, meta_row = j.meta_len * (int64_t)sizeof(typename M::T);
  prefetch_rows<false>(static_cast<const typename M::T*>(j.scales) + (meta0 - group), meta_row, rows,
                       group * (int64_t)sizeof(typename M::T), sizeof(typename M::T));
  prefetch_rows<false>(static_cast<const typename M::T*>(j.zeros) + (meta0 - group), meta_row, rows,
                       group * (int64_t)sizeof(typename M::T), sizeof(typename M::T));
  for (int v = 0; v < vectors; ++v) {
    alignas(64) typename M::T scale_lanes[16], zero_lanes[16];  // gathered raw, converted as vectors
    for (int l = 0; l < W; ++l) {
      scale_lanes[l] = static_cast<const typename M::T*>(j.scales)[meta0 + (v * W + l) * j.meta_len];
      zero_lanes[l] = static_cast<const typename M::T*>(j.zeros)[meta0 + (v * W + l) * j.meta_len];
    }
    scale[v] = load_as_float<V, M>(scale_lanes), zero[v] = load_as_float<V, M>(zero_lanes);
  }
  const typename V::I mask = V::set1_i((1 << bits) - 1);
  const uint8_t* in = j.codes + (head * d + c0) * j.code_len + group * g * bits / 8;
  prefetch_rows<false>(j.codes + (head * d + c0) * j.code_len, j.code_len, rows, group * g * bits / 8, g * bits / 8);
  auto* out = static_cast<typename O::T*>(j.out) + (head * j.num_tokens + group * g) * d + c0;
  const int64_t per_word = 32 / bits;
  for (int64_t t = 0; t < g; t += per_word) {
    const int64_t n = t + per_word <= g ? per_word : g - t;
    typename V::I word[kTileVectors];
    for (int v = 0; v < vectors; ++v) {
      alignas(64) int32_t words[16];
      const uint8_t* lane_in = in + v * W * j.code_len + t * bits / 8;
      if (n == per_word) {
        for (int l = 0; l < W; ++l) __builtin_memcpy(&words[l], lane_in + l * j.code_len, 4);
      } else {
        for (int l = 0; l < W; ++l) {
          words[l] = 0;
          __builtin_memcpy(&words[l], lane_in + l * j.code_len, (size_t)(n * bits / 8));
        }
      }
      word[v] = V::load_i(words);
    }
    for (int64_t k = 0; k < n; ++k)
      for (int v = 0; v < vectors; ++v) {
        const typename V::I q = V::and_i(V::shr(word[v], (int)(k * bits)), mask);
        store_from_float<V, O>(out + (t + k) * d + v * W, dequantize_lanes<V>(q, scale[v], zero[v]));
      }
  }
}

// Calls tile(policy, c0, vectors) over the channels of a row: tiles of whole vectors, then single scalar channels.
template <class Tile>
inline void for_channel_tiles(int64_t head_dim, Tile&& tile) {
  const int64_t whole = head_dim / Vec::kWidth * Vec::kWidth;
  for (int64_t c = 0; c < whole; c += (int64_t)kTileVectors * Vec::kWidth) {
    const int64_t vectors = (whole - c) / Vec::kWidth;
    tile(Vec{}, c, (int)(vectors < kTileVectors ? vectors : kTileVectors));
  }
  for (int64_t c = whole; c < head_dim; ++c) tile(Scalar{}, c, 1);
}

template <class X, class M>
inline void quantize_keys_range(const QuantizeJob& j, int64_t begin, int64_t end) {
  const int64_t groups = j.tokens / j.group;
  for (int64_t task = begin; task < end; ++task)
    for_channel_tiles(j.head_dim, [&](auto policy, int64_t c0, int vectors) {
      quantize_key_tile<decltype(policy), X, M>(j, task / groups, task % groups, c0, vectors);
    });
}

template <class M, class O>
inline void dequantize_keys_range(const DequantizeJob& j, int64_t begin, int64_t end) {
  const int64_t groups = j.num_tokens / j.group;
  for (int64_t task = begin; task < end; ++task)
    for_channel_tiles(j.head_dim, [&](auto policy, int64_t c0, int vectors) {
      dequantize_key_tile<decltype(policy), M, O>(j, task / groups, task % groups, c0, vectors);
    });
}

// ---- values: groups are contiguous pieces of the rows, numbered flat across rows ------------------------------------
// Quantize handles a block of up to Vec::kWidth consecutive groups together: each group's min / max is read with its
// channels on the lanes (policy E: Vec, or Scalar when the group is not a whole number of vectors), then the
// parameters of the whole block are computed at once with the groups on the lanes (independent work instead of one
// long dependency chain per group), and their metadata, contiguous in memory, is stored as one vector.

constexpr int64_t kPiece = 256;  // codes staged one per byte between the float math and pack/unpack_codes

template <class E, class X, class M>
inline void quantize_value_block(const QuantizeJob& j, int64_t first, int64_t count) {
  constexpr int W = Vec::kWidth;
  const int64_t g = j.group;
  const int bits = (int)j.bits;
  const auto* x = static_cast<const typename X::T*>(j.x) + first * g;
  alignas(64) float lo[W], hi[W], check[W];
  for (int64_t k = 0; k < W; ++k) {
    if (k >= count) {
      lo[k] = hi[k] = check[k] = 0.0f;
      continue;
    }
    Range<E> lanes;
    lanes.start(load_as_float<E, X>(x + k * g));
    for (int64_t i = E::kWidth; i < g; i += E::kWidth) lanes.add(load_as_float<E, X>(x + k * g + i));
    lo[k] = E::reduce_min(lanes.lo), hi[k] = E::reduce_max(lanes.hi), check[k] = E::reduce_add(lanes.check);
  }
  Range<Vec> block;
  block.lo = Vec::load(lo), block.hi = Vec::load(hi), block.check = Vec::load(check);
  const Params<Vec> p = group_params<Vec, M>(block, (float)((1 << bits) - 1));
  alignas(64) float scale[W], zero[W], divisor[W], inverse[W], use[W];
  Vec::store(scale, p.scale);
  Vec::store(zero, p.zero);
  Vec::store(divisor, p.divisor);
  Vec::store(inverse, p.inverse);
  Vec::store(use, Vec::select(p.use, Vec::set1(1.0f), Vec::set1(0.0f)));
  if (j.refit) {
    // Group by group, element by element: the sums' order is the reference's.
    for (int64_t k = 0; k < count; ++k) {
      Params<Scalar> pk{scale[k], zero[k], divisor[k], inverse[k], (float)((1 << bits) - 1), use[k] > 0.0f};
      FitSums<Scalar> sums;
      for (int64_t i = 0; i < g; ++i) {
        const float xi = load_as_float<Scalar, X>(x + k * g + i);
        sums.add(xi, Scalar::to_float(quantize_lanes<Scalar>(xi, pk)));
      }
      refit_params<Scalar, M>(pk, sums, (float)g);
      scale[k] = pk.scale, zero[k] = pk.zero, divisor[k] = pk.divisor, inverse[k] = pk.inverse;
    }
  }
  alignas(64) typename M::T meta[W];
  store_from_float<Vec, M>(meta, Vec::load(scale));
  __builtin_memcpy(static_cast<typename M::T*>(j.scales) + first, meta, (size_t)count * sizeof(meta[0]));
  store_from_float<Vec, M>(meta, Vec::load(zero));
  __builtin_memcpy(static_cast<typename M::T*>(j.zeros) + first, meta, (size_t)count * sizeof(meta[0]));

  uint8_t* codes = j.codes + first * g * bits / 8;
  alignas(64) uint8_t q[kPiece];
  for (int64_t k = 0; k < count; ++k) {
    Params<E> pe;
    pe.zero = E::set1(zero[k]), pe.divisor = E::set1(divisor[k]), pe.inverse = E::set1(inverse[k]);
    pe.qmax = E::set1((float)((1 << bits) - 1));
    pe.use = E::gt(E::set1(use[k]), E::set1(0.0f));
    for (int64_t start = 0; start < g; start += kPiece) {
      const int64_t n = g - start < kPiece ? g - start : kPiece;
      for (int64_t i = 0; i < n; i += E::kWidth)
        E::store_u8(q + i, quantize_lanes<E>(load_as_float<E, X>(x + k * g + start + i), pe));
      pack_codes(q, n, bits, codes + (k * g + start) * bits / 8);
    }
  }
}

// Dequantizes the groups of one stored row. Metadata is converted one group at a time (a vector load of a few
// just-copied elements stalls on store forwarding, and a row holds only a few groups); where a group is whole vectors
// its codes are unpacked straight into lanes.
template <class E, class M, class O>
inline void dequantize_value_row(const DequantizeJob& j, int64_t head, int64_t t) {
  const int64_t g = j.group, groups = j.head_dim / g;
  const int bits = (int)j.bits;
  // Metadata and codes are read from the (over-allocated) storage rows, outputs written densely.
  const int64_t meta = (head * j.meta_len + t) * groups;
  const auto* scales = static_cast<const typename M::T*>(j.scales) + meta;
  const auto* zeros = static_cast<const typename M::T*>(j.zeros) + meta;
  const uint8_t* codes = j.codes + (head * j.code_len + t) * (j.head_dim * bits / 8);
  auto* out = static_cast<typename O::T*>(j.out) + (head * j.num_tokens + t) * j.head_dim;
  for (int64_t k = 0; k < groups; ++k) {
    const typename E::F s = E::set1(load_as_float<Scalar, M>(scales + k));
    const typename E::F z = E::set1(load_as_float<Scalar, M>(zeros + k));
    const uint8_t* group_codes = codes + k * g * bits / 8;
    auto* group_out = out + k * g;
    if constexpr (E::kWidth > 1) {
      for (int64_t i = 0; i < g; i += E::kWidth) {
        const typename E::I q = E::load_codes(group_codes + i * bits / 8, bits);
        store_from_float<E, O>(group_out + i, dequantize_lanes<E>(q, s, z));
      }
    } else {
      alignas(64) uint8_t q[kPiece];
      for (int64_t start = 0; start < g; start += kPiece) {
        const int64_t n = g - start < kPiece ? g - start : kPiece;
        unpack_codes(group_codes + start * bits / 8, n, bits, q);
        for (int64_t i = 0; i < n; ++i) store_from_float<E, O>(group_out + start + i, dequantize_lanes<E>(q[i], s, z));
      }
    }
  }
}

// Tasks are rows (head * tokens + token); quantize walks their groups as one flat range, dequantize row by row
// (the storage rows of values may be over-allocated, so the groups of two rows are not adjacent there).
template <class E, class X, class M>
inline void quantize_value_rows(const QuantizeJob& j, int64_t begin, int64_t end) {
  const int64_t groups = j.head_dim / j.group, last = end * groups;
  for (int64_t first = begin * groups; first < last; first += Vec::kWidth)
    quantize_value_block<E, X, M>(j, first, last - first < Vec::kWidth ? last - first : Vec::kWidth);
}

template <class E, class M, class O>
inline void dequantize_value_rows(const DequantizeJob& j, int64_t begin, int64_t end) {
  int64_t head = begin / j.num_tokens, t = begin % j.num_tokens;  // one division per range, not per row
  for (int64_t task = begin; task < end; ++task) {
    dequantize_value_row<E, M, O>(j, head, t);
    if (++t == j.num_tokens) t = 0, ++head;
  }
}

// A group that is not a whole number of vectors runs its element math on the scalar policy.
template <class X, class M>
inline void quantize_values_range(const QuantizeJob& j, int64_t begin, int64_t end) {
  if (j.group % Vec::kWidth == 0) {
    quantize_value_rows<Vec, X, M>(j, begin, end);
  } else {
    quantize_value_rows<Scalar, X, M>(j, begin, end);
  }
}

template <class M, class O>
inline void dequantize_values_range(const DequantizeJob& j, int64_t begin, int64_t end) {
  if (j.group % Vec::kWidth == 0) {
    dequantize_value_rows<Vec, M, O>(j, begin, end);
  } else {
    dequantize_value_rows<Scalar, M, O>(j, begin, end);
  }
}

// Calls f(tag) with the element-type tag of a run-time dtype.
template <class Fn>
inline void with_dtype(Dtype dtype, Fn&& f) {
  switch (dtype) {
    case kF32:
      f(F32{});
      break;
    case kF16:
      f(F16{});
      break;
    case kBF16:
      f(BF16{});
      break;
  }
}

inline void quantize_keys(const QuantizeJob& j, int64_t begin, int64_t end) {
  with_dtype(j.x_dtype, [&](auto x) {
    with_dtype(j.meta_dtype, [&](auto m) { quantize_keys_range<decltype(x), decltype(m)>(j, begin, end); });
  });
}

inline void quantize_values(const QuantizeJob& j, int64_t begin, int64_t end) {
  with_dtype(j.x_dtype, [&](auto x) {
    with_dtype(j.meta_dtype, [&](auto m) { quantize_values_range<decltype(x), decltype(m)>(j, begin, end); });
  });
}

inline void dequantize_keys(const DequantizeJob& j, int64_t begin, int64_t end) {
  with_dtype(j.meta_dtype, [&](auto m) {
    with_dtype(j.out_dtype, [&](auto o) { dequantize_keys_range<decltype(m), decltype(o)>(j, begin, end); });
  });
}

inline void dequantize_values(const DequantizeJob& j, int64_t begin, int64_t end) {
  with_dtype(j.meta_dtype, [&](auto m) {
    with_dtype(j.out_dtype, [&](auto o) { dequantize_values_range<decltype(m), decltype(o)>(j, begin, end); });
  });
}
