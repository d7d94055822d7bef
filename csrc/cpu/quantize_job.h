// Plain-data description of one quantize / dequantize call, shared by quantize.cpp and the kernels of each ISA
// (quantize_impl.h, compiled in isa_<name>.cpp). No templates and no torch types: the ISA translation units include
// it before their `#pragma GCC target` region.
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
  bool refit;  // fit="least_squares" (reference.py)
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

// The kernels (KernelTable's quantize_keys ... dequantize_values, kernel_table.h) each handle tasks [begin, end) of a
// job: keys task = head * (tokens / group) + group index (all channels); values task = head * tokens + token (one
// row, all its groups).

}  // namespace kivi::cpu::quant
