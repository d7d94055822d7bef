// Plain-data description of one quantize / dequantize call, shared by the dispatcher (quantize.cpp) and the
// per-ISA kernels (quantize_{avx512,avx2,baseline}.cpp). No templates and no torch types, so the ISA translation
// units can include it inside their `#pragma GCC target` region.
#pragma once
#include <cstdint>

#include "dtype.h"

namespace kivi::cpu::quant {


// x [heads, tokens, head_dim] (heads = B*H, contiguous) -> codes, scales, zeros (contiguous):
//   keys:   codes [heads, head_dim, tokens*bits/8], meta [heads, head_dim, tokens/group];
//   values: codes [heads, tokens, head_dim*bits/8], meta [heads, tokens, head_dim/group].
struct QuantizeJob {
  const void* x;
  Dtype x_dtype, meta_dtype;
  uint8_t* codes;
  void* scales;
  void* zeros;
  int64_t heads, tokens, head_dim, group, bits;
};

// Packed (possibly over-allocated, contiguous) -> out [heads, num_tokens, head_dim] (contiguous):
//   keys:   codes [heads, head_dim, code_len] bytes, meta [heads, head_dim, meta_len] groups (capacities);
//   values: codes [heads, code_len, head_dim*bits/8], meta [heads, meta_len, head_dim/group] (token capacities).
struct DequantizeJob {
  const uint8_t* codes;
  const void* scales;
  const void* zeros;
  Dtype meta_dtype, out_dtype;
  void* out;
  int64_t heads, num_tokens, head_dim, group, bits, code_len, meta_len;
};

// Each kernel handles tasks [begin, end): keys task = head * (tokens / group) + group index (all channels);
// values task = head * tokens + token (one row, all its groups).
#define KIVI_QUANT_DECLARE(isa)                                                            \
  void quantize_keys_##isa(const QuantizeJob& job, int64_t begin, int64_t end);           \
  void quantize_values_##isa(const QuantizeJob& job, int64_t begin, int64_t end);         \
  void dequantize_keys_##isa(const DequantizeJob& job, int64_t begin, int64_t end);       \
  void dequantize_values_##isa(const DequantizeJob& job, int64_t begin, int64_t end);
KIVI_QUANT_DECLARE(avx512)
KIVI_QUANT_DECLARE(avx2)
KIVI_QUANT_DECLARE(baseline)
#undef KIVI_QUANT_DECLARE

}  // namespace kivi::cpu::quant
