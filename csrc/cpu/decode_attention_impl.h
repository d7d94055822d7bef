// Chunk kernel of the fused decode attention, written once over a small vector layer and compiled once per ISA:
// each isa_<name>.cpp defines KIVI_SIMD_AVX512 / KIVI_SIMD_AVX2 (neither: baseline) as simd.h wants, and
// isa_kernels.h defines KIVI_DA_ENTRY, opens the ISA's `#pragma GCC target` region and includes this file.
// Everything here has internal linkage (anonymous namespace) and uses no std templates, so no instruction of one ISA
// can leak into another TU through a shared symbol.
//
// One chunk = the positions [p0, p1) of one (batch, kv head); all query rows of that kv head are handled together
// so each packed byte comes from memory once. Keys use KIVI's factored dequantization per group g and channel d:
//   score_t = sum_d (q_d * s_gd) * c_td + sum_d q_d * z_gd       (vectorised along tokens)
// values per token t and channel group g:
//   out_d  += p_t * (s_tg * c_td)  and  zsum_g += p_t * z_tg     (vectorised along channels; zsum added at the end)
// The chunk's scores become exp(score - chunk max) in place; the chunk max, sum and unnormalised output go to its
// partial, merged in order by the dispatcher.
//
// The kernel is split by idea into parts, included here inside the anonymous namespace: decode_kernel_common.h
// (shared helpers), decode_int8.h (the integer dot products, AVX2 and up), decode_keys.h (scores), decode_values.h
// (value sums), decode_chunk.h (softmax and run_chunk, one task); then what a TU exports, under the names its macros
// give: the chunk entry and decode_rotation.h (rows times a rotation matrix).
#if !defined(KIVI_DA_ENTRY) || !defined(KIVI_DA_ROWS_TIMES) || !defined(KIVI_DA_ROTATE_ROWS)
#error "define KIVI_DA_ENTRY, KIVI_DA_ROWS_TIMES, KIVI_DA_ROTATE_ROWS (<name>_<isa>) before including this file"
#endif

namespace kivi::cpu::decode {
namespace {

#include "simd.h"         // the vector layer, with internal linkage here
#include "phase_timer.h"  // PhaseTimer, likewise
#include "decode_kernel_common.h"
#if defined(KIVI_SIMD_AVX512) || defined(KIVI_SIMD_AVX2)
#define KIVI_DA_INTEGER 1
#include "decode_int8.h"  // the integer dot products (KIVI_XPU_CPU_DOT=int8)
#endif
#include "decode_keys.h"
#include "decode_values.h"
#include "decode_chunk.h"

}  // namespace

void KIVI_DA_ENTRY(const Problem& p, int64_t task) { run_chunk(p, task); }

#include "decode_rotation.h"  // KIVI_DA_ROWS_TIMES, KIVI_DA_ROTATE_ROWS

}  // namespace kivi::cpu::decode
