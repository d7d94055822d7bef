// The quantize kernels compiled for the avx2 ISA (isa_list.h; see isa_quantize.h).
#define KIVI_ISA avx2
#define KIVI_SIMD_AVX2 1
#include "isa_quantize.h"
