// The quantize kernels compiled for the baseline ISA (isa_list.h; see isa_quantize.h): simd.h's Scalar policy.
#define KIVI_ISA baseline
#include "isa_quantize.h"
