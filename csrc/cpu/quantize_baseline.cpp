// Quantize / dequantize kernels compiled for the baseline ISA (see quantize_impl.h; chosen at run time by quantize.cpp).
// Headers first: nothing from the std library or torch may be instantiated inside the target region below.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quantize_job.h"

#pragma GCC push_options
// x86-64 baseline: no target pragma, scalar policy only.
#pragma GCC optimize("fp-contract=off")


namespace kivi::cpu::quant {
namespace baseline {
namespace {
#include "simd.h"
#include "quantize_impl.h"
}  // namespace
}  // namespace baseline

void quantize_keys_baseline(const QuantizeJob& job, int64_t begin, int64_t end) { baseline::quantize_keys(job, begin, end); }
void quantize_values_baseline(const QuantizeJob& job, int64_t begin, int64_t end) {
  baseline::quantize_values(job, begin, end);
}
void dequantize_keys_baseline(const DequantizeJob& job, int64_t begin, int64_t end) {
  baseline::dequantize_keys(job, begin, end);
}
void dequantize_values_baseline(const DequantizeJob& job, int64_t begin, int64_t end) {
  baseline::dequantize_values(job, begin, end);
}

}  // namespace kivi::cpu::quant

#pragma GCC pop_options
