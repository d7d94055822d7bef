// Run-time choice of the SIMD instruction set (ISA) the native CPU kernels use, among those of isa_list.h.
//
// The best ISA this CPU supports, unless the environment variable KIVI_XPU_CPU_ISA (a name of isa_list.h:
// avx512_vnni | avx512 | avx2 | baseline) asks for another one (an ISA the CPU lacks is refused with an error). Tests
// may force one with set_isa(). kernels() (kernel_table.h) gives the kernels of the ISA in use.
#pragma once
#include <string>
#include <vector>

#include "isa_list.h"

namespace kivi::cpu {

#define KIVI_ISA_ENUMERATOR(enumerator, name) enumerator,
enum class Isa : int { KIVI_CPU_ISAS(KIVI_ISA_ENUMERATOR) };  // best first
#undef KIVI_ISA_ENUMERATOR

// What each ISA needs of the CPU, and is compiled for, is in isa_list.h.
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);
Isa parse_isa(const std::string& name);  // throws (c10::Error -> ValueError) naming the allowed values
std::vector<std::string> available_isas();  // best first

// The ISA in use: set_isa()'s choice, else KIVI_XPU_CPU_ISA, else the best supported (decided at first call).
Isa current_isa();
void set_isa(Isa isa);  // throws if the CPU lacks it

// Arithmetic of the fused decode attention on packed 2/4-bit codes: int8 (integer dot products with 8-bit query and
// probability factors; the default) or fp32 (codes converted to floats: the exact twin of the reference). The
// baseline ISA always uses fp32. KIVI_XPU_CPU_DOT (int8 | fp32) sets it for a process, set_dot() for later calls.
enum class Dot : int { kFp32 = 0, kInt8 = 1 };
Dot current_dot();
void set_dot(Dot dot);
Dot parse_dot(const std::string& name);  // throws (ValueError) naming the allowed values
const char* dot_name(Dot dot);

}  // namespace kivi::cpu
