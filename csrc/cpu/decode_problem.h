// The one builder of fused decode attention problems, for both ops: decode_attention.cpp (one Problem over the whole
// batch) and paged_attention.cpp (one Problem of batch 1 per request, its Packed operands on a page list). An op
// checks its arguments with the checks below, sets each Problem's shapes and operands, calls plan() on it, and hands
// them all to solve(), which owns the rest: the accumulator layout, the query rows and the workspace in one
// allocation, the tasks, the in-order merge and the rotation back of the packed values' sum.
#pragma once
#include <torch/extension.h>

#include "decode_attention.h"

namespace kivi::cpu::decode {

// ---- the argument checks both ops share: each raises ValueError "<op>: `<name>` must ..., got ..." -----------------

// `t` on the CPU with `rank` dims.
void check_cpu(const char* op, const at::Tensor& t, const char* name, int64_t rank);
// The kernels' Dtype of `t`: float32, float16 or bfloat16.
Dtype float_dtype(const char* op, const at::Tensor& t, const char* name);
// Codes per byte of `bits` (2, 4 or 8) bit codes.
int64_t codes_per_byte(const char* op, int64_t bits, const char* name);
// A rotation Q [dim, dim]: a contiguous float32 CPU tensor, or nullptr for none.
const float* rotation(const char* op, const c10::optional<at::Tensor>& arg, const char* name, int64_t dim);

// ---- the problem ---------------------------------------------------------------------------------------------------

// Fills what follows from the shapes and operands the op set (batch, kv_heads, q_per_kv, length, head_dim, value_dim,
// key_sinks / key_tail / value_sinks / value_tail, keys, values): sinks, n = sinks + packed keys + key tail, rows,
// the task split (chunk, chunks, score_row) and the arithmetic; no mask and no softcap (the op sets them after).
void plan(Problem& p);

// Runs `count` planned problems of one call, problem i reading the query rows [i * per, (i + 1) * per) of `query`
// [B, Hq, L, D] (each problem batch * kv_heads * rows of them; the problems share their shapes, not their tokens):
// one allocation for the query rows (times `scaling`, and times `key_rotation` for the packed keys), every problem's
// partials and, with a `value_rotation` (Q [value_dim, value_dim], checked by rotation()), the packed values' sums;
// then the tasks, the merge of each problem's chunks in order and the packed sums times Qᵀ. `first_task` is the
// caller's storage for count + 1 entries (no allocation for one problem). Returns [B, Hq, L, value_dim] in query's
// dtype.
at::Tensor solve(Problem* problems, int64_t* first_task, int64_t count, const at::Tensor& query, double scaling,
                 const float* key_rotation, const float* value_rotation);

}  // namespace kivi::cpu::decode
