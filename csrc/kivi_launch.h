// Launchers of kivi_xpu._C: each takes the checked OpParams of its op, picks the kernel variant, sizes the nd_range
// and passes the kernel's arguments (in the order of its signature in csrc/device/). Every launch waits.
#pragma once

#include <torch/extension.h>

#include <sycl/sycl.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kivi_params.h"
#include "kivi_runtime.h"
#include "kivi_variants.h"

namespace kivi __attribute__((visibility("hidden"))) {  // hidden, as pybind11's own types are

// Local size along the vectorised last dimension for an extent n: the kernel's limit, halved while twice the extent
// still fits (so a head_dim of 64 gets 64, not 256 with 192 idle items); the global size is padded to a multiple and
// the kernels guard the padding.
inline size_t local_for(const Kernel& k, size_t n) {
  size_t local = k.max_local;
  while (local > 1 && local / 2 >= n) local /= 2;
  return local;
}

inline size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Submits `k` over `range` and waits for completion.
template <int Dims, typename... Args>
void launch(DeviceRuntime& rt, KernelId id, const Kernel& k, sycl::nd_range<Dims> range, Args... args) {
  py::gil_scoped_release no_gil;
  try {
    rt.queue
        .submit([&](sycl::handler& h) {
          h.set_args(args...);
          h.parallel_for(range, k.kernel);
        })
        .wait_and_throw();
  } catch (const sycl::exception& e) {
    throw std::runtime_error(std::string("kivi_xpu: ") + kKernelTemplates[id].name + " failed: " + e.what());
  }
}

// {d0, d1, d2} grid with work-groups of {1, 1, local}: only the last dimension varies inside a work-group, so on
// the CPU device everything derived from the first two is uniform (scalar) code.
template <typename... Args>
void launch_3d(DeviceRuntime& rt, KernelId id, const std::vector<int>& variant, size_t d0, size_t d1, size_t d2,
               Args... args) {
  if (d0 == 0 || d1 == 0 || d2 == 0) return;
  const Kernel& k = rt.kernel(id, variant);
  const size_t local = local_for(k, d2);
  launch(rt, id, k, sycl::nd_range<3>({d0, d1, round_up(d2, local)}, {1, 1, local}), args...);
}

// 1 when every key group's code bytes can be moved as aligned 32-bit words: G/P and the row length (bytes)
// multiples of 4 and a 4-byte aligned base.
inline int key_code_words(const PackedParams& q) {
  return (q.group_size / q.per_byte) % 4 == 0 && q.code_capacity % 4 == 0 &&
         reinterpret_cast<uintptr_t>(q.codes) % 4 == 0;
}

// Query / probability rows per work-item: all R rows of a kv head when R <= kMaxRowsPerItem (4), else the block
// size in {4, 3} that wastes fewest rows in the last block.
inline int rows_per_item(int64_t rows) {
  if (rows <= kMaxRowsPerItem) return static_cast<int>(std::max<int64_t>(rows, 1));
  return rows % 4 == 0 || rows % 3 != 0 ? 4 : 3;
}

inline void launch_quantize_keys(DeviceRuntime& rt, const OpParams& p) {
  const PackedParams& q = p.packed;
  const DenseParams& x = p.dense;  // [B,H,T,D]
  launch_3d(rt, kQuantizeKeys, {x.dtype, q.meta}, size_t(x.batch * x.heads), size_t(x.rows / q.group_size),
            size_t(x.cols), x.data, q.codes, q.scales, q.zeros, size_t(x.rows), size_t(x.cols), size_t(q.group_size),
            q.bits, key_code_words(q), int(p.refit));
}

// One work-item per group of G consecutive channels: a flat 1-D range over B*H*T*(D/G) groups.
inline void launch_quantize_values(DeviceRuntime& rt, const OpParams& p) {
  const PackedParams& q = p.packed;
  const DenseParams& x = p.dense;
  const size_t groups = x.batch * x.heads * x.rows * (x.cols / q.group_size);
  if (groups == 0) return;
  const Kernel& k = rt.kernel(kQuantizeValues, {x.dtype, q.meta});
  const size_t local = local_for(k, groups);
  launch(rt, kQuantizeValues, k, sycl::nd_range<1>(round_up(groups, local), local), x.data, q.codes, q.scales,
         q.zeros, groups, size_t(q.group_size), q.bits, int(p.refit));
}

inline void launch_dequantize_keys(DeviceRuntime& rt, const OpParams& p) {
  const PackedParams& q = p.packed;
  launch_3d(rt, kDequantizeKeys, {q.meta, p.dense.dtype}, size_t(q.batch * q.heads),
            size_t(q.num_tokens / q.group_size), size_t(q.head_dim), q.codes, q.scales, q.zeros, p.dense.data,
            size_t(q.num_tokens), size_t(q.head_dim), size_t(q.code_capacity), size_t(q.meta_capacity),
            size_t(q.group_size), q.bits, key_code_words(q));
}

inline void launch_dequantize_values(DeviceRuntime& rt, const OpParams& p) {
  const PackedParams& q = p.packed;
  // The kernel finds a channel's group by a shift when G is a power of two.
  const int group_shift = (q.group_size & (q.group_size - 1)) == 0 ? __builtin_ctzll(q.group_size) : -1;
  launch_3d(rt, kDequantizeValues, {q.meta, p.dense.dtype}, size_t(q.batch * q.heads), size_t(q.num_tokens),
            size_t(q.head_dim), q.codes, q.scales, q.zeros, p.dense.data, size_t(q.num_tokens), size_t(q.head_dim),
            size_t(q.code_capacity), size_t(q.meta_capacity), size_t(q.group_size), group_shift, q.bits);
}

// Scores: one item per (kv head, block of query rows, code byte of the token axis).
inline void launch_packed_key_scores(DeviceRuntime& rt, const OpParams& p) {
  const PackedParams& q = p.packed;
  const int64_t rows = p.dense.heads / q.heads * p.dense.rows;  // query rows per kv head
  const int rpi = rows_per_item(rows);
  launch_3d(rt, kPackedKeyScores, {q.meta, bits_position(q.bits), rpi - 1}, size_t(q.batch * q.heads),
            size_t((rows + rpi - 1) / rpi), size_t(q.num_tokens / q.per_byte), p.dense.data, q.codes, q.scales,
            q.zeros, p.result, size_t(rows), size_t(q.num_tokens), size_t(q.head_dim), size_t(q.code_capacity),
            size_t(q.meta_capacity), size_t(q.group_size));
}

// Value combine: one item per (kv head, block of probability rows x token chunk, code byte of a token row).
inline void launch_packed_value_combine(DeviceRuntime& rt, const OpParams& p) {
  const PackedParams& q = p.packed;
  const int64_t rows = p.dense.heads / q.heads * p.dense.rows;
  const int rpi = rows_per_item(rows);
  const int64_t blocks = (rows + rpi - 1) / rpi;
  launch_3d(rt, kPackedValueCombine, {q.meta, bits_position(q.bits), rpi - 1}, size_t(q.batch * q.heads),
            size_t(blocks * p.chunks), size_t(q.head_dim / q.per_byte), p.dense.data, q.codes, q.scales, q.zeros,
            p.result, size_t(rows), size_t(q.num_tokens), size_t(q.head_dim), size_t(q.code_capacity),
            size_t(q.meta_capacity), size_t(q.group_size), size_t(p.chunk_tokens), size_t(p.chunks));
}

// Fused decode attention: one work-group of the kernel's local size per (kv head, block of query rows, chunk), its
// lanes along the last dimension (one group along it: the kernel strides its loops by the group's width).
// Rows of one kv head's queries, and the work-groups' blocks of rows_per_item of them.
inline int64_t fused_rows(const FusedParams& p) { return p.query.heads / p.keys.heads * p.query.rows; }
inline int64_t fused_blocks(const FusedParams& p) {
  const int rpi = rows_per_item(fused_rows(p));
  return (fused_rows(p) + rpi - 1) / rpi;
}

// Floats of the fused kernel's scratch: chunk_tokens per row of every work-group.
inline int64_t scratch_floats(const FusedParams& p) {
  return p.keys.batch * p.keys.heads * fused_blocks(p) * p.chunks * rows_per_item(fused_rows(p)) * p.chunk_tokens;
}

inline void launch_packed_attention(DeviceRuntime& rt, const FusedParams& p) {
  const PackedParams& k = p.keys;
  const PackedParams& v = p.values;
  const int64_t rows = fused_rows(p), blocks = fused_blocks(p);
  const int rpi = rows_per_item(rows);
  if (k.batch * k.heads == 0 || rows == 0 || p.chunks == 0) return;
  const Kernel& kernel = rt.kernel(kPackedAttention, {k.meta, bits_position(k.bits), bits_position(v.bits), rpi - 1});
  const at::Tensor scratch = at::empty({scratch_floats(p)}, p.scratch_on);
  const size_t local = kernel.max_local;
  launch(rt, kPackedAttention, kernel,
         sycl::nd_range<3>({size_t(k.batch * k.heads), size_t(blocks * p.chunks), local}, {1, 1, local}),
         p.query.data, k.codes, k.scales, k.zeros, v.codes, v.scales, v.zeros, p.bias, p.chunk_max, p.chunk_sum,
         p.chunk_acc, scratch.data_ptr<float>(), size_t(rows), size_t(p.query.rows), size_t(p.query.heads / k.heads),
         size_t(k.heads), size_t(k.num_tokens), size_t(k.head_dim), size_t(v.head_dim), size_t(k.code_capacity),
         size_t(k.meta_capacity), size_t(v.code_capacity), size_t(v.meta_capacity), size_t(k.group_size),
         size_t(v.group_size), size_t(p.chunk_tokens), size_t(p.chunks), size_t(p.bias_b), size_t(p.bias_h),
         size_t(p.bias_l), int(p.bias_fills), p.softcap);
}

// Paged decode attention: one work-group per (request x kv head, block of query rows x chunk), as the fused kernel.
inline int64_t paged_rows(const PagedParams& p) { return p.q_heads / p.kv_heads; }
inline int64_t paged_scratch_floats(const PagedParams& p) {
  const int rpi = rows_per_item(paged_rows(p));
  const int64_t blocks = (paged_rows(p) + rpi - 1) / rpi;
  return p.requests_n * p.kv_heads * blocks * p.chunks * rpi * p.chunk_tokens;
}

inline void launch_paged_attention(DeviceRuntime& rt, const PagedParams& p) {
  const int64_t rows = paged_rows(p);
  const int rpi = rows_per_item(rows);
  const int64_t blocks = (rows + rpi - 1) / rpi;
  if (p.requests_n * p.kv_heads == 0 || p.chunks == 0) return;
  const Kernel& kernel =
      rt.kernel(kPagedAttention, {p.meta, p.window, bits_position(p.key_bits), bits_position(p.value_bits), rpi - 1});
  const at::Tensor scratch = at::empty({paged_scratch_floats(p)}, p.scratch_on);
  const size_t local = kernel.max_local;
  launch(rt, kPagedAttention, kernel,
         sycl::nd_range<3>({size_t(p.requests_n * p.kv_heads), size_t(blocks * p.chunks), local}, {1, 1, local}),
         p.query, p.plain_query, p.key_codes, p.key_scales, p.key_zeros, p.value_codes, p.value_scales,
         p.value_zeros, p.key_windows, p.value_windows, p.block_table, p.requests, p.chunk_max, p.chunk_sum,
         p.chunk_acc, p.chunk_exact_acc, scratch.data_ptr<float>(), size_t(rows), size_t(p.kv_heads),
         size_t(p.head_dim), size_t(p.value_dim), size_t(p.tokens), size_t(p.key_group), size_t(p.value_group), size_t(p.key_code_block),
         size_t(p.key_meta_block), size_t(p.value_code_block), size_t(p.value_meta_block), size_t(p.key_window_slot),
         size_t(p.key_window_head), size_t(p.value_window_slot), size_t(p.value_window_head), size_t(p.table_cols),
         size_t(p.chunk_tokens), size_t(p.chunks));
}

}  // namespace kivi
