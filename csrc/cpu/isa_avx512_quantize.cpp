// The quantize kernels compiled for the avx512 ISA (isa_list.h; see isa_quantize.h); avx512_vnni uses them too.
#define KIVI_ISA avx512
#define KIVI_SIMD_AVX512 1
#include "isa_quantize.h"
