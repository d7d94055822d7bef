// Quantize / dequantize kernels compiled for the avx2 ISA (see quantize_impl.h; chosen at run time by quantize.cpp).
// Headers first: nothing from the std library or torch may be instantiated inside the target region below.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quantize_job.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#pragma GCC optimize("fp-contract=off")
#define KIVI_SIMD_AVX2 1

namespace kivi::cpu::quant {
namespace avx2 {
namespace {
#include "simd.h"
#include "quantize_impl.h"
}  // namespace
}  // namespace avx2

void quantize_keys_avx2(const QuantizeJob& job, int64_t begin, int64_t end) { avx2::quantize_keys(job, begin, end); }
void quantize_values_avx2(const QuantizeJob& job, int64_t begin, int64_t end) {
  avx2::quantize_values(job, begin, end);
}
void dequantize_keys_avx2(const DequantizeJob& job, int64_t begin, int64_t end) {
  avx2::dequantize_keys(job, begin, end);
}
void dequantize_values_avx2(const DequantizeJob& job, int64_t begin, int64_t end) {
  avx2::dequantize_values(job, begin, end);
}

}  // namespace kivi::cpu::quant

#pragma GCC pop_options
