// The host side of the fused decode attention that decode_problem.cpp runs for both ops: the tasks of one or more
// problems in torch's intra-op pool (each thread reading its task's inputs into the caches first), the in-order merge
// of the chunks, and rows_times for the ISA in use (see kernel_table.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "kernel_table.h"

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
// caches. Real loads, not prefetches: they measured faster in the model than prefetches (this task's or the next
// one's, into L1 or L2), than reading ahead inside the kernel, and than also reading the contiguous values (one run
// each, which the hardware prefetcher follows); docs/measurements.md has the figures. Each channel run of a chunk lies
// in another 4 KiB page, and a prefetch may be dropped where a load walks the page tables.
void read_task_keys(const Problem& p, const TaskSpan& task) {
  const int64_t S = p.sinks, bh = task.bh, p0 = task.p0, p1 = task.p1;
  const Packed& K = p.keys;
  const int64_t k0 = std::max(p0, S), k1 = std::min(p1, S + K.count);
  if (k0 >= k1) return;
  const int64_t g0 = (k0 - S) / K.group, g1 = (k1 - S) / K.group;
  if (K.pages != nullptr) {  // each page of these groups: its D channel rows (all its groups) and metadata
    const int64_t per = K.page_tokens / K.group;
    for (int64_t j = g0 / per; j <= (g1 - 1) / per; ++j) read_page_rows(K, K.pages[j], bh, 0, p.head_dim);
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
// from page to page (contiguous values are one run each, and reading them did not pay).
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
// the same reason as read_task_keys: the window was last read a whole step ago (it helps short contexts most).
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

// Scores in a per-thread scratch rather than in one workspace of the call: a task's rows (3 x ~4100 floats for
// SmolLM2-135M) stay in the core's caches from task to task, where the call's workspace (1.2 MB at batch 4 / 8064)
// came cold from memory at every layer, each line read before it was written.
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
// second (the rest and the exact tail), whose costs differ: this order ends the threads' last tasks closer together
// than the task order or all first chunks before any second one.
int64_t handed_out(const Problem& p, int64_t claimed) {
  const int64_t history = claimed / p.chunks, c = claimed % p.chunks;
  return history * p.chunks + (history % 2 == 0 ? c : p.chunks - 1 - c);
}

void run_problems(const Problem* problems, const int64_t* first_task, int64_t count) {
  const int64_t tasks = first_task[count];
  if (tasks == 0) return;
  const auto kernel = kernels().chunk;
  // Tasks are handed out one at a time from a shared counter instead of split evenly up front: when another process
  // takes the core of one of torch's threads mid-step, the other threads run its share instead of waiting for it.
  // Every task writes only its own partial, so the result does not depend on which thread ran it. A thread first
  // reads its task's packed keys, paged values and exact rows into the caches (read_task_keys,
  // read_task_paged_values, read_task_exact: in a model they are cold). Every call uses the pool, however small: even
  // the smallest calls measured faster on two threads than on one (a rule from warm micro-benchmarks said otherwise).
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


// out (+)= x @ m, rows of `dim` floats, with the kernels of the ISA in use (see kernel_table.h).
void rows_times(const float* x, const float* m, int64_t rows, int64_t dim, float* out, bool accumulate) {
  kernels().rows_times(x, m, rows, dim, out, accumulate);
}

}  // namespace kivi::cpu::decode
