// The decode attention chunk kernel compiled for the compiler's default target (x86-64 SSE2), for CPUs without
// AVX2: see decode_attention_impl.h.
// Headers first, outside the target region, so no std / torch code is compiled for this ISA.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "decode_attention.h"

#define KIVI_DA_ENTRY chunk_baseline
#define KIVI_DA_ROWS_TIMES rows_times_baseline
#define KIVI_DA_ROTATE_ROWS rotate_rows_baseline
#include "decode_attention_impl.h"
