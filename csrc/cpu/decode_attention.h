// Plain-data description of one fused decode attention call, shared by the dispatcher (decode_attention.cpp) and
// the chunk kernel of each ISA (decode_attention_impl.h, compiled in isa_<name>.cpp; kernel_table.h holds them). No
// templates and no torch types here: the ISA translation units include it before their `#pragma GCC target` region.
#pragma once
#include <cstdint>

#include "dtype.h"

namespace kivi::cpu::decode {

enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskFloat = 2 };

// An exact [B, H, T, D] tensor in the model dtype; strides in elements, the last one is 1.
struct Exact {
  const void* data;
  Dtype dtype;
  int64_t tokens, stride_b, stride_h, stride_t;
};

// Packed KIVI storage (contiguous). Keys: codes [B,H,D,code_cols] along tokens, meta [B,H,D,meta_cols] per group of
// `group` tokens. Values: codes [B,H,code_rows,Dv/P] along channels, meta [B,H,meta_rows,Dv/group] per token.
struct Packed {
  const uint8_t* codes;
  const void* scales;
  const void* zeros;
  Dtype meta;
  int64_t count, group, bits;
  int64_t code_row;   // bytes between consecutive channels (keys) / tokens (values)
  int64_t meta_row;   // elements between consecutive channels (keys) / tokens (values)
  int64_t code_head;  // bytes per (batch, head)
  int64_t meta_head;  // elements per (batch, head)
  // Paged storage (continuous batching, paged_attention.cpp): nullptr, or the block of each page of `page_tokens`
  // packed tokens (page j: tokens [j * page_tokens, (j + 1) * page_tokens), so key groups [j * per, (j + 1) * per)
  // with per = page_tokens / group). Page j of head h starts at codes + pages[j] * code_page + h * code_head
  // (metadata: pages[j] * meta_page + h * meta_head). Inside a page the values' rows are as above; the keys' channel
  // rows span the page's groups (code_row page_tokens / P) and their metadata is group-major [per, D] (meta_row per:
  // a page's elements per channel, read whole by the loads ahead of a task).
  const int64_t* pages;
  int64_t page_tokens;  // packed tokens per page (a multiple of the key group size)
  int64_t code_page;    // bytes between consecutive blocks
  int64_t meta_page;    // elements between consecutive blocks

  // Paged keys: the first code byte of key group g's channel 0, and the first metadata element of its D channels.
  const uint8_t* page_key_codes(int64_t g, int64_t bh) const {
    const int64_t per = page_tokens / group;
    return codes + pages[g / per] * code_page + bh * code_head + (g % per) * (group * bits / 8);
  }
  int64_t page_key_meta(int64_t g, int64_t bh, int64_t D) const {
    const int64_t per = page_tokens / group;
    return pages[g / per] * meta_page + bh * meta_head + (g % per) * D;
  }
};

struct Problem {
  int64_t batch, kv_heads, q_per_kv, length, rows;  // rows = q_per_kv * length query rows per kv head
  int64_t head_dim, value_dim, n, sinks;
  const float* query;  // [B, Hkv, rows, head_dim] fp32, already multiplied by `scaling`
  // The query that scores the packed keys: `query` itself, or query @ Q when the keys are stored rotated (q·k = qQ·kQ).
  const float* packed_query;
  Exact key_sinks, key_tail, value_sinks, value_tail;
  Packed keys, values;
  MaskKind mask_kind;
  const void* mask;  // uint8 (bool) or fp32 [mb, mh, L, >= n], read by strides (0 where broadcast)
  int64_t mask_sb, mask_sh, mask_sl, mask_sc, mask_col0;  // mask_col0: the column of position 0
  float softcap;           // 0: none
  // Packed 2/4-bit codes on integer arithmetic (int8 factors, see decode_int8.h) where the ISA has it, else fp32.
  bool integer;
  int64_t chunk, chunks;   // tokens per chunk past the sinks (a multiple of the key group); chunk 0 adds the sinks
  // Floats per row of a task's scores, then probabilities (decode_problem.cpp: plan gives it; task_scores places
  // them).
  int64_t score_row;
  // [B, Hkv, chunks, rows, acc_row]: chunk max, chunk sum, then from float kAccOffset on the unnormalised output,
  // acc_width floats: the whole sum, or, when the values are stored rotated, the exact sum and from packed_acc on the
  // packed sum (rotated back after the merge). Rows and both sums start 64-byte aligned.
  float* partials;
  int64_t acc_row, acc_width, packed_acc;
};

// Where the output sums start in a row of Problem::partials (floats).
constexpr int64_t kAccOffset = 16;

// Largest head_dim / value_dim the kernels' stack buffers hold.
constexpr int64_t kMaxDim = 512;

// What task `task` of `p` covers: (batch x kv head) bh and its positions [p0, p1) (chunk 0 adds the sinks). The
// kernels and the task pool's reads (decode_tasks.cpp) both take their split from it. Static: every translation unit,
// whatever its ISA region, compiles its own copy.
struct TaskSpan {
  int64_t bh, p0, p1;
};
static inline TaskSpan task_span(const Problem& p, int64_t task) {
  const int64_t c = task % p.chunks, end = p.sinks + (c + 1) * p.chunk;
  return {task / p.chunks, c == 0 ? 0 : p.sinks + c * p.chunk, end < p.n ? end : p.n};
}

// One task = one (batch, kv head, chunk): fills that chunk's scores and partial. task = (b * Hkv + h) * chunks + c.
// A paged problem has batch 1 (one request; its Packed::pages set). Compiled per ISA: KernelTable::chunk.

// ---- phase timing (kivi-xpu bench --phases) ------------------------------------------------------------------------

// Where a call's time goes: each phase's time-stamp-counter ticks, summed over the threads that ran it (see
// phase_timer.h). The packed keys' and values' phases include their metadata and factor phases.
enum Phase : int {
  kPhaseReadInputs,     // each task's packed keys and exact rows read into the caches first (decode_tasks.cpp)
  kPhaseExactScores,    // scores of the exact sinks and tail
  kPhasePackedScores,   // scores of the packed keys
  kPhaseKeyMeta,        //   of which: their scales and zeros copied channel-major (integer path, pages only)
  kPhaseKeyFactors,     //   of which: the int8 query factors, reading contiguous metadata in place (integer path)
  kPhaseSoftmax,        // mask, softcap and exp of a chunk's scores
  kPhaseExactValues,    // the exact sinks' and tail's values
  kPhasePackedValues,   // the packed values
  kPhaseValueMeta,      //   of which: their scales and zeros copied by group (integer path, 3, 5-7 or 9+ groups)
  kPhaseValueFactors,   //   of which: the uint8 probability factors, reading 1, 2, 4 or 8 groups in place
  kPhaseMerge,          // the in-order merge of the chunks
  kPhaseCount
};
// The phases' names in the enum's order: the keys of kivi_xpu._cpu.phase_seconds(), which
// kivi_xpu/tools/report.py (PHASE_COLUMNS) reads.
constexpr const char* kPhaseNames[] = {"read_inputs", "exact_scores", "packed_scores", "key_meta",
                                       "key_factors", "softmax",      "exact_values",  "packed_values",
                                       "value_meta",  "value_factors", "merge"};
static_assert(sizeof(kPhaseNames) / sizeof(kPhaseNames[0]) == kPhaseCount, "a name for every phase");
// Off unless set (decode_attention.cpp: set_phase_timing); a phase then costs a load and a branch. The timers add to
// their thread's ticks, which run_problems adds to the totals after each task (one atomic add per phase and task
// instead of one per block).
extern bool phase_timing;
extern uint64_t phase_ticks[kPhaseCount];
extern thread_local uint64_t thread_phase_ticks[kPhaseCount];

// ---- host side (decode_tasks.cpp), run by decode_problem.cpp for both ops ------------------------------------------
// (A Problem's chunk split and score_row: decode_problem.cpp, plan.)

// Where the task of `p` from position p0 keeps its scores, then probabilities: position t of row r at
// out[r * p.score_row + t], in the calling thread's scratch (kept for its next tasks; one grown past 1 MiB, for a long
// query, is given back at the thread's next smaller request), position `sinks` (where the packed keys and the chunks
// start) 64-byte aligned in every row, so that the vector loops over a chunk never straddle cache lines.
float* task_scores(const Problem& p, int64_t p0);

// Runs every task of `count` problems in torch's intra-op pool: problem i owns the global tasks
// [first_task[i], first_task[i + 1]) (first_task has count + 1 entries).
void run_problems(const Problem* problems, const int64_t* first_task, int64_t count);

// Merges the chunks of every query row of `p` in order into out [B, Hkv, rows, value_dim] (and, with rotated values,
// the packed sum into packed_out, which the caller zero-fills and rotates back). A fully masked row gives zeros.
void merge_chunks(const Problem& p, float* out, float* packed_out);

// out[r] = x[r] @ m (or out[r] += x[r] @ m with `accumulate`) for `rows` rows of `dim` floats, m [dim, dim]
// row-major, with the kernels of the ISA in use (KernelTable::rows_times): the rotations of the query and of the
// packed values' sum (see kivi_xpu/rotation.py).
void rows_times(const float* x, const float* m, int64_t rows, int64_t dim, float* out, bool accumulate);

}  // namespace kivi::cpu::decode
