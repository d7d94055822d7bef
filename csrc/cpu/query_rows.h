// The query side of the fused decode attention, used by decode_problem.cpp's solve() for both ops: the query rows in
// fp32 times `scaling` (and times the key rotation), and the transposed value rotation. Written as plain loops: the
// torch ops they replace (`(query.float() * scaling).contiguous()`, `empty_like`, `rotation.t().contiguous()`) cost
// more than the rows' arithmetic at short contexts, where the op's set-up is a large part of a call.
#pragma once
#include <ATen/ATen.h>

namespace kivi::cpu::decode {

// query [B, Hq, L, D] (any strides; fp32, fp16 or bf16) as rows [B * Hq * L, D] of fp32 `query * (float)scaling`,
// rounded as torch's `query.float() * scaling`, in `scaled`; with a key rotation Q [D, D] (nullptr: none) also those
// rows times Q in `rotated` (what scores keys stored rotated: q.k = qQ.kQ), else rotated == scaled. `storage` owns both
// and `workspace_floats` more from `workspace` (64-byte aligned, uninitialised): the caller's partials and packed
// sums, in the same allocation (each at::empty costs as much as a short context's arithmetic).
struct QueryRows {
  at::Tensor storage;
  const float* scaled;
  const float* rotated;
  float* workspace;
};
QueryRows query_rows(const at::Tensor& query, double scaling, const float* key_rotation,
                     int64_t workspace_floats);

// Qᵀ (row-major) of a contiguous float32 Q [dim, dim]: the packed value sums are rotated back as rows times Qᵀ. Kept
// per thread and reused while the next call passes a Q of the same contents (a model has one or two rotations).
const float* transposed(const float* q, int64_t dim);

}  // namespace kivi::cpu::decode
