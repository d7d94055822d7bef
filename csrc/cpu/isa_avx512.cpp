// The kernels of the avx512 ISA (isa_list.h; see isa_kernels.h): AVX-512 F/BW/VL/DQ, 16 float lanes (simd.h's Vec).
#define KIVI_ISA avx512
#define KIVI_SIMD_AVX512 1
#include "isa_kernels.h"
