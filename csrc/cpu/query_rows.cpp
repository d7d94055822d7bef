// See query_rows.h.
#include "query_rows.h"

#include <cstring>
#include <vector>

#include "decode_attention.h"

namespace kivi::cpu::decode {

QueryRows query_rows(const at::Tensor& query, double scaling, const float* key_rotation, int64_t workspace_floats) {
  const at::Tensor q32 = query.scalar_type() == at::kFloat ? query : query.to(at::kFloat);
  const int64_t B = q32.size(0), H = q32.size(1), L = q32.size(2), D = q32.size(3), rows = B * H * L;
  // the workspace starts 64-byte aligned after the rows
  const int64_t row_floats = ((key_rotation != nullptr ? 2 : 1) * rows * D + 15) / 16 * 16;
  QueryRows out;
  out.storage = at::empty({row_floats + workspace_floats}, q32.options().dtype(at::kFloat));  // (64-byte aligned)
  float* scaled = out.storage.data_ptr<float>();
  out.workspace = scaled + row_floats;
  const float* src = q32.data_ptr<float>();
  const int64_t sb = q32.stride(0), sh = q32.stride(1), sl = q32.stride(2), sd = q32.stride(3);
  const float s = (float)scaling;
  for (int64_t b = 0, r = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l, ++r) {
        const float* x = src + b * sb + h * sh + l * sl;
        float* y = scaled + r * D;
        for (int64_t d = 0; d < D; ++d) y[d] = x[d * sd] * s;
      }
  out.scaled = scaled;
  out.rotated = scaled;
  if (key_rotation != nullptr) {
    float* rotated = scaled + rows * D;
    rows_times(scaled, key_rotation, rows, D, rotated, false);
    out.rotated = rotated;
  }
  return out;
}

const float* transposed(const float* q, int64_t dim) {
  thread_local std::vector<float> source, result;
  const size_t n = (size_t)(dim * dim);
  if (source.size() != n || std::memcmp(source.data(), q, n * sizeof(float)) != 0) {
    source.assign(q, q + n);
    result.resize(n);
    for (int64_t i = 0; i < dim; ++i)
      for (int64_t j = 0; j < dim; ++j) result[j * dim + i] = q[i * dim + j];
  }
  return result.data();
}

}  // namespace kivi::cpu::decode
