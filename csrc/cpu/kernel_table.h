// The kernels of one ISA as a table of function pointers (as ggml-cpu's type traits): every isa_<name>.cpp exports
// one, kernels_<name>, and kernels() (isa.cpp) hands out the table of the ISA in use, the only place the choice is
// made. Callers take an entry once per call or per task, never inside an inner loop. No templates and no torch types
// here, so the ISA translation units can include it before their target region.
#pragma once
#include <cstdint>

#include "decode_attention.h"
#include "dtype.h"
#include "isa_list.h"
#include "quantize_job.h"

namespace kivi::cpu {

// The quantize / dequantize kernels of an ISA (isa_<name>_quantize.cpp): each handles tasks [begin, end) of a job
// (quantize_job.h).
struct QuantizeKernels {
  void (*quantize_keys)(const quant::QuantizeJob& job, int64_t begin, int64_t end);
  void (*quantize_values)(const quant::QuantizeJob& job, int64_t begin, int64_t end);
  void (*dequantize_keys)(const quant::DequantizeJob& job, int64_t begin, int64_t end);
  void (*dequantize_values)(const quant::DequantizeJob& job, int64_t begin, int64_t end);
};

struct KernelTable {
  // The fused decode attention (decode_attention.h): one task = one (batch, kv head, chunk) of `p`, its scores and
  // its partial.
  void (*chunk)(const decode::Problem& p, int64_t task);
  // out[r] = x[r] @ m (or out[r] += x[r] @ m with `accumulate`) for `rows` rows of `dim` floats, m [dim, dim]
  // row-major: the rotations of the query and of the packed values' sum (see kivi_xpu/rotation.py).
  void (*rows_times)(const float* x, const float* m, int64_t rows, int64_t dim, float* out, bool accumulate);
  // out[r] = x[r] @ m in fp32 for `rows` contiguous rows of `dim` (<= decode::kMaxDim) elements of `dtype`: the
  // rotation of the value tokens that quantize_values_into stores (quantize.cpp).
  void (*rotate_rows)(const void* x, Dtype dtype, int64_t rows, int64_t dim, const float* m, float* out);
  // Quantization, compiled in a translation unit of its own (isa_kernels.h says why), or another ISA's.
  const QuantizeKernels* quantize;
};

// kernels_<name>, quantize_kernels_<name>: the tables an ISA's translation units export (isa_kernels.h,
// isa_quantize.h); isa.cpp reads the former for every ISA of the list.
#define KIVI_ISA_SYMBOL(prefix, name) KIVI_ISA_SYMBOL_(prefix, name)
#define KIVI_ISA_SYMBOL_(prefix, name) prefix##name
#define KIVI_KERNELS_OF(name) KIVI_ISA_SYMBOL(kernels_, name)
#define KIVI_QUANTIZE_KERNELS_OF(name) KIVI_ISA_SYMBOL(quantize_kernels_, name)

#define KIVI_DECLARE_KERNEL_TABLE(enumerator, name) extern const KernelTable kernels_##name;
KIVI_CPU_ISAS(KIVI_DECLARE_KERNEL_TABLE)
#undef KIVI_DECLARE_KERNEL_TABLE

// The table of current_isa() (isa.h).
const KernelTable& kernels();

}  // namespace kivi::cpu
