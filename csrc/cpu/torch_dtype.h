// The kernels' Dtype of a torch float dtype, for the host files that take torch tensors (each says in its own words
// which dtypes its argument accepts). Not for the ISA translation units: it includes torch.
#pragma once
#include <torch/extension.h>

#include "dtype.h"

namespace kivi::cpu {

// Sets `out` and returns true for float32, float16 and bfloat16; returns false for any other dtype.
inline bool kernel_dtype(at::ScalarType type, Dtype* out) {
  switch (type) {
    case at::kFloat: *out = kF32; return true;
    case at::kHalf: *out = kF16; return true;
    case at::kBFloat16: *out = kBF16; return true;
    default: return false;
  }
}

}  // namespace kivi::cpu
