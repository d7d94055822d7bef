// Run-time choice of the SIMD instruction set the native CPU kernels use.
//
// The best ISA this CPU supports, unless the environment variable KIVI_XPU_CPU_ISA (avx512_vnni | avx512 | avx2 |
// baseline)
// asks for another one (an ISA the CPU lacks is refused with an error). Tests may force one with set_isa().
#pragma once
#include <string>
#include <vector>

namespace kivi::cpu {

enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

// What the per-ISA translation units are compiled for:
//   avx512_vnni: avx512 + AVX-512 VNNI (only the decode attention's integer dot products differ; quantization runs
//   the avx512 kernels);  avx512: AVX-512 F/BW/VL/DQ + AVX2, FMA, F16C, BMI2;  avx2: AVX2, FMA, F16C, BMI2;
//   baseline: x86-64 (SSE2).
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
