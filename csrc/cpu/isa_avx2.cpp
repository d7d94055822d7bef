// The kernels of the avx2 ISA (isa_list.h; see isa_kernels.h): AVX2 + FMA + F16C, 8 float lanes (simd.h's Vec256).
#define KIVI_ISA avx2
#define KIVI_SIMD_AVX2 1
#include "isa_kernels.h"
