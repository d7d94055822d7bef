// The kernels of the avx512_vnni ISA (isa_list.h; see isa_kernels.h): the avx512 decode attention whose integer dot
// products are vpdpbusd (decode_int8.h's DotSum) instead of vpmaddubsw + vpmaddwd. Quantization has no integer
// products: it runs avx512's kernels.
#define KIVI_ISA avx512_vnni
#define KIVI_SIMD_AVX512 1
#define KIVI_SIMD_VNNI 1
#define KIVI_ISA_QUANTIZE_OF avx512
#include "isa_kernels.h"
