// Rows times a rotation matrix, out[r] (+)= x[r] @ m, exported under the names the TU's macros give:
// KIVI_DA_ROWS_TIMES (the rotations of the query rows and of the packed values' sums) and KIVI_DA_ROTATE_ROWS (of the
// value tokens quantize_values_into stores); see kivi_xpu/rotation.py. A part of the chunk kernel, not a standalone
// header: decode_attention_impl.h includes it after its anonymous namespace, once per ISA translation unit (this
// layout, column_block included, keeps the compiled code of the whole TU as it was before the split).

// Columns [j, j + NV * VW) of each row: o_j += sum_d x_d * m_dj, d in order (as an axpy per d would add them), the
// sums in registers across d: an axpy per d into the output row in memory chained every d on a store and a reload of
// the row.
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
