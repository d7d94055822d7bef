// The body of every ISA translation unit isa_<name>.cpp: the decode attention kernels compiled for one ISA of
// isa_list.h, and the ISA's KernelTable, kernels_<name> (kernel_table.h). The TU defines, then includes this file:
//   KIVI_ISA               its name in isa_list.h (the CPU features it is compiled for come from there);
//   KIVI_SIMD_AVX512 / KIVI_SIMD_AVX2 / KIVI_SIMD_VNNI: simd.h's policies (and decode_int8.h's products) for it;
//   KIVI_ISA_QUANTIZE_OF   optional: the ISA whose quantize kernels it uses, else its own (isa_<name>_quantize.cpp).
// Quantization has a translation unit of its own (isa_quantize.h) because GCC's inliner shares one growth budget per
// translation unit: in one unit with the attention, each part's inlining, hence its code, came out different.
// The headers come first, outside the target region, so no std / torch code is compiled for the ISA; the kernels are
// included inside an anonymous namespace (decode_attention_impl.h), so that the linker can never hand an instance
// compiled for one ISA to code running on another. Only the table and the three entries it holds have external
// linkage.
#if !defined(KIVI_ISA)
#error "define KIVI_ISA (a name of isa_list.h) before including isa_kernels.h"
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "decode_attention.h"
#include "isa_list.h"
#include "kernel_table.h"

#if defined(KIVI_SIMD_AVX512)
// GCC 12 flags its own _mm512 set/undefined helpers as maybe-uninitialized (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#pragma GCC push_options
KIVI_TARGET_FEATURES(KIVI_ISA)
// The three functions decode_attention_impl.h exports, as chunk_<name>, rows_times_<name>, rotate_rows_<name>. No
// header declares them: the table below is their only user. (Declared static, GCC's inlining came out different.)
#define KIVI_DA_ENTRY KIVI_ISA_SYMBOL(chunk_, KIVI_ISA)
#define KIVI_DA_ROWS_TIMES KIVI_ISA_SYMBOL(rows_times_, KIVI_ISA)
#define KIVI_DA_ROTATE_ROWS KIVI_ISA_SYMBOL(rotate_rows_, KIVI_ISA)
#include "decode_attention_impl.h"
#pragma GCC pop_options

#if !defined(KIVI_ISA_QUANTIZE_OF)
#define KIVI_ISA_QUANTIZE_OF KIVI_ISA
#endif

namespace kivi::cpu {

extern const QuantizeKernels KIVI_QUANTIZE_KERNELS_OF(KIVI_ISA_QUANTIZE_OF);

extern const KernelTable KIVI_KERNELS_OF(KIVI_ISA) = {  // (extern: a const is local by default)
    decode::KIVI_DA_ENTRY,
    decode::KIVI_DA_ROWS_TIMES,
    decode::KIVI_DA_ROTATE_ROWS,
    &KIVI_QUANTIZE_KERNELS_OF(KIVI_ISA_QUANTIZE_OF),
};

}  // namespace kivi::cpu
