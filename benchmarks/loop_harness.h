// What the cycle harnesses (int8_loop_cycles.cpp, lut_key_cycles.cpp) share: the definitions decode_tasks.cpp gives
// the kernel header (phase timers, off here; the task scratch), and the clock calibration. Include after
// decode_attention.h, before decode_attention_impl.h.
#include <x86intrin.h>

#include <cstdint>
#include <vector>

namespace kivi::cpu::decode {
bool phase_timing = false;
uint64_t phase_ticks[kPhaseCount] = {};
thread_local uint64_t thread_phase_ticks[kPhaseCount] = {};
float* task_scores(const Problem& p, int64_t p0) {  // (for the chunk entry, which the harnesses do not run)
  thread_local std::vector<float> scratch;
  scratch.resize(p.rows * p.score_row);
  return scratch.data() - p0;  // (not aligned as decode_tasks.cpp aligns it)
}
}  // namespace kivi::cpu::decode

// Core cycles per TSC tick, from dependent add chains (one add a cycle): the best of 10 short chains, because a
// chain that another process interrupts reads low (more ticks for its cycles) and would scale every figure down.
inline double core_cycles_per_tick() {
  constexpr long kAdds = 20000000;
  double best = 0.0;
  uint64_t x = 1;
  for (int round = 0; round < 10; ++round) {
    const uint64_t t0 = __rdtsc();
    for (long i = 0; i < kAdds / 4; ++i)
      __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    const double rate = double(kAdds) / double(__rdtsc() - t0);
    best = rate > best ? rate : best;
  }
  return best;
}
