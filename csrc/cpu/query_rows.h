// The query side of the fused decode attention, shared by decode_attention.cpp and paged_attention.cpp: the query rows
// in fp32 times `scaling` (and times the key rotation), and the transposed value rotation. Written as plain loops: the
// torch ops they replace (`(query.float() * scaling).contiguous()`, `empty_like`, `rotation.t().contiguous()`) cost
// more than the rows' arithmetic: in the model at batch 1 / 1k tokens the op's set-up took 74-80 k TSC cycles with
// them and 38 k without, of a ~235 k-cycle call (Zen 4).
#pragma once
#include <ATen/ATen.h>

namespace kivi::cpu::decode {

// query [B, Hq, L, D] (any strides; fp32, fp16 or bf16) as rows [B * Hq * L, D] of fp32 `query * (float)scaling`,
// rounded as torch's `query.float() * scaling`, in `scaled`; with a key rotation Q [D, D] (nullptr: none) also those
// rows times Q in `rotated` (what scores keys stored rotated: q.k = qQ.kQ), else rotated == scaled. `storage` owns both
// and `workspace_floats` more from `workspace` (64-byte aligned, uninitialised): the caller's scores, partials and
// packed sums, in the same allocation. A small at::empty took ~8 k TSC cycles (~3 us) in the model at batch 1 / 1k
// (Zen 4); one allocation instead of four: 0.087 -> 0.081 and 0.098 -> 0.090 ms per call there (interleaved A/Bs
// against the three extra allocations), unchanged at batch 4 / 8064.
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
