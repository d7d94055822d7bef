// Fused decode attention of continuous batching over KIVI pages: one query row per request, each request's history
// [sinks | packed pages | exact tail] read in place — the sinks and the tail from its exact slot, the packed tokens
// from the pages its block table names. Each request is a decode::Problem of batch 1 whose Packed operands carry its
// page list; decode_problem.h plans and solves them as it does decode_attention's one problem (same chunks, kernels,
// task pool and in-order merge), so a request gets exactly the result of decode_attention over the same tokens.
// Semantics: kivi_xpu/ops/reference.py (paged_decode_attention).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_problem.h"
#include "kernels.h"
#include "paged_requests.h"

namespace kivi::cpu {
namespace {

using decode::Exact;
using decode::Packed;
using decode::Problem;
using namespace kivi::paged;  // the `requests` columns

constexpr const char* kOp = "paged_decode_attention";

// A page section [blocks, H, a, b]: any block stride, each block's [H, a, b] contiguous.
void check_pages(const at::Tensor& t, const char* name, int64_t blocks, int64_t heads) {
  decode::check_cpu(kOp, t, name, 4);
  TORCH_CHECK_VALUE(t.size(0) == blocks && t.size(1) == heads, kOp, ": `", name, "` must have shape [", blocks, ", ",
                    heads, ", ...], got ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) == t.size(2) * t.size(3), kOp, ": `",
                    name, "` must be contiguous within each block, got strides ", t.strides());
}

// Rows [row, row + tokens) of one slot of a window [slots, H, W, width] as an Exact of batch 1.
Exact window_rows(const at::Tensor& window, Dtype dtype, int64_t slot, int64_t row, int64_t tokens) {
  const char* base = static_cast<const char*>(window.data_ptr());
  const int64_t offset = slot * window.stride(0) + row * window.stride(2);
  return Exact{base + offset * window.element_size(), dtype, tokens, 0, window.stride(1), window.stride(2)};
}

// Page sections [blocks, H, rows, row] of one kind, read through the page list `pages` of `page_tokens` tokens.
Packed pages_of(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, Dtype meta, int64_t count,
                int64_t group, int64_t bits, int64_t meta_row, const int64_t* pages, int64_t page_tokens) {
  return Packed{codes.data_ptr<uint8_t>(), scales.data_ptr(), zeros.data_ptr(), meta, count, group, bits,
                codes.size(3), meta_row, codes.stride(1), scales.stride(1), pages, page_tokens, codes.stride(0),
                scales.stride(0)};
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
  decode::check_cpu(kOp, query, "query", 4);
  decode::check_cpu(kOp, key_windows, "key_windows", 4);
  decode::check_cpu(kOp, value_windows, "value_windows", 4);
  const Dtype window_dtype = decode::float_dtype(kOp, key_windows, "key_windows");
  decode::float_dtype(kOp, query, "query");
  TORCH_CHECK_VALUE(value_windows.scalar_type() == key_windows.scalar_type(), kOp,
                    ": `value_windows` must share the dtype of `key_windows`");
  const int64_t N = query.size(0), q_heads = query.size(1), D = query.size(3);
  const int64_t slots = key_windows.size(0), H = key_windows.size(1);
  TORCH_CHECK_VALUE(query.size(2) == 1, kOp, ": one query row per request (`query` [N, Hq, 1, D]), got ",
                    query.sizes());
  TORCH_CHECK_VALUE(H > 0 && q_heads % H == 0 && D > 0 && D <= decode::kMaxDim && key_windows.size(3) == D, kOp,
                    ": `query` ", query.sizes(), " and `key_windows` ", key_windows.sizes(),
                    " must be [N, a multiple of H, 1, D] and [slots, H, rows, D] with 0 < D <= ", decode::kMaxDim);
  const int64_t blocks = key_codes.size(0), T = key_codes.size(3) * decode::codes_per_byte(kOp, key_bits, "key_bits");
  const int64_t Dv = value_codes.size(3) * decode::codes_per_byte(kOp, value_bits, "value_bits");
  check_pages(key_codes, "key_codes", blocks, H);
  check_pages(key_scales, "key_scales", blocks, H);
  check_pages(key_zeros, "key_zeros", blocks, H);
  check_pages(value_codes, "value_codes", blocks, H);
  check_pages(value_scales, "value_scales", blocks, H);
  check_pages(value_zeros, "value_zeros", blocks, H);
  TORCH_CHECK_VALUE(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte, kOp,
                    ": `key_codes` and `value_codes` must be uint8");
  const Dtype key_meta = decode::float_dtype(kOp, key_scales, "key_scales");
  const Dtype value_meta = decode::float_dtype(kOp, value_scales, "value_scales");
  TORCH_CHECK_VALUE(key_zeros.scalar_type() == key_scales.scalar_type() &&
                        value_zeros.scalar_type() == value_scales.scalar_type(),
                    kOp, ": scales and zeros must share a dtype");
  const int64_t key_groups = key_scales.size(2);  // per page
  TORCH_CHECK_VALUE(key_codes.size(2) == D && key_scales.size(3) == D && key_groups > 0 && T % key_groups == 0 &&
                        (T / key_groups) % decode::codes_per_byte(kOp, key_bits, "key_bits") == 0 &&
                        key_zeros.strides() == key_scales.strides() && key_zeros.sizes() == key_scales.sizes(),
                    kOp, ": key pages must be codes [blocks, H, ", D, ", T/P] and scales/zeros [blocks, H, T/G, ", D,
                    "] (whole bytes of codes per key group) with equal strides, got ", key_codes.sizes(), " and ",
                    key_scales.sizes());
  TORCH_CHECK_VALUE(value_group > 0 && Dv % value_group == 0 && Dv <= decode::kMaxDim && value_codes.size(2) == T &&
                        value_scales.size(2) == T && value_scales.size(3) == Dv / value_group &&
                        value_zeros.sizes() == value_scales.sizes() && value_zeros.strides() == value_scales.strides() &&
                        value_windows.size(3) == Dv && value_windows.size(0) == slots && value_windows.size(1) == H,
                    kOp, ": value pages must be codes [blocks, H, ", T, ", Dv/P] and scales/zeros [blocks, H, ", T,
                    ", Dv/value_group] (value_group ", value_group, "), `value_windows` [", slots, ", ", H,
                    ", rows, Dv], got ", value_codes.sizes(), ", ", value_scales.sizes(), ", ", value_windows.sizes());
  TORCH_CHECK_VALUE(key_windows.stride(3) == 1 && value_windows.stride(3) == 1, kOp,
                    ": the windows must have a unit stride along head_dim");
  decode::check_cpu(kOp, block_table, "block_table", 2);
  decode::check_cpu(kOp, requests, "requests", 2);
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kLong && requests.scalar_type() == at::kLong, kOp,
                    ": `block_table` and `requests` must be int64");
  TORCH_CHECK_VALUE(block_table.size(0) == N && requests.size(0) == N && requests.size(1) == kRequestColumns, kOp,
                    ": `block_table` must be [", N, ", pages] and `requests` [", N, ", ", kRequestColumns, "], got ",
                    block_table.sizes(), " and ", requests.sizes());
  TORCH_CHECK_VALUE(std::isfinite(scaling), kOp, ": `scaling` must be finite, got ", scaling);
  const float* key_q = decode::rotation(kOp, key_rotation, "key_rotation", D);
  const float* value_q = decode::rotation(kOp, value_rotation, "value_rotation", Dv);

  const at::Tensor table = block_table.contiguous(), req = requests.contiguous();
  const int64_t* pages = table.data_ptr<int64_t>();
  const int64_t* rows_of = req.data_ptr<int64_t>();
  const int64_t max_pages = table.size(1), Wk = key_windows.size(2), Wv = value_windows.size(2);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t* r = rows_of + i * kRequestColumns;
    const int64_t S = r[kSinks], kc = r[kKeyCount], vc = r[kValueCount], n = r[kLength];
    const int64_t key_tail = n - S - kc, value_tail = n - S - vc;
    TORCH_CHECK_VALUE(r[kSlot] >= 0 && r[kSlot] < slots && S >= 0 && S <= Wk && S <= Wv && kc >= 0 && kc % T == 0 &&
                          vc >= 0 && key_tail >= 0 && value_tail >= 0 && n > 0 && r[kKeyTailRow] >= 0 &&
                          r[kKeyTailRow] + key_tail <= Wk && r[kValueTailRow] >= 0 &&
                          r[kValueTailRow] + value_tail <= Wv && (kc + T - 1) / T <= max_pages &&
                          (vc + T - 1) / T <= max_pages,
                      kOp, ": request ", i, " (", req[i], ") does not fit its slot, pages or table");
    for (int64_t j = 0; j < (std::max(kc, vc) + T - 1) / T; ++j)
      TORCH_CHECK_VALUE(pages[i * max_pages + j] >= 0 && pages[i * max_pages + j] < blocks, kOp, ": `block_table`[",
                        i, ", ", j, "] = ", pages[i * max_pages + j], " is not a block (0 <= block < ", blocks, ")");
  }
  if (N == 0) return at::empty({0, q_heads, 1, Dv}, query.options());

  // ---- one Problem of batch 1 per request: its slot's sinks and tails, its pages ----
  std::vector<Problem> problems(N);
  std::vector<int64_t> first_task(N + 1);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t* r = rows_of + i * kRequestColumns;
    const int64_t slot = r[kSlot], S = r[kSinks], kc = r[kKeyCount], vc = r[kValueCount], n = r[kLength];
    const int64_t* own_pages = pages + i * max_pages;
    Problem& p = problems[i];
    p.batch = 1;
    p.kv_heads = H;
    p.q_per_kv = q_heads / H;
    p.length = 1;
    p.head_dim = D;
    p.value_dim = Dv;
    p.key_sinks = window_rows(key_windows, window_dtype, slot, 0, S);
    p.value_sinks = window_rows(value_windows, window_dtype, slot, 0, S);
    p.key_tail = window_rows(key_windows, window_dtype, slot, r[kKeyTailRow], n - S - kc);
    p.value_tail = window_rows(value_windows, window_dtype, slot, r[kValueTailRow], n - S - vc);
    p.keys = pages_of(key_codes, key_scales, key_zeros, key_meta, kc, T / key_groups, key_bits, key_groups,
                      own_pages, T);
    p.values = pages_of(value_codes, value_scales, value_zeros, value_meta, vc, value_group, value_bits,
                        value_scales.size(3), own_pages, T);
    decode::plan(p);  // decode_attention's chunks over this request's tokens
  }
  return decode::solve(problems.data(), first_task.data(), N, query, scaling, key_q, value_q);
}

}  // namespace

void register_paged_attention(pybind11::module& m) {
  using namespace pybind11::literals;
  m.def("paged_decode_attention", &paged_decode_attention,
        "Fused KIVI decode attention of continuous batching: one query row per request over its slot's sinks and "
        "tail and the pages of its block table -> [N, Hq, 1, Dv] (see kivi_xpu/ops/reference.py)",
        "query"_a, "key_windows"_a, "value_windows"_a, "key_codes"_a, "key_scales"_a, "key_zeros"_a, "value_codes"_a,
        "value_scales"_a, "value_zeros"_a, "block_table"_a, "requests"_a, "key_bits"_a, "value_group"_a,
        "value_bits"_a, "scaling"_a, "key_rotation"_a = pybind11::none(), "value_rotation"_a = pybind11::none());
}

}  // namespace kivi::cpu
