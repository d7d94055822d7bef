// The host side of the fused decode attention shared by decode_attention.cpp and paged_attention.cpp: the chunk size,
// the tasks of one or more problems in torch's intra-op pool (each thread reading its task's packed keys into the
// caches first), the in-order merge of the chunks, and the per-ISA dispatch of the row-times-matrix helpers (see
// decode_attention.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "isa.h"

namespace kivi::cpu::decode {

bool phase_timing = false;
uint64_t phase_ticks[kPhaseCount] = {};
thread_local uint64_t thread_phase_ticks[kPhaseCount] = {};

namespace {

#include "phase_timer.h"

// Reads one byte of every cache line of `bytes` bytes from `start` (a run need not start a line).
void read_lines(const void* start, int64_t bytes) {
  const volatile uint8_t* at = static_cast<const uint8_t*>(start);  // volatile: each read happens
  for (int64_t b = 0; b < bytes; b += 64) at[b];
  at[bytes - 1];
}

// Reads one byte of every cache line of rows [first, first + count) of page `block`'s section of (batch x head) bh:
// their codes, scales and zeros (a page's key rows are channels, its value rows tokens; see Packed).
void read_page_rows(const Packed& x, int64_t block, int64_t bh, int64_t first, int64_t count) {
  const int64_t meta_size = x.meta == kF32 ? 4 : 2;
  read_lines(x.codes + block * x.code_page + bh * x.code_head + first * x.code_row, count * x.code_row);
  const int64_t meta = (block * x.meta_page + bh * x.meta_head + first * x.meta_row) * meta_size;
  read_lines(static_cast<const char*>(x.scales) + meta, count * x.meta_row * meta_size);
  read_lines(static_cast<const char*>(x.zeros) + meta, count * x.meta_row * meta_size);
}

// Reads one byte of every cache line of the packed keys task `task` will score (task_span), channel run by
// channel run in storage order, so that the kernel, which walks all D channels group by group, finds them in the
// caches. Real loads, not prefetches: in the model (SmolLM2-135M, Zen 4, KiviCaches of random history, one per
// variant, steps interleaved in one process, fused op per layer call) batch 4 / 8064 took 0.804-0.904 ms per call with
// the earlier prefetches (each thread's next task into L1, each key block two blocks ahead into L2) and 0.634-0.644
// ms with this read and no prefetch; batch 4 / 4096 0.443 -> 0.355, batch 1 / 8064 0.219 -> 0.192, batch 1 / 1k
// 0.090 / 0.092 ms. Also measured: the next task read one task ahead, 0.72 ms; the key blocks read two blocks ahead
// inside the kernel, 0.83 ms; the values read too, 0.685 ms (each value buffer is one contiguous run, which the
// hardware prefetcher follows); each thread's next task claimed early and its key lines read a few at a time between
// the value blocks of the current one (benchmarks/bench_ab_builds.py, Zen 4, batch 4 / 8064): 0.83x as fast with
// loads, 0.92x with prefetcht0; the runs read array by array (all codes, then scales, then zeros), or line k of every
// channel's codes in turn: 0.98x both, within that A/B's noise. Why real loads win where prefetches did not is not
// measured (no counters in these VMs); each channel run of a chunk lies in another 4 KiB page, and a prefetch may be
// dropped where a load walks the page tables.
void read_task_keys(const Problem& p, const TaskSpan& task) {
  const int64_t S = p.sinks, bh = task.bh, p0 = task.p0, p1 = task.p1;
  const Packed& K = p.keys;
  const int64_t k0 = std::max(p0, S), k1 = std::min(p1, S + K.count);
  if (k0 >= k1) return;
  const int64_t g0 = (k0 - S) / K.group, g1 = (k1 - S) / K.group;
  if (K.pages != nullptr) {  // each group is one page: its D channel rows
    for (int64_t g = g0; g < g1; ++g) read_page_rows(K, K.pages[g], bh, 0, p.head_dim);
    return;
  }
  const int64_t meta_size = K.meta == kF32 ? 4 : 2, run = (g1 - g0) * K.group * K.bits / 8;
  for (int64_t d = 0; d < p.head_dim; ++d) {
    read_lines(K.codes + bh * K.code_head + d * K.code_row + g0 * (K.group * K.bits / 8), run);
    const int64_t meta = (bh * K.meta_head + d * K.meta_row + g0) * meta_size;
    read_lines(static_cast<const char*>(K.scales) + meta, (g1 - g0) * meta_size);
    read_lines(static_cast<const char*>(K.zeros) + meta, (g1 - g0) * meta_size);
  }
}

// Reads one byte of every cache line of the paged values task `task` will combine, for the reason of read_task_keys:
// each page holds only a short run of codes, scales and zeros per head, which the hardware prefetcher does not follow
// from page to page (contiguous values are one run each, and reading them did not pay). `bench_native_attention.py
// --batch 4 --context 8064 --cold --paged` (Zen 4): 1.005 -> 0.656 ms per call, against 0.543 / 0.558 ms for
// decode_attention over the same tokens in contiguous storage in the same runs.
void read_task_paged_values(const Problem& p, const TaskSpan& task) {
  const Packed& V = p.values;
  if (V.pages == nullptr) return;
  const int64_t S = p.sinks, t0 = std::max(task.p0, S) - S, t1 = std::min(task.p1, S + V.count) - S;
  if (t0 >= t1) return;
  const int64_t T = V.page_tokens;
  for (int64_t page = t0 / T; page * T < t1; ++page) {
    const int64_t first = std::max(t0, page * T) - page * T, last = std::min(t1, (page + 1) * T) - page * T;
    read_page_rows(V, V.pages[page], task.bh, first, last - first);
  }
}

// Reads one byte of every cache line of the exact rows (sinks and tail, keys and values) task `task` will read, for
// the same reason as read_task_keys: the window was last read a whole step ago. In the model (SmolLM2-135M, Zen 3,
// benchmarks/bench_ab_builds.py, with and without it) batch 1 / 1k: op 4 % faster; batch 4 / 8064: 0.99x, noise.
void read_task_exact(const Problem& p, const TaskSpan& task) {
  const int64_t S = p.sinks, b = task.bh / p.kv_heads, h = task.bh % p.kv_heads, p0 = task.p0, p1 = task.p1;
  const auto rows = [&](const Exact& x, int64_t width, int64_t t0, int64_t t1) {
    const int64_t element = x.dtype == kF32 ? 4 : 2;
    for (int64_t t = t0; t < t1; ++t)
      read_lines(static_cast<const char*>(x.data) + (b * x.stride_b + h * x.stride_h + t * x.stride_t) * element,
                 width * element);
  };
  if (p0 < S) {
    rows(p.key_sinks, p.head_dim, p0, std::min(p1, S));
    rows(p.value_sinks, p.value_dim, p0, std::min(p1, S));
  }
  const int64_t key_tail0 = S + p.keys.count, value_tail0 = S + p.values.count;
  if (p1 > key_tail0) rows(p.key_tail, p.head_dim, std::max(p0, key_tail0) - key_tail0, p1 - key_tail0);
  if (p1 > value_tail0) rows(p.value_tail, p.value_dim, std::max(p0, value_tail0) - value_tail0, p1 - value_tail0);
}

// Adds the calling thread's phase ticks to the totals and zeroes them.
void flush_phase_ticks() {
  for (int i = 0; i < kPhaseCount; ++i) {
    if (thread_phase_ticks[i] == 0) continue;
    __atomic_fetch_add(&phase_ticks[i], thread_phase_ticks[i], __ATOMIC_RELAXED);
    thread_phase_ticks[i] = 0;
  }
}

void (*chunk_kernel(Isa isa))(const Problem&, int64_t) {
  switch (isa) {
    case Isa::kAvx512Vnni: return decode::chunk_avx512_vnni;
    case Isa::kAvx512: return decode::chunk_avx512;
    case Isa::kAvx2: return decode::chunk_avx2;
    default: return decode::chunk_baseline;
  }
}

// Rows [begin, end) of merge_chunks (below).
void merge_rows(const Problem& p, float* out, float* packed_out, int64_t begin, int64_t end) {
  PhaseTimer timer(kPhaseMerge);
  const int64_t width = p.acc_width, acc_row = p.acc_row, Dv = p.value_dim;
  float o[2 * decode::kMaxDim];
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.rows, r = row % p.rows;
    const float* first = p.partials + (bh * p.chunks * p.rows + r) * acc_row;
    const int64_t chunk_step = p.rows * acc_row;
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t c = 0; c < p.chunks; ++c) {
      const float mc = first[c * chunk_step];
      nan |= std::isnan(mc);
      m = mc > m ? mc : m;
    }
    float* result = out + row * Dv;
    if (!nan && m == -std::numeric_limits<float>::infinity()) {  // fully masked row: zeros, by definition
      for (int64_t d = 0; d < Dv; ++d) result[d] = 0.0f;
      continue;
    }
    if (nan) m = std::numeric_limits<float>::quiet_NaN();
    float total = 0.0f;
    for (int64_t d = 0; d < width; ++d) o[d] = 0.0f;
    for (int64_t c = 0; c < p.chunks; ++c) {
      const float* part = first + c * chunk_step;
      const float w = part[0] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(part[0] - m);
      total += w * part[1];
      for (int64_t d = 0; d < width; ++d) o[d] += w * part[decode::kAccOffset + d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < Dv; ++d) result[d] = o[d] * inv;
    if (packed_out != nullptr)
      for (int64_t d = 0; d < Dv; ++d) packed_out[row * Dv + d] = o[p.packed_acc + d] * inv;
  }
}

}  // namespace

// (see decode_attention.h) Long chunks: the packed keys are stored channel-major (codes [B, H, D, tokens / P]), so a
// chunk reads D runs of codes and metadata `code_row` bytes apart, and short runs leave the loads waiting on memory. In
// the model (SmolLM2-135M, Zen 4, batch 4 / 8064, one process, steps interleaved) the op took 1.01 ms per layer with
// chunks of 256 tokens and 0.87 with 4096 (another run: 0.98 / 0.90 / 0.91 ms at 2048 / 4096 / 8192; in a phase of the
// VM with slow memory 1.80 / 1.20 / 1.04 / 0.97 ms at 256 / 1024 / 2048 / 4096); batch 1 / 8064: 0.47 / 0.33 / 0.29 /
// 0.28 ms at 256 / 1024 / 2048 / 4096. But at least kMinTasks tasks, so that a few cores stay balanced and a thread can
// take over the tasks of one that lost its core. The split depends on the shapes only, never on the thread count: the
// result is the same on any number of threads.
constexpr int64_t kMinChunk = 256, kMaxChunk = 4096, kMinTasks = 12;
int64_t chunk_tokens(int64_t tokens, int64_t group, int64_t heads) {
  const int64_t per_head = std::max<int64_t>(1, (kMinTasks + heads - 1) / heads);
  const int64_t chunk = std::clamp<int64_t>((tokens + per_head - 1) / per_head, kMinChunk, kMaxChunk);
  return group * std::max<int64_t>(1, (chunk + group - 1) / group);
}

int64_t task_score_row(int64_t sinks, int64_t chunk) { return (15 + sinks + chunk + 15) / 16 * 16; }

// Scores in a per-thread scratch rather than in one workspace of the call: a task's rows (3 x ~4100 floats for
// SmolLM2-135M) stay in the core's caches from task to task, where the call's workspace (1.2 MB at batch 4 / 8064)
// came cold from memory at every layer, each line read before it was written. In the model
// (benchmarks/bench_ab_builds.py, Zen 4, 40 step pairs, op per layer call) batch 4 / 8064: 0.573 -> 0.542 ms (A/B
// 1.056, quartiles 1.046-1.061), forced AVX2 0.763 -> 0.697 ms (1.091); batch 1 / 8064: 0.169 -> 0.162 ms (1.040).
float* task_scores(const Problem& p, int64_t p0) {
  constexpr int64_t kKept = (1 << 20) / sizeof(float);
  thread_local std::vector<float> scratch;
  const int64_t size = p.rows * p.score_row + 16;  // room to align
  const int64_t held = static_cast<int64_t>(scratch.size());
  if (held < size || (held > kKept && size <= kKept)) std::vector<float>(size).swap(scratch);
  float* const aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) / 64 * 64);
  // the offset puts position `sinks`, and every 16th position from it, at a multiple of 16 floats
  return aligned + ((p0 - p.sinks) % 16 + 16) % 16 - p0;
}

// The task (b * Hkv + h) * chunks + c that a problem hands out as its `claimed`-th: history by history, every other
// history's chunks in reverse. Two threads in step take alternate tasks, and with an even number of chunks per
// history the task order gave one of them every first chunk (the sinks and 4096 positions) and the other every
// second (the rest and the exact tail), whose costs differ. In the model (SmolLM2-135M, Zen 4, batch 4 / 7850-
// 8150, 24 tasks; one build running the orders in turn step by step) the threads' last tasks ended 15.7 us apart per
// call in task order, 6.2 in this one, and the tasks' region took 492.8 / 481.1 us (forced AVX2: 46.6 / 14.1 us
// apart, 622.8 / 586.4 us; batch 1, 12 tasks: 12.3 / 6.3 us apart, 135.9 / 133.2 us). All first chunks before any
// second one gave 21.6 us apart, 489.1 us (AVX2 27.2, 594.0; batch 1 7.9, 132.4).
int64_t handed_out(const Problem& p, int64_t claimed) {
  const int64_t history = claimed / p.chunks, c = claimed % p.chunks;
  return history * p.chunks + (history % 2 == 0 ? c : p.chunks - 1 - c);
}

void run_problems(const Problem* problems, const int64_t* first_task, int64_t count) {
  const int64_t tasks = first_task[count];
  if (tasks == 0) return;
  const auto kernel = chunk_kernel(current_isa());
  // Tasks are handed out one at a time from a shared counter instead of split evenly up front: when another process
  // takes the core of one of torch's threads mid-step, the other threads run its share instead of waiting for it.
  // Every task writes only its own partial, so the result does not depend on which thread ran it. A thread first
  // reads its task's packed keys, paged values and exact rows into the caches (read_task_keys,
  // read_task_paged_values, read_task_exact: in a model they are cold). Every call uses the pool, however small: in
  // the model (SmolLM2-135M, Zen 4, interleaved A/B) batch 1 with 200 / 512 / 1024 tokens took 0.051 / 0.060 / 0.082
  // ms per call on one thread (which calls below ~8k token-rows of work got, a rule from warm micro-benchmarks) and
  // 0.043 / 0.048 / 0.061 ms on two.
  const auto problem_of = [&](int64_t task) {
    if (count == 1) return int64_t{0};
    return int64_t(std::upper_bound(first_task, first_task + count + 1, task) - first_task) - 1;
  };
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    for (int64_t claimed = next_task++; claimed < tasks; claimed = next_task++) {
      const int64_t owner = problem_of(claimed);
      const Problem& p = problems[owner];
      const int64_t task = handed_out(p, claimed - first_task[owner]);
      {
        PhaseTimer timer(kPhaseReadInputs);
        const TaskSpan span = task_span(p, task);
        read_task_keys(p, span);
        read_task_paged_values(p, span);
        read_task_exact(p, span);
      }
      kernel(p, task);
      if (phase_timing) flush_phase_ticks();
    }
  });
}

// Merges the chunks of every query row in order: out = sum_c w_c acc_c / sum_c w_c l_c with w_c = exp(m_c - M).
// Partials hold rows of `acc_width` floats (see Problem::partials): with rotated values the row is [exact sum |
// packed sum], merged into `out` and `packed_out` (the caller rotates the latter back); `out` rows are value_dim
// floats. A fully masked row gives zeros in `out` (and leaves `packed_out` alone: the caller zero-fills it).
void merge_chunks(const Problem& p, float* out, float* packed_out) {
  at::parallel_for(0, p.batch * p.kv_heads * p.rows, 64, [&](int64_t begin, int64_t end) {
    merge_rows(p, out, packed_out, begin, end);
    if (phase_timing) flush_phase_ticks();
  });
}


// out (+)= x @ m, rows of `dim` floats, with the CPU's ISA (see decode_attention.h).
void rows_times(const float* x, const float* m, int64_t rows, int64_t dim, float* out, bool accumulate) {
  switch (current_isa()) {
    case Isa::kAvx512Vnni: return rows_times_avx512_vnni(x, m, rows, dim, out, accumulate);
    case Isa::kAvx512: return rows_times_avx512(x, m, rows, dim, out, accumulate);
    case Isa::kAvx2: return rows_times_avx2(x, m, rows, dim, out, accumulate);
    default: return rows_times_baseline(x, m, rows, dim, out, accumulate);
  }
}


void rotate_rows(const void* x, Dtype dtype, int64_t rows, int64_t dim, const float* m, float* out) {
  switch (current_isa()) {
    case Isa::kAvx512Vnni: return rotate_rows_avx512_vnni(x, dtype, rows, dim, m, out);
    case Isa::kAvx512: return rotate_rows_avx512(x, dtype, rows, dim, m, out);
    case Isa::kAvx2: return rotate_rows_avx2(x, dtype, rows, dim, m, out);
    default: return rotate_rows_baseline(x, dtype, rows, dim, m, out);
  }
}

}  // namespace kivi::cpu::decode
