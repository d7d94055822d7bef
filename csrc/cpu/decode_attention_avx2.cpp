// The decode attention chunk kernel compiled for AVX2 + FMA + F16C: see decode_attention_impl.h.
// Headers first, outside the target region, so no std / torch code is compiled for this ISA.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "decode_attention.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#define KIVI_SIMD_AVX2 1
#define KIVI_DA_ENTRY chunk_avx2
#define KIVI_DA_ROWS_TIMES rows_times_avx2
#define KIVI_DA_ROTATE_ROWS rotate_rows_avx2
#include "decode_attention_impl.h"
#pragma GCC pop_options
