// Fused decode attention of continuous batching over KIVI pages: one query row per request, each request's history
// [sinks | packed pages | exact tail] read in place — the sinks and the tail from its exact slot, the packed tokens
// from the pages its block table names. Each request is a decode::Problem of batch 1 whose Packed operands carry its
// page list; the chunk kernels, the task pool and the in-order merge are those of decode_attention.cpp, so a request
// gets exactly the result of decode_attention over the same tokens. Semantics: kivi_xpu/ops/reference.py
// (paged_decode_attention).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_attention.h"
#include "isa.h"
#include "kernels.h"
#include "query_rows.h"
#include "torch_dtype.h"

namespace kivi::cpu {
namespace {

using decode::Exact;
using decode::Packed;
using decode::Problem;

// Columns of the `requests` table (kivi_xpu/ops/checks.py: PAGED_REQUEST_COLUMNS).
enum Column : int { kSlot, kSinks, kKeyCount, kKeyTailRow, kValueCount, kValueTailRow, kLength, kColumns };

Dtype dtype_of(const at::Tensor& t, const char* name) {
  Dtype dtype;
  TORCH_CHECK_TYPE(kernel_dtype(t.scalar_type(), &dtype), "paged_decode_attention: `", name,
                   "` must be float32, float16 or bfloat16, got ", t.dtype());
  return dtype;
}

void check_cpu(const at::Tensor& t, const char* name, int64_t rank) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "paged_decode_attention: `", name, "` must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == rank, "paged_decode_attention: `", name, "` must have rank ", rank, ", got shape ",
                    t.sizes());
}

// A page section [blocks, H, a, b]: any block stride, each block's [H, a, b] contiguous.
void check_pages(const at::Tensor& t, const char* name, int64_t blocks, int64_t heads) {
  check_cpu(t, name, 4);
  TORCH_CHECK_VALUE(t.size(0) == blocks && t.size(1) == heads, "paged_decode_attention: `", name, "` must have shape [",
                    blocks, ", ", heads, ", ...], got ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) == t.size(2) * t.size(3),
                    "paged_decode_attention: `", name, "` must be contiguous within each block, got strides ",
                    t.strides());
}

const float* rotation_matrix(const c10::optional<at::Tensor>& arg, const char* name, int64_t dim) {
  if (!arg.has_value()) return nullptr;
  const at::Tensor& m = *arg;
  TORCH_CHECK_VALUE(m.device().is_cpu() && m.scalar_type() == at::kFloat && m.dim() == 2 && m.size(0) == dim &&
                        m.size(1) == dim && m.is_contiguous(),
                    "paged_decode_attention: `", name, "` must be a contiguous float32 [", dim, ", ", dim,
                    "] CPU tensor, got ", m.dtype(), " ", m.sizes());
  return m.data_ptr<float>();
}

// Rows [row, row + tokens) of one slot of a window [slots, H, W, width] as an Exact of batch 1.
Exact window_rows(const at::Tensor& window, Dtype dtype, int64_t slot, int64_t row, int64_t tokens) {
  const char* base = static_cast<const char*>(window.data_ptr());
  const int64_t offset = slot * window.stride(0) + row * window.stride(2);
  return Exact{base + offset * window.element_size(), dtype, tokens, 0, window.stride(1), window.stride(2)};
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_windows,
                                  const at::Tensor& value_windows, const at::Tensor& key_codes,
                                  const at::Tensor& key_scales, const at::Tensor& key_zeros,
                                  const at::Tensor& value_codes, const at::Tensor& value_scales,
                                  const at::Tensor& value_zeros, const at::Tensor& block_table,
                                  const at::Tensor& requests, int64_t key_bits, int64_t value_group, int64_t value_bits,
                                  double scaling, const c10::optional<at::Tensor>& key_rotation,
                                  const c10::optional<at::Tensor>& value_rotation) {
  // ---- the checks every pointer below relies on (the Python check says the same with more context) ----
  check_cpu(query, "query", 4);
  check_cpu(key_windows, "key_windows", 4);
  check_cpu(value_windows, "value_windows", 4);
  const Dtype window_dtype = dtype_of(key_windows, "key_windows");
  dtype_of(query, "query");
  TORCH_CHECK_VALUE(value_windows.scalar_type() == key_windows.scalar_type(),
                    "paged_decode_attention: `value_windows` must share the dtype of `key_windows`");
  const int64_t N = query.size(0), q_heads = query.size(1), D = query.size(3);
  const int64_t slots = key_windows.size(0), H = key_windows.size(1);
  TORCH_CHECK_VALUE(query.size(2) == 1,
                    "paged_decode_attention: one query row per request (`query` [N, Hq, 1, D]), got ",
                    query.sizes());
  TORCH_CHECK_VALUE(H > 0 && q_heads % H == 0 && D > 0 && D <= decode::kMaxDim && key_windows.size(3) == D,
                    "paged_decode_attention: `query` ", query.sizes(), " and `key_windows` ", key_windows.sizes(),
                    " must be [N, a multiple of H, 1, D] and [slots, H, rows, D] with 0 < D <= ", decode::kMaxDim);
  TORCH_CHECK_VALUE(key_bits == 2 || key_bits == 4 || key_bits == 8, "paged_decode_attention: `key_bits` must be 2, "
                    "4 or 8, got ", key_bits);
  TORCH_CHECK_VALUE(value_bits == 2 || value_bits == 4 || value_bits == 8, "paged_decode_attention: `value_bits` must "
                    "be 2, 4 or 8, got ", value_bits);
  const int64_t blocks = key_codes.size(0), T = key_codes.size(3) * (8 / key_bits);
  const int64_t Dv = value_codes.size(3) * (8 / value_bits);
  check_pages(key_codes, "key_codes", blocks, H);
  check_pages(key_scales, "key_scales", blocks, H);
  check_pages(key_zeros, "key_zeros", blocks, H);
  check_pages(value_codes, "value_codes", blocks, H);
  check_pages(value_scales, "value_scales", blocks, H);
  check_pages(value_zeros, "value_zeros", blocks, H);
  TORCH_CHECK_TYPE(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte,
                   "paged_decode_attention: `key_codes` and `value_codes` must be uint8");
  const Dtype key_meta = dtype_of(key_scales, "key_scales"), value_meta = dtype_of(value_scales, "value_scales");
  TORCH_CHECK_TYPE(key_zeros.scalar_type() == key_scales.scalar_type() &&
                       value_zeros.scalar_type() == value_scales.scalar_type(),
                   "paged_decode_attention: scales and zeros must share a dtype");
  TORCH_CHECK_VALUE(key_codes.size(2) == D && key_scales.size(2) == D && key_scales.size(3) == 1 &&
                        key_zeros.strides() == key_scales.strides() && key_zeros.sizes() == key_scales.sizes(),
                    "paged_decode_attention: key pages must be codes [blocks, H, ", D,
                    ", T/P] and scales/zeros [blocks, H, ",
                    D, ", 1] with equal strides, got ", key_codes.sizes(), " and ", key_scales.sizes());
  TORCH_CHECK_VALUE(value_group > 0 && Dv % value_group == 0 && Dv <= decode::kMaxDim &&
                        value_codes.size(2) == T && value_scales.size(2) == T &&
                        value_scales.size(3) == Dv / value_group && value_zeros.sizes() == value_scales.sizes() &&
                        value_zeros.strides() == value_scales.strides() && value_windows.size(3) == Dv &&
                        value_windows.size(0) == slots && value_windows.size(1) == H,
                    "paged_decode_attention: value pages must be codes [blocks, H, ", T, ", Dv/P] and scales/zeros "
                    "[blocks, H, ", T, ", Dv/value_group] (value_group ", value_group, "), `value_windows` [", slots,
                    ", ", H, ", rows, Dv], got ", value_codes.sizes(), ", ", value_scales.sizes(), ", ",
                    value_windows.sizes());
  TORCH_CHECK_VALUE(key_windows.stride(3) == 1 && value_windows.stride(3) == 1,
                    "paged_decode_attention: the windows must have a unit stride along head_dim");
  check_cpu(block_table, "block_table", 2);
  check_cpu(requests, "requests", 2);
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kLong && requests.scalar_type() == at::kLong,
                   "paged_decode_attention: `block_table` and `requests` must be int64");
  TORCH_CHECK_VALUE(block_table.size(0) == N && requests.size(0) == N && requests.size(1) == kColumns,
                    "paged_decode_attention: `block_table` must be [", N, ", pages] and `requests` [", N, ", ",
                    kColumns, "], got ", block_table.sizes(), " and ", requests.sizes());
  TORCH_CHECK_VALUE(std::isfinite(scaling), "paged_decode_attention: `scaling` must be finite, got ", scaling);
  const float* key_q = rotation_matrix(key_rotation, "key_rotation", D);
  const float* value_q = rotation_matrix(value_rotation, "value_rotation", Dv);

  const at::Tensor table = block_table.contiguous(), req = requests.contiguous();
  const int64_t* pages = table.data_ptr<int64_t>();
  const int64_t* rows_of = req.data_ptr<int64_t>();
  const int64_t max_pages = table.size(1), Wk = key_windows.size(2), Wv = value_windows.size(2);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t* r = rows_of + i * kColumns;
    const int64_t S = r[kSinks], kc = r[kKeyCount], vc = r[kValueCount], n = r[kLength];
    const int64_t key_tail = n - S - kc, value_tail = n - S - vc;
    TORCH_CHECK_VALUE(r[kSlot] >= 0 && r[kSlot] < slots && S >= 0 && S <= Wk && S <= Wv && kc >= 0 && kc % T == 0 &&
                          vc >= 0 && key_tail >= 0 && value_tail >= 0 && n > 0 && r[kKeyTailRow] >= 0 &&
                          r[kKeyTailRow] + key_tail <= Wk && r[kValueTailRow] >= 0 &&
                          r[kValueTailRow] + value_tail <= Wv && (kc + T - 1) / T <= max_pages &&
                          (vc + T - 1) / T <= max_pages,
                      "paged_decode_attention: request ", i, " (", req[i], ") does not fit its slot, pages or table");
    for (int64_t j = 0; j < (std::max(kc, vc) + T - 1) / T; ++j)
      TORCH_CHECK_VALUE(pages[i * max_pages + j] >= 0 && pages[i * max_pages + j] < blocks,
                        "paged_decode_attention: `block_table`[", i, ", ", j, "] = ", pages[i * max_pages + j],
                        " is not a block (0 <= block < ", blocks, ")");
  }
  if (N == 0) return at::empty({0, q_heads, 1, Dv}, query.options());

  // ---- one Problem of batch 1 per request ----
  const int64_t q_per_kv = q_heads / H;
  if (value_q != nullptr) value_q = decode::transposed(value_q, Dv);  // (packed sum) Qᵀ: rows times Qᵀ
  const int64_t packed_acc = value_q != nullptr ? (Dv + 15) / 16 * 16 : 0;
  const int64_t acc_width = packed_acc + Dv, acc_row = (decode::kAccOffset + acc_width + 15) / 16 * 16;

  std::vector<Problem> problems(N);
  std::vector<int64_t> first_task(N + 1, 0), partial_at(N);
  int64_t partial_floats = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t* r = rows_of + i * kColumns;
    Problem& p = problems[i];
    p.batch = 1;
    p.kv_heads = H;
    p.q_per_kv = q_per_kv;
    p.length = 1;
    p.rows = q_per_kv;
    p.head_dim = D;
    p.value_dim = Dv;
    p.sinks = r[kSinks];
    p.n = r[kLength];
    p.chunk = decode::chunk_tokens(p.n - p.sinks, T, H);  // decode_attention's over this request's tokens
    p.chunks = std::max<int64_t>(1, (p.n - p.sinks + p.chunk - 1) / p.chunk);
    p.mask_kind = decode::kMaskNone;
    p.softcap = 0.0f;
    p.integer = current_dot() == Dot::kInt8;
    p.score_row = decode::task_score_row(p.sinks, p.chunk);
    partial_at[i] = partial_floats;
    partial_floats += H * p.chunks * p.rows * acc_row;
    first_task[i + 1] = first_task[i] + H * p.chunks;
    const int64_t slot = r[kSlot], kc = r[kKeyCount], vc = r[kValueCount];
    p.key_sinks = window_rows(key_windows, window_dtype, slot, 0, p.sinks);
    p.value_sinks = window_rows(value_windows, window_dtype, slot, 0, p.sinks);
    p.key_tail = window_rows(key_windows, window_dtype, slot, r[kKeyTailRow], p.n - p.sinks - kc);
    p.value_tail = window_rows(value_windows, window_dtype, slot, r[kValueTailRow], p.n - p.sinks - vc);
    const int64_t* own_pages = pages + i * max_pages;
    p.keys = Packed{key_codes.data_ptr<uint8_t>(), key_scales.data_ptr(), key_zeros.data_ptr(), key_meta, kc, T,
                    key_bits, key_codes.size(3), 1, key_codes.stride(1), key_scales.stride(1), own_pages, T,
                    key_codes.stride(0), key_scales.stride(0)};
    p.values = Packed{value_codes.data_ptr<uint8_t>(), value_scales.data_ptr(), value_zeros.data_ptr(), value_meta,
                      vc, value_group, value_bits, value_codes.size(3), value_scales.size(3), value_codes.stride(1),
                      value_scales.stride(1), own_pages, T, value_codes.stride(0), value_scales.stride(0)};
    p.acc_row = acc_row;
    p.acc_width = acc_width;
    p.packed_acc = packed_acc;
  }
  // The query rows (packed keys hold k Q: scored with q Q), then in the same allocation the partials and, with rotated
  // values, the packed sums [N, Hq, Dv] (each part 64-byte aligned: partial_floats is a multiple of 16).
  const int64_t out_floats = N * q_heads * Dv, packed_floats = value_q != nullptr ? (out_floats + 15) / 16 * 16 : 0;
  const decode::QueryRows q = decode::query_rows(query, scaling, key_q, partial_floats + packed_floats);
  float* const partials = q.workspace;
  float* const packed_sum = partials + partial_floats;
  for (int64_t i = 0; i < N; ++i) {
    Problem& p = problems[i];
    p.query = q.scaled + i * q_heads * D;
    p.packed_query = q.rotated + i * q_heads * D;
    p.partials = partials + partial_at[i];
  }

  decode::run_problems(problems.data(), first_task.data(), N);

  at::Tensor out = at::empty({N, q_heads, 1, Dv}, query.options().dtype(at::kFloat));  // (see decode_attention)
  if (value_q != nullptr) std::fill(packed_sum, packed_sum + out_floats, 0.0f);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      decode::merge_chunks(problems[i], out.data_ptr<float>() + i * q_heads * Dv,
                           value_q != nullptr ? packed_sum + i * q_heads * Dv : nullptr);
  });
  if (value_q != nullptr)  // exact sum + (packed sum) Qᵀ
    decode::rows_times(packed_sum, value_q, N * q_heads, Dv, out.data_ptr<float>(), true);
  return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

}  // namespace

void register_paged_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Fused KIVI decode attention of continuous batching: one query row per request over its slot's sinks and "
        "tail and the pages of its block table -> [N, Hq, 1, Dv] (see kivi_xpu/ops/reference.py)",
        pybind11::arg("query"), pybind11::arg("key_windows"), pybind11::arg("value_windows"),
        pybind11::arg("key_codes"), pybind11::arg("key_scales"), pybind11::arg("key_zeros"),
        pybind11::arg("value_codes"), pybind11::arg("value_scales"), pybind11::arg("value_zeros"),
        pybind11::arg("block_table"), pybind11::arg("requests"), pybind11::arg("key_bits"),
        pybind11::arg("value_group"), pybind11::arg("value_bits"), pybind11::arg("scaling"),
        pybind11::arg("key_rotation") = pybind11::none(), pybind11::arg("value_rotation") = pybind11::none());
}

}  // namespace kivi::cpu
