// What the keys, values and chunk parts share: the vector aliases, row loads, dot and axpy, and the query rows
// in sets of up to 4 (RowSet, with_row_count, for_row_sets).
// A part of the chunk kernel, not a standalone header: decode_attention_impl.h includes it inside its anonymous
// namespace, after simd.h and the parts before it, once per ISA translation unit.

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

// out[0, count) = row converted to fp32, zeros in out[count, padded): a ragged block read as a whole one.
inline void load_row_padded(const void* base, Dtype dtype, int64_t offset, int64_t count, int64_t padded, float* out) {
  load_row(base, dtype, offset, count, out);
  for (int64_t i = count; i < padded; ++i) out[i] = 0.0f;
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

// The metadata dtype as a constant of a loop: with_dtype(dtype, f) calls f(DtypeSet<dtype>{}), and f reads it as
// decltype(set)::kDtype (a switch outside the loop instead of one per load).
template <Dtype DT>
struct DtypeSet {
  static constexpr Dtype kDtype = DT;
};
template <typename F>
inline auto with_dtype(Dtype dtype, F f) {
  switch (dtype) {
    case kF32: return f(DtypeSet<kF32>{});
    case kF16: return f(DtypeSet<kF16>{});
    default: return f(DtypeSet<kBF16>{});
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
