// The kernels of the baseline ISA (isa_list.h; see isa_kernels.h), the compiler's default x86-64 target (SSE2), for
// CPUs without AVX2: the decode attention on simd.h's 4-lane Vec4, fp32 arithmetic only (decode_int8.h needs AVX2).
#define KIVI_ISA baseline
#include "isa_kernels.h"
