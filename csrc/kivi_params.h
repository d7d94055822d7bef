// Argument checks of kivi_xpu._C: each op fills one OpParams through the checks below, so every assumption of a
// launcher is checked once, here, and a direct call with bad tensors raises a Python exception, never crashes.
#pragma once

#include <torch/extension.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kivi_runtime.h"
#include "kivi_variants.h"

namespace kivi __attribute__((visibility("hidden"))) {  // hidden, as pybind11's own types are

// Layout of a packed operand. Keys: per-channel groups stored channel-major, codes [B,H,D,capacity bytes] where
// byte j of channel d holds tokens P*j .. P*j+P-1 (P = 8/bits codes per byte), scales/zeros [B,H,D,capacity groups].
// Values: per-token groups, codes [B,H,capacity tokens,D/P], scales/zeros [B,H,capacity tokens,D/G].
enum class Layout { kKeys, kValues };

// A checked packed operand (codes, scales, zeros) holding `num_tokens` tokens. The buffers may be over-allocated
// along the token axis; the capacities are their extents there (the kernels' row strides).
struct PackedParams {
  Layout layout;
  unsigned char* codes;
  unsigned char* scales;
  unsigned char* zeros;
  int meta;  // dtype tag (position in kDtypes) of scales and zeros
  int bits, per_byte;
  int64_t batch, heads, head_dim, num_tokens, group_size;
  int64_t code_capacity;  // keys: code bytes per channel (size 3); values: token rows (size 2)
  int64_t meta_capacity;  // keys: groups per channel (size 3); values: token rows (size 2)
};

// A checked contiguous float tensor [batch, heads, rows, cols].
struct DenseParams {
  unsigned char* data;
  int dtype;  // dtype tag (position in kDtypes)
  int64_t batch, heads, rows, cols;
};

// Everything a launcher needs, filled and checked once by the op.
struct OpParams {
  PackedParams packed;
  DenseParams dense;        // the float side: x (quantize), out (dequantize), query or probs (attention)
  float* result = nullptr;  // attention output: scores [B,Hq,L,N] or partial sums [B,Hq,L,chunks,D]
  int64_t chunk_tokens = 0, chunks = 0;  // value combine: tokens per partial sum, and their number
  bool refit = false;                    // quantize: fit="least_squares" (kivi_xpu/ops/reference.py)
};

// The fused decode attention over the packed history (kivi_packed_attention): both packed operands, the query, the
// optional additive mask bias over the packed columns and the per-chunk outputs.
struct FusedParams {
  PackedParams keys, values;
  DenseParams query;             // [B, Hq, L, D] float32, scaled (and rotated) by the caller
  const float* bias = nullptr;   // [B or 1, Hq or 1, L, num_tokens] float32, last stride 1; nullptr: no mask
  int64_t bias_b = 0, bias_h = 0, bias_l = 0;  // its strides (0 along a broadcast dim)
  bool bias_fills = false;       // a bool mask's 0 / -inf: -inf replaces the score (masked NaN ignored), else added
  float* chunk_max = nullptr;    // [B, Hq, L, chunks]
  float* chunk_sum = nullptr;    // [B, Hq, L, chunks]
  float* chunk_acc = nullptr;    // [B, Hq, L, chunks, Dv]
  at::TensorOptions scratch_on;  // the query's: where the launcher allocates each work-group's scores / weights
  int64_t chunk_tokens = 0, chunks = 0;
  float softcap = 0.0f;
};

// The paged decode attention (kivi_paged_attention): the pages of every layer's pool read in place through a block
// table, the requests' exact window slots, and the per-chunk outputs.
struct PagedParams {
  const float* query = nullptr;        // [N, Hq, 1, D] float32, scaled and rotated as the keys by the caller
  const float* plain_query = nullptr;  // the same, not rotated (scores the exact keys)
  const unsigned char *key_codes = nullptr, *value_codes = nullptr;
  const unsigned char *key_scales = nullptr, *key_zeros = nullptr, *value_scales = nullptr, *value_zeros = nullptr;
  const unsigned char *key_windows = nullptr, *value_windows = nullptr;
  const int64_t *block_table = nullptr, *requests = nullptr;
  int meta = 0, window = 0;  // dtype tags
  int key_bits = 2, value_bits = 2;
  int64_t requests_n = 0, q_heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0, tokens = 0, value_group = 0;
  int64_t key_group = 0;  // tokens per key group: a page holds tokens / key_group of them
  int64_t key_code_block = 0, key_meta_block = 0, value_code_block = 0, value_meta_block = 0;  // element strides
  int64_t key_window_slot = 0, key_window_head = 0, value_window_slot = 0, value_window_head = 0;
  int64_t table_cols = 0, chunk_tokens = 0, chunks = 0;
  float *chunk_max = nullptr, *chunk_sum = nullptr, *chunk_acc = nullptr, *chunk_exact_acc = nullptr;
  at::TensorOptions scratch_on;  // the query's: where the launcher allocates each work-group's scores / weights
};

using NamedTensors = std::initializer_list<std::pair<const at::Tensor*, const char*>>;

inline unsigned char* bytes(const at::Tensor& t) { return static_cast<unsigned char*>(t.data_ptr()); }

inline int dtype_tag(const at::Tensor& t, const char* name) {
  for (size_t tag = 0; tag < kDtypes.size(); ++tag) {
    if (t.scalar_type() == kDtypes[tag].torch) return static_cast<int>(tag);
  }
  TORCH_CHECK_TYPE(false, "`", name, "` must be float32, float16 or bfloat16, got ", t.scalar_type());
  return -1;  // unreachable
}

inline void check_rank4_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 4, "`", name, "` must have rank 4 [batch, heads, tokens, head_dim], got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "`", name, "` must be contiguous");
}

inline void check_shape(const at::Tensor& t, const char* name, std::vector<int64_t> expected) {
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(expected), "`", name, "` must have shape ", at::IntArrayRef(expected),
                    ", got ", t.sizes());
}

inline int per_byte_checked(int64_t group_size, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 2 || bits == 4 || bits == 8, "`bits` must be 2, 4 or 8, got ", bits);
  const int per = 8 / static_cast<int>(bits);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % per == 0, "`group_size` must be a positive multiple of ", per,
                    " for ", bits, "-bit codes, got ", group_size);
  return per;
}

// Refuses memory the selected device cannot dereference (host memory on a discrete GPU, another context's USM).
inline void check_accessible(const DeviceRuntime& rt, const at::Tensor& t, const char* name) {
  if (t.numel() == 0) return;
  if (t.device().is_cpu()) {
    TORCH_CHECK_VALUE(rt.system_usm, "`", name, "` is a CPU tensor, but SYCL device ", rt.filter, " (", rt.name,
                      ") cannot access host memory (no usm_system_allocations aspect): move it to that device");
    return;
  }
  const sycl::usm::alloc kind = sycl::get_pointer_type(t.data_ptr(), rt.context);
  TORCH_CHECK_VALUE(kind != sycl::usm::alloc::unknown, "`", name, "` is on ", t.device(),
                    ", which is not USM memory of SYCL device ", rt.filter, " (", rt.name, ")");
  if (kind == sycl::usm::alloc::device) {
    TORCH_CHECK_VALUE(sycl::get_pointer_device(t.data_ptr(), rt.context) == rt.device, "`", name, "` lives on ",
                      t.device(), ", a different device than ", rt.filter, " (", rt.name, ")");
  }
}

// All tensors of one call share the first one's device, and the SYCL device can dereference each of them.
inline void check_devices(const DeviceRuntime& rt, NamedTensors tensors) {
  const auto& [reference, reference_name] = *tensors.begin();
  for (const auto& [t, name] : tensors) {
    TORCH_CHECK_VALUE(t->device() == reference->device(), "`", name, "` is on ", t->device(), " but `",
                      reference_name, "` is on ", reference->device(), ": all must share a device");
  }
  for (const auto& [t, name] : tensors) check_accessible(rt, *t, name);
}

// A rank-4 contiguous float operand; `float32_only` for the fused attention ops, which take float32 operands.
inline DenseParams check_dense(const at::Tensor& t, const char* name, bool float32_only) {
  check_rank4_contiguous(t, name);
  TORCH_CHECK_TYPE(!float32_only || t.scalar_type() == at::kFloat, "`", name, "` must be float32, got ",
                   t.scalar_type());
  return DenseParams{bytes(t), dtype_tag(t, name), t.size(0), t.size(1), t.size(2), t.size(3)};
}

// The packed operand of the dequantize and attention ops (and, after its exact shapes, of quantize).
inline PackedParams check_packed(Layout layout, const at::Tensor& codes, const at::Tensor& scales,
                                 const at::Tensor& zeros, int64_t num_tokens, int64_t group_size, int64_t bits) {
  const int per = per_byte_checked(group_size, bits);
  check_rank4_contiguous(codes, "codes");
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "`codes` must be uint8, got ", codes.scalar_type());
  check_rank4_contiguous(scales, "scales");
  check_rank4_contiguous(zeros, "zeros");
  TORCH_CHECK_TYPE(scales.scalar_type() == zeros.scalar_type(), "`scales` and `zeros` must share a dtype, got ",
                   scales.scalar_type(), " and ", zeros.scalar_type());
  const int meta = dtype_tag(scales, "scales");
  TORCH_CHECK_VALUE(num_tokens >= 0, "`num_tokens` must be non-negative, got ", num_tokens);
  const int64_t B = codes.size(0), H = codes.size(1);
  TORCH_CHECK_VALUE(scales.sizes() == zeros.sizes(), "`scales` and `zeros` must have the same shape, got ",
                    scales.sizes(), " and ", zeros.sizes());
  TORCH_CHECK_VALUE(scales.size(0) == B && scales.size(1) == H, "`scales` batch/heads ", scales.sizes().slice(0, 2),
                    " do not match `codes` batch/heads ", codes.sizes().slice(0, 2));
  const bool keys = layout == Layout::kKeys;
  const int64_t D = keys ? codes.size(2) : codes.size(3) * per;
  if (keys) {
    TORCH_CHECK_VALUE(num_tokens % group_size == 0, "`num_tokens` (", num_tokens,
                      ") must be a multiple of `group_size` (", group_size, ") for keys");
    TORCH_CHECK_VALUE(scales.size(2) == D, "`scales` dim 2 (", scales.size(2), ") must equal head_dim ", D,
                      " (keys are channel-major)");
    TORCH_CHECK_VALUE(codes.size(3) >= num_tokens / per && scales.size(3) >= num_tokens / group_size,
                      "`num_tokens` (", num_tokens, ") exceeds the stored tokens: codes hold ", codes.size(3) * per,
                      ", scales hold ", scales.size(3) * group_size);
  } else {
    TORCH_CHECK_VALUE(D % group_size == 0, "`group_size` (", group_size, ") must divide head_dim (", D, ")");
    TORCH_CHECK_VALUE(scales.size(3) == D / group_size, "`scales` last dim ", scales.size(3),
                      " must equal head_dim / group_size = ", D / group_size);
    TORCH_CHECK_VALUE(codes.size(2) >= num_tokens && scales.size(2) >= num_tokens, "`num_tokens` (", num_tokens,
                      ") exceeds the stored tokens: codes hold ", codes.size(2), ", scales hold ", scales.size(2));
    // The value kernels index channels in 32 bits.
    TORCH_CHECK_VALUE(D <= 0xFFFFFFFFll, "head_dim ", D, " is too large");
  }
  const int token_dim = keys ? 3 : 2;
  return PackedParams{layout,          bytes(codes), bytes(scales),       bytes(zeros),
                      meta,            (int)bits,    per,                 B,
                      H,               D,            num_tokens,          group_size,
                      codes.size(token_dim),         scales.size(token_dim)};
}

// quantize_keys / quantize_values: x [B,H,T,D] and the packed operand it fills, of exactly T tokens.
template <Layout layout>
inline OpParams check_quantize(const DeviceRuntime& rt, const at::Tensor& x, const at::Tensor& codes,
                               const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size, int64_t bits,
                               bool refit) {
  OpParams p;
  p.refit = refit;
  p.dense = check_dense(x, "x", false);
  const int per = per_byte_checked(group_size, bits);
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  std::vector<int64_t> code_shape, meta_shape;
  if (layout == Layout::kKeys) {
    TORCH_CHECK_VALUE(T % group_size == 0, "`group_size` (", group_size, ") must divide the number of tokens (", T,
                      ")");
    code_shape = {B, H, D, T / per};
    meta_shape = {B, H, D, T / group_size};
  } else {
    TORCH_CHECK_VALUE(D % group_size == 0, "`group_size` (", group_size, ") must divide head_dim (", D, ")");
    code_shape = {B, H, T, D / per};
    meta_shape = {B, H, T, D / group_size};
  }
  check_shape(codes, "codes", code_shape);
  check_shape(scales, "scales", meta_shape);
  check_shape(zeros, "zeros", meta_shape);
  p.packed = check_packed(layout, codes, scales, zeros, T, group_size, bits);
  check_devices(rt, {{&x, "x"}, {&codes, "codes"}, {&scales, "scales"}, {&zeros, "zeros"}});
  return p;
}

// dequantize_keys / dequantize_values: the packed operand and out [B,H,N,D] in any float dtype.
template <Layout layout>
inline OpParams check_dequantize(const DeviceRuntime& rt, const at::Tensor& codes, const at::Tensor& scales,
                                 const at::Tensor& zeros, const at::Tensor& out, int64_t num_tokens,
                                 int64_t group_size, int64_t bits) {
  OpParams p;
  p.packed = check_packed(layout, codes, scales, zeros, num_tokens, group_size, bits);
  p.dense = check_dense(out, "out", false);
  check_shape(out, "out", {p.packed.batch, p.packed.heads, num_tokens, p.packed.head_dim});
  check_devices(rt, {{&codes, "codes"}, {&scales, "scales"}, {&zeros, "zeros"}, {&out, "out"}});
  return p;
}

// The fused attention ops: the packed operand, the float32 dense operand `dense_name` [B, Hq, L, X] with Hq a
// multiple of the kv heads (X = head_dim for keys, num_tokens for values) and the float32 output `out`.
inline OpParams check_attention(const DeviceRuntime& rt, Layout layout, const char* dense_name,
                                const at::Tensor& dense, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& zeros, const at::Tensor& out, int64_t num_tokens,
                                int64_t group_size, int64_t bits, int64_t chunk_tokens = 0) {
  OpParams p;
  p.packed = check_packed(layout, codes, scales, zeros, num_tokens, group_size, bits);
  p.dense = check_dense(dense, dense_name, true);
  const int64_t B = p.packed.batch, H = p.packed.heads, D = p.packed.head_dim;
  TORCH_CHECK_VALUE(H > 0 && dense.size(0) == B && dense.size(1) % H == 0, "`", dense_name, "` shape ",
                    dense.sizes(), " must be [batch=", B, ", a multiple of the ", H, " kv heads, ...]");
  std::vector<int64_t> out_shape = {B, dense.size(1), dense.size(2)};
  if (layout == Layout::kKeys) {
    TORCH_CHECK_VALUE(dense.size(3) == D, "`query` head_dim ", dense.size(3), " does not match the keys' head_dim ",
                      D);
    out_shape.push_back(num_tokens);
  } else {
    TORCH_CHECK_VALUE(dense.size(3) == num_tokens, "`probs` last dim ", dense.size(3), " must equal `num_tokens` (",
                      num_tokens, ")");
    TORCH_CHECK_VALUE(chunk_tokens > 0, "`chunk_tokens` must be positive, got ", chunk_tokens);
    TORCH_CHECK_VALUE(out.dim() == 5, "`partial` must have rank 5 [batch, heads, length, chunks, head_dim], got ",
                      out.sizes());
    p.chunk_tokens = chunk_tokens;
    p.chunks = (num_tokens + chunk_tokens - 1) / chunk_tokens;
    out_shape.insert(out_shape.end(), {p.chunks, D});
  }
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "`out` must be float32, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.is_contiguous(), "`out` must be contiguous");
  check_shape(out, "out", out_shape);
  p.result = static_cast<float*>(out.data_ptr());
  check_devices(rt, {{&codes, "codes"}, {&scales, "scales"}, {&zeros, "zeros"}, {&dense, dense_name}, {&out, "out"}});
  return p;
}

// packed_key_scores: query [B,Hq,L,D] against the packed keys -> out [B,Hq,L,N].
inline OpParams check_key_scores(const DeviceRuntime& rt, const at::Tensor& query, const at::Tensor& codes,
                                 const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& out,
                                 int64_t num_tokens, int64_t group_size, int64_t bits) {
  return check_attention(rt, Layout::kKeys, "query", query, codes, scales, zeros, out, num_tokens, group_size, bits);
}

// packed_value_combine: probs [B,Hq,L,N] over the packed values -> partial [B,Hq,L,chunks,D].
inline OpParams check_value_combine(const DeviceRuntime& rt, const at::Tensor& probs, const at::Tensor& codes,
                                    const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& partial,
                                    int64_t num_tokens, int64_t group_size, int64_t bits, int64_t chunk_tokens) {
  return check_attention(rt, Layout::kValues, "probs", probs, codes, scales, zeros, partial, num_tokens, group_size,
                         bits, chunk_tokens);
}

// kivi_packed_attention: every operand checked once (shapes, dtypes, devices, the chunking).
inline FusedParams check_packed_attention(const DeviceRuntime& rt, const at::Tensor& query, const at::Tensor& key_codes,
                                          const at::Tensor& key_scales, const at::Tensor& key_zeros,
                                          const at::Tensor& value_codes, const at::Tensor& value_scales,
                                          const at::Tensor& value_zeros, const c10::optional<at::Tensor>& bias,
                                          bool bias_fills, const at::Tensor& chunk_max, const at::Tensor& chunk_sum,
                                          const at::Tensor& chunk_acc, int64_t num_tokens, int64_t key_group,
                                          int64_t key_bits, int64_t value_group, int64_t value_bits,
                                          int64_t chunk_tokens, double softcap) {
  FusedParams p;
  p.keys = check_packed(Layout::kKeys, key_codes, key_scales, key_zeros, num_tokens, key_group, key_bits);
  p.values = check_packed(Layout::kValues, value_codes, value_scales, value_zeros, num_tokens, value_group, value_bits);
  p.query = check_dense(query, "query", true);
  const int64_t B = p.keys.batch, H = p.keys.heads, Hq = query.size(1), L = query.size(2);
  TORCH_CHECK_VALUE(p.values.batch == B && p.values.heads == H, "value codes batch/heads ",
                    value_codes.sizes().slice(0, 2), " do not match the key codes' [", B, ", ", H, "]");
  TORCH_CHECK_VALUE(p.values.meta == p.keys.meta, "key and value scales must share a dtype, got ",
                    key_scales.scalar_type(), " and ", value_scales.scalar_type());
  TORCH_CHECK_VALUE(H > 0 && query.size(0) == B && Hq % H == 0 && query.size(3) == p.keys.head_dim, "`query` shape ",
                    query.sizes(), " must be [batch=", B, ", a multiple of the ", H, " kv heads, length, head_dim=",
                    p.keys.head_dim, "]");
  TORCH_CHECK_VALUE(chunk_tokens > 0 && chunk_tokens % 8 == 0, "`chunk_tokens` must be a positive multiple of 8, got ",
                    chunk_tokens);
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap), "`softcap` must be finite and >= 0, got ", softcap);
  p.chunk_tokens = chunk_tokens;
  p.chunks = (num_tokens + chunk_tokens - 1) / chunk_tokens;
  p.softcap = static_cast<float>(softcap);
  if (bias.has_value()) {
    const at::Tensor& m = *bias;
    TORCH_CHECK_TYPE(m.scalar_type() == at::kFloat, "`bias` must be float32, got ", m.scalar_type());
    TORCH_CHECK_VALUE(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == Hq) &&
                          m.size(2) == L && m.size(3) == num_tokens && (num_tokens <= 1 || m.stride(3) == 1),
                      "`bias` must be [1 or ", B, ", 1 or ", Hq, ", ", L, ", ", num_tokens,
                      "] float32 with unit stride along tokens, got ", m.sizes(), " strides ", m.strides());
    p.bias = m.data_ptr<float>();
    p.bias_b = m.size(0) == 1 ? 0 : m.stride(0);
    p.bias_h = m.size(1) == 1 ? 0 : m.stride(1);
    p.bias_l = m.stride(2);
    p.bias_fills = bias_fills;
    check_devices(rt, {{&query, "query"}, {&m, "bias"}});
  }
  for (const auto& [t, name] : {std::pair{&chunk_max, "chunk_max"}, {&chunk_sum, "chunk_sum"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->is_contiguous(), "`", name,
                     "` must be a contiguous float32 tensor");
    check_shape(*t, name, {B, Hq, L, p.chunks});
  }
  TORCH_CHECK_TYPE(chunk_acc.scalar_type() == at::kFloat && chunk_acc.is_contiguous(),
                   "`chunk_acc` must be a contiguous float32 tensor");
  check_shape(chunk_acc, "chunk_acc", {B, Hq, L, p.chunks, p.values.head_dim});
  p.chunk_max = chunk_max.data_ptr<float>();
  p.chunk_sum = chunk_sum.data_ptr<float>();
  p.chunk_acc = chunk_acc.data_ptr<float>();
  p.scratch_on = query.options();
  check_devices(rt, {{&query, "query"},
                     {&key_codes, "key_codes"},
                     {&key_scales, "key_scales"},
                     {&key_zeros, "key_zeros"},
                     {&value_codes, "value_codes"},
                     {&value_scales, "value_scales"},
                     {&value_zeros, "value_zeros"},
                     {&chunk_max, "chunk_max"},
                     {&chunk_sum, "chunk_sum"},
                     {&chunk_acc, "chunk_acc"}});
  return p;
}

// kivi_paged_attention: every operand and every request row checked once (the kernel indexes pages and window rows
// with them). The page sections are [blocks, H, ...] views of one pool: contiguous within a block, any block stride.
inline PagedParams check_paged_attention(const DeviceRuntime& rt, const at::Tensor& query,
                                         const at::Tensor& plain_query, const at::Tensor& key_windows,
                                         const at::Tensor& value_windows, const at::Tensor& key_codes,
                                         const at::Tensor& key_scales, const at::Tensor& key_zeros,
                                         const at::Tensor& value_codes, const at::Tensor& value_scales,
                                         const at::Tensor& value_zeros, const at::Tensor& block_table,
                                         const at::Tensor& requests, const at::Tensor& chunk_max,
                                         const at::Tensor& chunk_sum, const at::Tensor& chunk_acc,
                                         const at::Tensor& chunk_exact_acc, int64_t key_bits, int64_t value_group,
                                         int64_t value_bits, int64_t chunk_tokens) {
  PagedParams p;
  check_rank4_contiguous(query, "query");
  TORCH_CHECK_TYPE(query.scalar_type() == at::kFloat, "`query` must be float32, got ", query.scalar_type());
  check_rank4_contiguous(plain_query, "plain_query");
  TORCH_CHECK_VALUE(plain_query.scalar_type() == at::kFloat && plain_query.sizes() == query.sizes(),
                    "`plain_query` must be float32 of the query's shape ", query.sizes());
  const int64_t N = query.size(0), Hq = query.size(1), D = query.size(3);
  TORCH_CHECK_VALUE(query.size(2) == 1, "`query` must hold one row per request [N, Hq, 1, D], got ", query.sizes());
  for (const auto& [t, name] : {std::pair{&key_windows, "key_windows"}, {&value_windows, "value_windows"}}) {
    TORCH_CHECK_VALUE(t->dim() == 4 && t->stride(3) == 1 && t->stride(2) == t->size(3),
                      "`", name, "` must be [slots, H, W, D] with contiguous rows, got ", t->sizes(), " strides ",
                      t->strides());
  }
  p.window = dtype_tag(key_windows, "key_windows");
  TORCH_CHECK_VALUE(value_windows.scalar_type() == key_windows.scalar_type(), "the windows must share a dtype");
  const int64_t slots = key_windows.size(0), H = key_windows.size(1);
  TORCH_CHECK_VALUE(H > 0 && Hq % H == 0 && key_windows.size(3) == D && value_windows.size(0) == slots &&
                        value_windows.size(1) == H,
                    "`query` ", query.sizes(), " and the windows ", key_windows.sizes(), " / ", value_windows.sizes(),
                    " disagree on heads or head_dim");
  const int per_key = per_byte_checked(8, key_bits), per_value = per_byte_checked(value_group, value_bits);
  const int64_t blocks = key_codes.size(0), T = key_codes.dim() == 4 ? key_codes.size(3) * per_key : 0;
  const int64_t Dv = value_windows.size(3);
  TORCH_CHECK_VALUE(Dv % value_group == 0 && Dv % per_value == 0, "`value_group` (", value_group,
                    ") must divide the value head_dim ", Dv);
  const int64_t key_groups = key_scales.dim() == 4 ? key_scales.size(2) : 0;  // per page, metadata group-major
  TORCH_CHECK_VALUE(key_groups > 0 && T % key_groups == 0 && (T / key_groups) % per_key == 0,
                    "`key_scales` must be [blocks, H, T/G, D]: T/G key groups of G tokens, whole code bytes each, got ",
                    key_scales.sizes(), " for pages of ", T, " tokens");
  const std::vector<std::pair<const at::Tensor*, std::vector<int64_t>>> sections = {
      {&key_codes, {blocks, H, D, T / per_key}},     {&key_scales, {blocks, H, key_groups, D}},
      {&key_zeros, {blocks, H, key_groups, D}},      {&value_codes, {blocks, H, T, Dv / per_value}},
      {&value_scales, {blocks, H, T, Dv / value_group}}, {&value_zeros, {blocks, H, T, Dv / value_group}}};
  const char* names[] = {"key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros"};
  for (size_t i = 0; i < sections.size(); ++i) {
    const at::Tensor& t = *sections[i].first;
    check_shape(t, names[i], sections[i].second);
    TORCH_CHECK_VALUE(t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) == t.size(2) * t.size(3),
                      "`", names[i], "` must be contiguous within a block, got strides ", t.strides());
  }
  TORCH_CHECK_VALUE(T > 0 && T % per_key == 0, "the pages must hold a positive multiple of ", per_key, " tokens");
  TORCH_CHECK_TYPE(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte,
                   "the codes must be uint8");
  p.meta = dtype_tag(key_scales, "key_scales");
  for (const at::Tensor* t : {&key_zeros, &value_scales, &value_zeros}) {
    TORCH_CHECK_TYPE(t->scalar_type() == key_scales.scalar_type(), "scales and zeros must share a dtype");
  }
  TORCH_CHECK_VALUE(chunk_tokens > 0 && chunk_tokens % T == 0, "`chunk_tokens` (", chunk_tokens,
                    ") must be a positive multiple of the page's ", T, " tokens");
  for (const auto& [t, name] : {std::pair{&block_table, "block_table"}, {&requests, "requests"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong && t->dim() == 2 && t->size(0) == N && t->is_contiguous(), "`",
                     name, "` must be a contiguous int64 [", N, ", *] tensor, got ", t->sizes());
  }
  TORCH_CHECK_VALUE(requests.size(1) == 7, "`requests` must have 7 columns, got ", requests.sizes());
  // Every row's tokens and rows in range (read on the host: a handful of integers per request).
  const at::Tensor rows = requests.to(at::kCPU), table = block_table.to(at::kCPU);
  int64_t top_max = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t* r = rows.data_ptr<int64_t>() + i * 7;
    const int64_t slot = r[0], sinks = r[1], kc = r[2], ktr = r[3], vc = r[4], vtr = r[5], length = r[6];
    const int64_t top = std::max(kc, vc);
    const bool ok = slot >= 0 && slot < slots && sinks >= 0 && kc >= 0 && kc % T == 0 && vc >= 0 &&
                    length >= sinks + top && ktr >= 0 && ktr + length - sinks - kc <= key_windows.size(2) &&
                    vtr >= 0 && vtr + length - sinks - vc <= value_windows.size(2) &&
                    (top + T - 1) / T <= block_table.size(1);
    TORCH_CHECK_VALUE(ok, "paged_attention: `requests` row ", i, " (", rows[i], ") is out of range");
    for (int64_t page = 0; page < (top + T - 1) / T; ++page) {
      const int64_t b = table.data_ptr<int64_t>()[i * block_table.size(1) + page];
      TORCH_CHECK_VALUE(b >= 0 && b < blocks, "`block_table`[", i, ", ", page, "] = ", b, " is not a block in [0, ",
                        blocks, ")");
    }
    top_max = std::max(top_max, top);
  }
  p.chunks = (top_max + chunk_tokens - 1) / chunk_tokens;
  for (const auto& [t, name] : {std::pair{&chunk_max, "chunk_max"}, {&chunk_sum, "chunk_sum"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->is_contiguous(), "`", name,
                     "` must be a contiguous float32 tensor");
    check_shape(*t, name, {N, Hq, 1, p.chunks});
  }
  for (const auto& [t, name] : {std::pair{&chunk_acc, "chunk_acc"}, {&chunk_exact_acc, "chunk_exact_acc"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->is_contiguous(), "`", name,
                     "` must be a contiguous float32 tensor");
    check_shape(*t, name, {N, Hq, 1, p.chunks, Dv});
  }
  check_devices(rt, {{&query, "query"}, {&plain_query, "plain_query"}, {&key_windows, "key_windows"},
                     {&value_windows, "value_windows"}, {&key_codes, "key_codes"}, {&key_scales, "key_scales"},
                     {&key_zeros, "key_zeros"}, {&value_codes, "value_codes"}, {&value_scales, "value_scales"},
                     {&value_zeros, "value_zeros"}, {&block_table, "block_table"}, {&requests, "requests"},
                     {&chunk_max, "chunk_max"}, {&chunk_sum, "chunk_sum"}, {&chunk_acc, "chunk_acc"},
                     {&chunk_exact_acc, "chunk_exact_acc"}});
  p.query = query.data_ptr<float>(), p.plain_query = plain_query.data_ptr<float>();
  p.key_codes = bytes(key_codes), p.value_codes = bytes(value_codes);
  p.key_scales = bytes(key_scales), p.key_zeros = bytes(key_zeros);
  p.value_scales = bytes(value_scales), p.value_zeros = bytes(value_zeros);
  p.key_windows = bytes(key_windows), p.value_windows = bytes(value_windows);
  p.block_table = block_table.data_ptr<int64_t>(), p.requests = requests.data_ptr<int64_t>();
  p.key_bits = (int)key_bits, p.value_bits = (int)value_bits;
  p.requests_n = N, p.q_heads = Hq, p.kv_heads = H, p.head_dim = D, p.value_dim = Dv, p.tokens = T;
  p.value_group = value_group, p.key_group = T / key_groups;
  p.key_code_block = key_codes.stride(0), p.key_meta_block = key_scales.stride(0);
  p.value_code_block = value_codes.stride(0), p.value_meta_block = value_scales.stride(0);
  TORCH_CHECK_VALUE(key_zeros.stride(0) == p.key_meta_block && value_zeros.stride(0) == p.value_meta_block,
                    "scales and zeros must share their block strides");
  p.key_window_slot = key_windows.stride(0), p.key_window_head = key_windows.stride(1);
  p.value_window_slot = value_windows.stride(0), p.value_window_head = value_windows.stride(1);
  p.table_cols = block_table.size(1), p.chunk_tokens = chunk_tokens;
  p.chunk_max = chunk_max.data_ptr<float>(), p.chunk_sum = chunk_sum.data_ptr<float>();
  p.chunk_acc = chunk_acc.data_ptr<float>(), p.chunk_exact_acc = chunk_exact_acc.data_ptr<float>();
  p.scratch_on = query.options();
  return p;
}

}  // namespace kivi
