// Quantize / dequantize kernels compiled for the avx512 ISA (see quantize_impl.h; chosen at run time by quantize.cpp).
// Headers first: nothing from the std library or torch may be instantiated inside the target region below.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quantize_job.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi2")
#pragma GCC optimize("fp-contract=off")
#define KIVI_SIMD_AVX512 1

namespace kivi::cpu::quant {
namespace avx512 {
namespace {
#include "simd.h"
#include "quantize_impl.h"
}  // namespace
}  // namespace avx512

void quantize_keys_avx512(const QuantizeJob& job, int64_t begin, int64_t end) { avx512::quantize_keys(job, begin, end); }
void quantize_values_avx512(const QuantizeJob& job, int64_t begin, int64_t end) {
  avx512::quantize_values(job, begin, end);
}
void dequantize_keys_avx512(const DequantizeJob& job, int64_t begin, int64_t end) {
  avx512::dequantize_keys(job, begin, end);
}
void dequantize_values_avx512(const DequantizeJob& job, int64_t begin, int64_t end) {
  avx512::dequantize_values(job, begin, end);
}

}  // namespace kivi::cpu::quant

#pragma GCC pop_options
