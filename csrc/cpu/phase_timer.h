// The timer of a phase of the fused decode attention (decode_attention.h: Phase), for `kivi-xpu bench --phases`.
// Included INSIDE an anonymous namespace (as simd.h) by decode_attention_impl.h (for it and decode_int8.h) and by
// decode_tasks.cpp, so that every ISA translation unit has its own copy.

// Adds the time-stamp-counter ticks of its scope to the thread's thread_phase_ticks[phase] when phase_timing is on
// (else: one load and one branch).
class PhaseTimer {
 public:
  explicit PhaseTimer(Phase phase) : phase_(phase), start_(phase_timing ? __builtin_ia32_rdtsc() : 0) {}
  ~PhaseTimer() {
    if (start_ != 0) thread_phase_ticks[phase_] += __builtin_ia32_rdtsc() - start_;
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  Phase phase_;
  unsigned long long start_;
};
