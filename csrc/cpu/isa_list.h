// The instruction sets (ISAs) of the native CPU kernels, written once: each one's name, the CPU features it needs
// (both what isa.cpp checks at run time and what its translation unit isa_<name>.cpp is compiled for), best first.
// Plain preprocessor, no includes, so the ISA translation units can read it before their target region.
//
// To add an ISA: a KIVI_FEATURES_<name> line and an entry in KIVI_CPU_ISAS below (best first), its translation unit
// isa_<name>.cpp (see isa_kernels.h) and, unless it runs another ISA's quantize kernels, isa_<name>_quantize.cpp (see
// isa_quantize.h). The Isa enum, isa.cpp's checks, names and table lookup, the tables' declarations and the Python
// names (available_isas, set_isa, KIVI_XPU_CPU_ISA) all follow from the list.
#pragma once

// The CPU features of each ISA, as F(feature) per feature: spelled as both `__builtin_cpu_supports` and
// `#pragma GCC target` take them. BMI (andn, blsr, tzcnt) comes with every CPU that has AVX2, and the compiler may use
// it in scalar code, so it is checked and targeted with the rest.
#define KIVI_FEATURES_avx2(F) F(avx2) F(fma) F(f16c) F(bmi) F(bmi2)
#define KIVI_FEATURES_avx512(F) KIVI_FEATURES_avx2(F) F(avx512f) F(avx512bw) F(avx512vl) F(avx512dq)
#define KIVI_FEATURES_avx512_vnni(F) KIVI_FEATURES_avx512(F) F(avx512vnni)
#define KIVI_FEATURES_baseline(F)  // x86-64 (SSE2): the compiler's default target

// X(Enumerator, name): every ISA, best first (the order available_isas() reports and the default choice follows).
#define KIVI_CPU_ISAS(X)        \
  X(kAvx512Vnni, avx512_vnni)   \
  X(kAvx512, avx512)            \
  X(kAvx2, avx2)                \
  X(kBaseline, baseline)

// KIVI_ISA_FEATURES(name)(F): F(feature) for each feature of ISA `name` (which may itself be a macro).
#define KIVI_ISA_FEATURES(name) KIVI_ISA_FEATURES_(name)
#define KIVI_ISA_FEATURES_(name) KIVI_FEATURES_##name

// KIVI_TARGET_FEATURES(name): one `#pragma GCC target("<feature>")` per feature of ISA `name` (successive target
// pragmas add up), for use after `#pragma GCC push_options`; through _Pragma, so that the strings come from the list.
#define KIVI_PRAGMA(text) _Pragma(#text)
#define KIVI_TARGET_FEATURE(feature) KIVI_PRAGMA(GCC target(#feature))
#define KIVI_TARGET_FEATURES(name) KIVI_ISA_FEATURES(name)(KIVI_TARGET_FEATURE)
