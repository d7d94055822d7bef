// The body of every isa_<name>_quantize.cpp: the quantize / dequantize kernels (quantize_impl.h) compiled for one ISA
// of isa_list.h and exported as its QuantizeKernels, quantize_kernels_<name> (kernel_table.h), which the ISA's
// KernelTable points to (isa_kernels.h). The TU defines KIVI_ISA and simd.h's KIVI_SIMD_AVX512 / KIVI_SIMD_AVX2, then
// includes this file. As in isa_kernels.h: headers first, outside the target region; the kernels in an anonymous
// namespace; only the table and its entries have external linkage.
#if !defined(KIVI_ISA)
#error "define KIVI_ISA (a name of isa_list.h) before including isa_quantize.h"
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "isa_list.h"
#include "kernel_table.h"
#include "quantize_job.h"

#pragma GCC push_options
KIVI_TARGET_FEATURES(KIVI_ISA)
// Bit-exact with the reference: x' = q * scale + zero rounds twice, so no multiply-add may be fused.
#pragma GCC optimize("fp-contract=off")
namespace kivi::cpu::quant {
namespace {
#include "simd.h"
#include "quantize_impl.h"
}  // namespace

// The entries, external as quantize_keys_<name> ...: with the table pointing at the anonymous functions themselves,
// GCC compiled them differently.
#define KIVI_QUANTIZE_ENTRY(kernel, Job) \
  void KIVI_ISA_SYMBOL(kernel##_, KIVI_ISA)(const Job& job, int64_t begin, int64_t end) { kernel(job, begin, end); }
KIVI_QUANTIZE_ENTRY(quantize_keys, QuantizeJob)
KIVI_QUANTIZE_ENTRY(quantize_values, QuantizeJob)
KIVI_QUANTIZE_ENTRY(dequantize_keys, DequantizeJob)
KIVI_QUANTIZE_ENTRY(dequantize_values, DequantizeJob)
#undef KIVI_QUANTIZE_ENTRY

}  // namespace kivi::cpu::quant
#pragma GCC pop_options

namespace kivi::cpu {

extern const QuantizeKernels KIVI_QUANTIZE_KERNELS_OF(KIVI_ISA) = {  // (extern: a const is local by default)
    quant::KIVI_ISA_SYMBOL(quantize_keys_, KIVI_ISA),
    quant::KIVI_ISA_SYMBOL(quantize_values_, KIVI_ISA),
    quant::KIVI_ISA_SYMBOL(dequantize_keys_, KIVI_ISA),
    quant::KIVI_ISA_SYMBOL(dequantize_values_, KIVI_ISA),
};

}  // namespace kivi::cpu
