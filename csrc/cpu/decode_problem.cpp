// See decode_problem.h.
#include "decode_problem.h"

#include <algorithm>

#include "isa.h"
#include "query_rows.h"
#include "torch_dtype.h"

namespace kivi::cpu::decode {
namespace {

constexpr int64_t round16(int64_t floats) { return (floats + 15) / 16 * 16; }

// Tokens per chunk (whole key groups) for `tokens` positions past the sinks in each of `heads` (batch x kv head)
// histories. Long chunks: the packed keys are stored channel-major (codes [B, H, D, tokens / P]), so a chunk reads D
// runs of codes and metadata `code_row` bytes apart, and short runs leave the loads waiting on memory. But at least
// kMinTasks tasks, so that a few cores stay balanced and a thread can take over the tasks of one that lost its core.
// The split depends on the shapes only, never on the thread count: the result is the same on any number of threads
// (kivi_xpu/ops/integer_twin.py: chunk_tokens mirrors it). A paged request gets the chunks of decode_attention over
// its own tokens.
constexpr int64_t kMinChunk = 256, kMaxChunk = 4096, kMinTasks = 12;
int64_t chunk_tokens(int64_t tokens, int64_t group, int64_t heads) {
  if (heads <= 0) return group;  // an empty batch: no task runs, the chunk only has to be a whole group
  const int64_t per_head = std::max<int64_t>(1, (kMinTasks + heads - 1) / heads);
  const int64_t chunk = std::clamp<int64_t>((tokens + per_head - 1) / per_head, kMinChunk, kMaxChunk);
  return group * std::max<int64_t>(1, (chunk + group - 1) / group);
}

}  // namespace

void check_cpu(const char* op, const at::Tensor& t, const char* name, int64_t rank) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": `", name, "` must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == rank, op, ": `", name, "` must have rank ", rank, ", got shape ", t.sizes());
}

Dtype float_dtype(const char* op, const at::Tensor& t, const char* name) {
  Dtype dtype;
  TORCH_CHECK_VALUE(kernel_dtype(t.scalar_type(), &dtype), op, ": `", name,
                    "` must be float32, float16 or bfloat16, got ", t.dtype());
  return dtype;
}

int64_t codes_per_byte(const char* op, int64_t bits, const char* name) {
  TORCH_CHECK_VALUE(bits == 2 || bits == 4 || bits == 8, op, ": `", name, "` must be 2, 4 or 8, got ", bits);
  return 8 / bits;
}

const float* rotation(const char* op, const c10::optional<at::Tensor>& arg, const char* name, int64_t dim) {
  if (!arg.has_value()) return nullptr;
  const at::Tensor& q = *arg;
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 2 && q.size(0) == dim &&
                        q.size(1) == dim && q.is_contiguous(),
                    op, ": `", name, "` must be a contiguous float32 [", dim, ", ", dim, "] CPU tensor, got ",
                    q.dtype(), " ", q.sizes(), " on ", q.device());
  return q.data_ptr<float>();
}

void plan(Problem& p) {
  p.rows = p.q_per_kv * p.length;
  p.sinks = p.key_sinks.tokens;
  p.n = p.sinks + p.keys.count + p.key_tail.tokens;
  p.chunk = chunk_tokens(p.n - p.sinks, p.keys.group, p.batch * p.kv_heads);
  p.chunks = std::max<int64_t>(1, (p.n - p.sinks + p.chunk - 1) / p.chunk);
  // a task's positions (chunk 0 adds the sinks) after at most 15 floats that align position `sinks` (task_scores)
  p.score_row = round16(15 + p.sinks + p.chunk);
  p.integer = current_dot() == Dot::kInt8;
  p.mask_kind = kMaskNone;
  p.mask = nullptr;
  p.mask_sb = p.mask_sh = p.mask_sl = p.mask_sc = p.mask_col0 = 0;
  p.softcap = 0.0f;
}

at::Tensor solve(Problem* problems, int64_t* first_task, int64_t count, const at::Tensor& query, double scaling,
                 const float* key_rotation, const float* value_rotation) {
  const Problem& shape = problems[0];
  const int64_t D = shape.head_dim, Dv = shape.value_dim;
  const int64_t query_floats = shape.batch * shape.kv_heads * shape.rows * D;  // per problem
  const int64_t out_floats = shape.batch * shape.kv_heads * shape.rows * Dv;   // per problem
  const float* value_qt = value_rotation != nullptr ? transposed(value_rotation, Dv) : nullptr;  // (packed sum) Qᵀ
  // Partial rows: chunk max, chunk sum, then from kAccOffset the exact sum and, with rotated values, from packed_acc
  // the packed sum (see Problem::partials).
  const int64_t packed_acc = value_qt != nullptr ? round16(Dv) : 0, acc_width = packed_acc + Dv;
  const int64_t acc_row = round16(kAccOffset + acc_width);
  int64_t partial_floats = 0;
  first_task[0] = 0;
  for (int64_t i = 0; i < count; ++i) {
    Problem& p = problems[i];
    p.acc_row = acc_row;
    p.acc_width = acc_width;
    p.packed_acc = packed_acc;
    partial_floats += p.batch * p.kv_heads * p.chunks * p.rows * acc_row;  // a multiple of 16: 64-byte aligned parts
    first_task[i + 1] = first_task[i] + p.batch * p.kv_heads * p.chunks;
  }
  // One allocation: the query rows, then every problem's partials and, with rotated values, the packed sums.
  const int64_t packed_floats = value_qt != nullptr ? round16(count * out_floats) : 0;
  const QueryRows q = query_rows(query, scaling, key_rotation, partial_floats + packed_floats);
  float* partials = q.workspace;
  for (int64_t i = 0; i < count; ++i) {
    Problem& p = problems[i];
    p.query = q.scaled + i * query_floats;
    p.packed_query = q.rotated + i * query_floats;
    p.partials = partials;
    partials += p.batch * p.kv_heads * p.chunks * p.rows * acc_row;
  }
  float* const packed_sum = value_qt != nullptr ? q.workspace + partial_floats : nullptr;

  run_problems(problems, first_task, count);

  // [B, Hq, L, Dv] is [B, Hkv, rows, Dv] in memory (row r of kv head h: query head h * q_per_kv + r / L, position
  // r % L). Allocated in its final shape, and returned as is for a float32 query: a view and a same-dtype `to` would
  // be two more dispatcher calls per call.
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2), Dv}, query.options().dtype(at::kFloat));
  float* const merged = out.data_ptr<float>();
  if (packed_sum != nullptr) std::fill(packed_sum, packed_sum + count * out_floats, 0.0f);
  if (count == 1) {
    merge_chunks(problems[0], merged, packed_sum);
  } else {
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        merge_chunks(problems[i], merged + i * out_floats, packed_sum != nullptr ? packed_sum + i * out_floats : nullptr);
    });
  }
  if (packed_sum != nullptr)  // exact sum + (packed sum) Qᵀ
    rows_times(packed_sum, value_qt, count * out_floats / Dv, Dv, merged, true);
  return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

}  // namespace kivi::cpu::decode
