// Core cycles of the integer loops of the fused decode attention (csrc/cpu/decode_int8.h), warm (the codes in L1/L2),
// against the floor their multiply instructions set: how far the arithmetic itself is from the machine's limit.
// Built and run by bench_int8_loops.py, once per ISA the CPU has (-DLOOPS_AVX512_VNNI, -DLOOPS_AVX512 or neither:
// AVX2). The default cache at SmolLM2-135M's shapes (head_dim 64, or the first argument: 128 for Llama-3.2-3B's):
// 3 query rows per kv head, 2-bit codes, key groups and value blocks of 32 tokens, float16 scales and zeros. Numbers
// are core cycles: TSC ticks times the core's cycles per tick, measured with a dependent add chain.
#include <immintrin.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "decode_attention.h"

#include "loop_harness.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#if defined(LOOPS_AVX512_VNNI) || defined(LOOPS_AVX512)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
#define KIVI_SIMD_AVX512 1
#if defined(LOOPS_AVX512_VNNI)
#define KIVI_SIMD_VNNI 1
#endif
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#define KIVI_SIMD_AVX2 1
#endif
#define KIVI_DA_ENTRY chunk_loops
#define KIVI_DA_ROWS_TIMES rows_times_loops
#define KIVI_DA_ROTATE_ROWS rotate_rows_loops
#include "decode_attention_impl.h"

namespace kivi::cpu::decode {
namespace {

constexpr int kRows = 3;
volatile int64_t head_dim = 64, runtime_32 = 32;  // sizes the compiler cannot fold, as in the kernel
double cycles_per_tick = 1.0;

float random_unit() { return float(rand() % 20001 - 10000) * 1e-4f; }

uint16_t half(float x) { return _cvtss_sh(x, 0); }

// Cycles per key group of kRows query rows over `groups` groups of random codes, in the kernel's two steps
// (int8_packed_scores, contiguous storage): the int8 query factors (reading the scales and zeros in place), the
// products.
void key_groups(int64_t groups, int reps) {
  const int64_t D = head_dim, G = runtime_32;
  Packed K{};
  K.group = G, K.bits = 2, K.meta = kF16, K.count = groups * G;
  K.code_row = groups * G / 4 + 64, K.meta_row = groups + 16;  // rows padded as the cache pads them
  K.code_head = D * K.code_row, K.meta_head = D * K.meta_row;
  uint8_t* codes = static_cast<uint8_t*>(aligned_alloc(64, K.code_head));
  uint16_t* scales = static_cast<uint16_t*>(aligned_alloc(64, K.meta_head * 2));
  uint16_t* zeros = static_cast<uint16_t*>(aligned_alloc(64, K.meta_head * 2));
  for (int64_t i = 0; i < K.code_head; ++i) codes[i] = uint8_t(rand());
  for (int64_t i = 0; i < K.meta_head; ++i) scales[i] = half(0.05f + 0.04f * random_unit()), zeros[i] = half(random_unit());
  K.codes = codes, K.scales = scales, K.zeros = zeros;
  float* scores = static_cast<float*>(aligned_alloc(64, kRows * groups * G * sizeof(float)));
  float q[kRows][kMaxDim];
  const float* rows[kRows];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t d = 0; d < D; ++d) q[r][d] = random_unit();
    rows[r] = q[r];
  }
  KeyBlockFactors f;
  uint64_t ticks[2] = {};
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    for (int64_t gb = 0; gb < groups; gb += kBlockGroups) {
      const uint64_t t1 = __rdtsc();
      key_factors_in_place<kRows>(rows, K, gb, D, &f);
      const uint64_t t2 = __rdtsc();
      for (int64_t i = 0; i < kBlockGroups; ++i) {
        float* out[kRows];
        for (int r = 0; r < kRows; ++r) out[r] = scores + (r * groups + gb + i) * G;
        int8_key_group<2, kRows>(f, i, codes + (gb + i) * G / 4, K.code_row, D, G, out);
      }
      const uint64_t t3 = __rdtsc();
      if (rep > 0) ticks[0] += t2 - t1, ticks[1] += t3 - t2;
    }
  }
  const double per_group = cycles_per_tick / double(groups * reps);
  // One multiply instruction (vpdpbusd, or vpmaddubsw without VNNI) per query row, channel quad and code plane.
  std::printf("key group, %ld groups: factors %.0f, products %.0f cycles (%ld multiply instructions)"
              "  [checksum %g]\n",
              long(groups), ticks[0] * per_group, ticks[1] * per_group, long(kRows * D / 4 * 4),
              double(scores[17]));
  free(codes);
  free(scales);
  free(zeros);
  free(scores);
}

// Cycles per value block of 32 tokens: int8_value_rows over `tokens` tokens of random codes (metadata, factors and
// products together: timing its steps apart would take the kernel's phase timers, which cost as much as a step).
void value_blocks(int64_t tokens, int reps) {
  constexpr int64_t TB = kValueBlock<2>;
  const int64_t Dv = head_dim, G = runtime_32, groups = Dv / G, code_row = Dv / 4;
  uint8_t* codes = static_cast<uint8_t*>(aligned_alloc(64, tokens * code_row));
  uint16_t* scales = static_cast<uint16_t*>(aligned_alloc(64, tokens * groups * 2));
  uint16_t* zeros = static_cast<uint16_t*>(aligned_alloc(64, tokens * groups * 2));
  for (int64_t i = 0; i < tokens * code_row; ++i) codes[i] = uint8_t(rand());
  for (int64_t i = 0; i < tokens * groups; ++i) scales[i] = half(0.05f + 0.04f * random_unit()), zeros[i] = half(random_unit());
  Packed V{};
  V.codes = codes, V.scales = scales, V.zeros = zeros, V.meta = kF16, V.count = tokens, V.group = G, V.bits = 2;
  V.code_row = code_row, V.meta_row = groups, V.code_head = tokens * code_row, V.meta_head = tokens * groups;
  static float prob[kRows][1 << 16];
  float out[kRows][kMaxDim];
  const float* p[kRows];
  float* acc[kRows];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t t = 0; t < tokens; ++t) prob[r][t] = 0.5f + 0.5f * random_unit();
    p[r] = prob[r], acc[r] = out[r];
  }
  auto locate = [&](int64_t tb, const uint8_t** block, int64_t* meta) {
    *block = codes + tb * code_row;
    *meta = tb * groups;
  };
  uint64_t ticks = 0;
  for (int rep = 0; rep <= reps; ++rep) {
    const uint64_t t0 = __rdtsc();
    int8_value_rows<2, kRows>(V, locate, 0, tokens, Dv, p, acc);
    if (rep > 0) ticks += __rdtsc() - t0;
  }
  std::printf("value block, %ld tokens: %.0f cycles (%ld multiply instructions)  [checksum %g]\n", long(tokens),
              ticks * cycles_per_tick / double(tokens / TB * reps), long(kRows * Dv / 32 * TB / 4 * 4),
              double(out[1][5]));
  free(codes);
  free(scales);
  free(zeros);
}

}  // namespace
}  // namespace kivi::cpu::decode
#pragma GCC pop_options

// Cycles per instruction of independent ymm multiply-adds (12 accumulators): the floor of the loops above.
#define TWELVE(INS)                                                                                                  \
  __asm__ volatile(INS " %%ymm12, %%ymm13, %%ymm0\n\t" INS " %%ymm12, %%ymm13, %%ymm1\n\t" INS                      \
                       " %%ymm12, %%ymm13, %%ymm2\n\t" INS " %%ymm12, %%ymm13, %%ymm3\n\t" INS                      \
                       " %%ymm12, %%ymm13, %%ymm4\n\t" INS " %%ymm12, %%ymm13, %%ymm5\n\t" INS                      \
                       " %%ymm12, %%ymm13, %%ymm6\n\t" INS " %%ymm12, %%ymm13, %%ymm7\n\t" INS                      \
                       " %%ymm12, %%ymm13, %%ymm8\n\t" INS " %%ymm12, %%ymm13, %%ymm9\n\t" INS                      \
                       " %%ymm12, %%ymm13, %%ymm10\n\t" INS " %%ymm12, %%ymm13, %%ymm11\n\t" ::                     \
                           : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                             "xmm11")

int main(int argc, char** argv) {
  using namespace kivi::cpu::decode;
  if (argc > 1) head_dim = std::atol(argv[1]);  // a multiple of 32, at most kMaxDim
  constexpr long kRounds = 20000000;
  cycles_per_tick = core_cycles_per_tick();
  std::printf("core cycles per TSC tick: %.3f\n", cycles_per_tick);
  const uint64_t t0 = __rdtsc();
#if defined(LOOPS_AVX512_VNNI)
  for (long i = 0; i < kRounds; ++i) TWELVE("vpdpbusd");
  const char* name = "vpdpbusd";
#else
  for (long i = 0; i < kRounds; ++i) TWELVE("vpmaddubsw");
  const char* name = "vpmaddubsw";
#endif
  std::printf("%s ymm: %.2f cycles per instruction (independent)\n", name,
              double(__rdtsc() - t0) * cycles_per_tick / double(12 * kRounds));
  key_groups(64, 3000);
  key_groups(256, 800);
  value_blocks(256, 3000);
  value_blocks(4032, 200);
  return 0;
}
