// The decode attention chunk kernel compiled for AVX-512 with VNNI: the avx512 kernel whose integer dot products are
// vpdpbusd (DotSum in decode_int8.h) instead of vpmaddubsw + vpmaddwd; see decode_attention_impl.h.
// Headers first, outside the target region, so no std / torch code is compiled for this ISA.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "decode_attention.h"

// GCC 12 flags its own _mm512 set/undefined helpers as maybe-uninitialized (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
#define KIVI_SIMD_AVX512 1
#define KIVI_SIMD_VNNI 1
#define KIVI_DA_ENTRY chunk_avx512_vnni
#define KIVI_DA_ROWS_TIMES rows_times_avx512_vnni
#define KIVI_DA_ROTATE_ROWS rotate_rows_avx512_vnni
#include "decode_attention_impl.h"
#pragma GCC pop_options
