// Native quantize entry points that other native files call (decode_step.cpp); the rest of quantize.cpp is reached
// only through its Python bindings.
#pragma once
#include <torch/extension.h>

namespace kivi::cpu {

// x [B,H,n,D] (rows of one batch/head contiguous; batch and head may be strided) quantized per token into rows
// [offset, offset + n) of value storage codes [B,H,capacity,D*bits/8], scales/zeros [B,H,capacity,D/G]; with a
// rotation Q [D,D] float32, x @ Q is stored; `fit` "minmax" or "least_squares" (kivi_xpu/ops/reference.py).
void quantize_values_into(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t offset, int64_t group_size, int64_t bits,
                          const c10::optional<at::Tensor>& rotation, const std::string& fit);

// Whether `fit` (the argument `name`) asks for the least-squares refit; raises on an unknown fit.
bool least_squares_fit(const std::string& fit, const char* name);

}  // namespace kivi::cpu
