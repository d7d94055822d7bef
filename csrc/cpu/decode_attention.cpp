// Fused decode attention over a KIVI layer: [sinks | packed history | exact tail] in one pass (flash-decoding).
// This file checks the arguments, describes them as a decode::Problem (raw pointers and strides, no copies of the
// cache), runs the ISA's chunk kernel over (batch, kv head, chunk) tasks in torch's intra-op pool and merges the
// chunks' partial softmaxes in order (deterministic). Semantics: kivi_xpu/ops/reference.py (decode_attention).
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

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

Dtype float_dtype(const at::Tensor& t, const char* name) {
  Dtype dtype;
  TORCH_CHECK(kernel_dtype(t.scalar_type(), &dtype), "decode_attention: `", name,
              "` must be float32, float16 or bfloat16, got ", t.dtype());
  return dtype;
}

void check_cpu_rank4(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "decode_attention: `", name, "` must be on the CPU, got ", t.device());
  TORCH_CHECK(t.dim() == 4, "decode_attention: `", name, "` must have rank 4, got shape ", t.sizes());
}

// An exact [B, H, T, width] tensor: the model dtype, any strides except a unit last one.
Exact exact(const at::Tensor& t, const char* name, int64_t batch, int64_t heads, int64_t width) {
  check_cpu_rank4(t, name);
  const Dtype dtype = float_dtype(t, name);
  TORCH_CHECK(t.size(0) == batch && t.size(1) == heads && t.size(3) == width, "decode_attention: `", name,
              "` must have shape [", batch, ", ", heads, ", tokens, ", width, "], got ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1, "decode_attention: `", name,
              "` must have a unit stride along its last dim (a narrow view is fine), got strides ", t.strides());
  return Exact{t.data_ptr(), dtype, t.size(2), t.stride(0), t.stride(1), t.stride(2)};
}

Exact optional_exact(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& like, int64_t width) {
  if (t.has_value()) return exact(*t, name, like.size(0), like.size(1), width);
  return Exact{nullptr, kF32, 0, 0, 0, 0};
}

int64_t codes_per_byte(int64_t bits, const char* name) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "decode_attention: `", name, "` must be 2, 4 or 8, got ", bits);
  return 8 / bits;
}

void check_packed_tensors(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                          const char* prefix) {
  const std::string c = std::string(prefix) + "_codes", s = std::string(prefix) + "_scales",
                    z = std::string(prefix) + "_zeros";
  check_cpu_rank4(codes, c.c_str());
  check_cpu_rank4(scales, s.c_str());
  check_cpu_rank4(zeros, z.c_str());
  TORCH_CHECK(codes.scalar_type() == at::kByte, "decode_attention: `", c, "` must be uint8, got ", codes.dtype());
  float_dtype(scales, s.c_str());
  TORCH_CHECK(scales.scalar_type() == zeros.scalar_type(), "decode_attention: `", s, "` and `", z,
              "` must share a dtype, got ", scales.dtype(), " and ", zeros.dtype());
  TORCH_CHECK(scales.sizes() == zeros.sizes(), "decode_attention: `", s, "` and `", z,
              "` must have the same shape, got ", scales.sizes(), " and ", zeros.sizes());
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(), "decode_attention: `", c,
              "`, `", s, "` and `", z, "` must be contiguous (packed storage is dense)");
}

// Keys: codes [B, H, D, >= count/P] packed along tokens, scales/zeros [B, H, D, >= count/G].
Packed packed_keys(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t count,
                   int64_t group, int64_t bits, int64_t batch, int64_t heads, int64_t head_dim) {
  check_packed_tensors(codes, scales, zeros, "key");
  const int64_t per = codes_per_byte(bits, "key_bits");
  TORCH_CHECK(group > 0 && group % per == 0, "decode_attention: `key_group` must be a positive multiple of ", per,
              " for ", bits, "-bit codes, got ", group);
  TORCH_CHECK(count >= 0 && count % group == 0, "decode_attention: `key_count` must be a non-negative multiple of ",
              "`key_group` (", group, "), got ", count);
  TORCH_CHECK(codes.size(0) == batch && codes.size(1) == heads && codes.size(2) == head_dim,
              "decode_attention: `key_codes` must have shape [", batch, ", ", heads, ", ", head_dim,
              ", tokens/", per, "], got ", codes.sizes());
  TORCH_CHECK(scales.size(0) == batch && scales.size(1) == heads && scales.size(2) == head_dim,
              "decode_attention: `key_scales` must have shape [", batch, ", ", heads, ", ", head_dim,
              ", tokens/group], got ", scales.sizes());
  TORCH_CHECK(codes.size(3) * per >= count && scales.size(3) * group >= count, "decode_attention: `key_count` (",
              count, ") exceeds the stored keys: codes hold ", codes.size(3) * per, ", scales hold ",
              scales.size(3) * group);
  return Packed{codes.data_ptr<uint8_t>(), scales.data_ptr(), zeros.data_ptr(), float_dtype(scales, "key_scales"),
                count, group, bits, codes.size(3), scales.size(3), codes.size(2) * codes.size(3),
                scales.size(2) * scales.size(3)};
}

// Values: codes [B, H, >= count, Dv/P] packed along channels, scales/zeros [B, H, >= count, Dv/G].
Packed packed_values(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t count,
                     int64_t group, int64_t bits, int64_t batch, int64_t heads) {
  check_packed_tensors(codes, scales, zeros, "value");
  const int64_t per = codes_per_byte(bits, "value_bits");
  const int64_t value_dim = codes.size(3) * per;
  TORCH_CHECK(group > 0 && group % per == 0 && value_dim % group == 0, "decode_attention: `value_group` must be a ",
              "positive multiple of ", per, " dividing the value head_dim ", value_dim, ", got ", group);
  TORCH_CHECK(codes.size(0) == batch && codes.size(1) == heads, "decode_attention: `value_codes` must have shape [",
              batch, ", ", heads, ", tokens, head_dim/", per, "], got ", codes.sizes());
  TORCH_CHECK(scales.size(0) == batch && scales.size(1) == heads && scales.size(3) == value_dim / group,
              "decode_attention: `value_scales` must have shape [", batch, ", ", heads, ", tokens, ",
              value_dim / group, "], got ", scales.sizes());
  TORCH_CHECK(count >= 0 && codes.size(2) >= count && scales.size(2) >= count, "decode_attention: `value_count` (",
              count, ") must be >= 0 and within the stored values: codes hold ", codes.size(2), ", scales hold ",
              scales.size(2));
  return Packed{codes.data_ptr<uint8_t>(), scales.data_ptr(), zeros.data_ptr(), float_dtype(scales, "value_scales"),
                count, group, bits, codes.size(3), scales.size(3), codes.size(2) * codes.size(3),
                scales.size(2) * scales.size(3)};
}

// A rotation Q [dim, dim]: a contiguous float32 CPU tensor (nullptr for none).
const float* rotation(const c10::optional<at::Tensor>& arg, const char* name, int64_t dim) {
  if (!arg.has_value()) return nullptr;
  const at::Tensor& q = *arg;
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 2 && q.size(0) == dim &&
                  q.size(1) == dim && q.is_contiguous(),
              "decode_attention: `", name, "` must be a contiguous float32 [", dim, ", ", dim, "] CPU tensor, got ",
              q.dtype(), " ", q.sizes(), " on ", q.device());
  return q.data_ptr<float>();
}

void describe_mask(const c10::optional<at::Tensor>& mask_arg, Problem& p, at::Tensor& keep, int64_t q_heads) {
  p.mask_kind = decode::kMaskNone;
  p.mask = nullptr;
  p.mask_sb = p.mask_sh = p.mask_sl = p.mask_sc = p.mask_col0 = 0;
  if (!mask_arg.has_value()) {
    TORCH_CHECK(p.length == 1 || p.n >= p.length, "decode_attention: without a mask, ", p.length,
                " queries are the last positions and need n >= ", p.length, " tokens, got n = ", p.n);
    return;
  }
  const at::Tensor& mask = *mask_arg;
  check_cpu_rank4(mask, "mask");
  TORCH_CHECK((mask.size(0) == 1 || mask.size(0) == p.batch) && (mask.size(1) == 1 || mask.size(1) == q_heads) &&
                  mask.size(2) == p.length && mask.size(3) >= p.n,
              "decode_attention: `mask` must have shape [1 or ", p.batch, ", 1 or ", q_heads, ", ", p.length,
              ", >= ", p.n, "], got ", mask.sizes());
  if (mask.scalar_type() == at::kBool) {
    keep = mask;
    p.mask_kind = decode::kMaskBool;
  } else {
    float_dtype(mask, "mask");
    keep = mask.to(at::kFloat);
    p.mask_kind = decode::kMaskFloat;
  }
  p.mask = keep.data_ptr();
  p.mask_sb = keep.size(0) == 1 ? 0 : keep.stride(0);
  p.mask_sh = keep.size(1) == 1 ? 0 : keep.stride(1);
  p.mask_sl = keep.stride(2);
  p.mask_sc = keep.stride(3);
  p.mask_col0 = keep.size(3) - p.n;  // the last n columns are this layer's positions
}

at::Tensor decode_attention(const at::Tensor& query, const c10::optional<at::Tensor>& key_sinks,
                            const at::Tensor& key_codes, const at::Tensor& key_scales, const at::Tensor& key_zeros,
                            int64_t key_count, int64_t key_group, int64_t key_bits, const at::Tensor& key_tail,
                            const c10::optional<at::Tensor>& value_sinks, const at::Tensor& value_codes,
                            const at::Tensor& value_scales, const at::Tensor& value_zeros, int64_t value_count,
                            int64_t value_group, int64_t value_bits, const at::Tensor& value_tail,
                            const c10::optional<at::Tensor>& mask, double scaling,
                            const c10::optional<double>& softcap, const c10::optional<at::Tensor>& key_rotation,
                            const c10::optional<at::Tensor>& value_rotation) {
  check_cpu_rank4(query, "query");
  float_dtype(query, "query");
  check_cpu_rank4(key_tail, "key_tail");
  const int64_t batch = query.size(0), q_heads = query.size(1), length = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = key_tail.size(1);
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "decode_attention: the query heads (", q_heads,
              ") must be a multiple of the kv heads of `key_tail` (", kv_heads, ")");
  TORCH_CHECK(length > 0 && head_dim > 0 && head_dim <= decode::kMaxDim, "decode_attention: `query` must have ",
              "L > 0 and 0 < head_dim <= ", decode::kMaxDim, ", got shape ", query.sizes());
  TORCH_CHECK(std::isfinite(scaling), "decode_attention: `scaling` must be finite, got ", scaling);
  const double cap = softcap.has_value() ? *softcap : 0.0;
  TORCH_CHECK(std::isfinite(cap), "decode_attention: `softcap` must be finite (0 or None: none), got ", cap);

  Problem p{};
  p.batch = batch;
  p.kv_heads = kv_heads;
  p.q_per_kv = q_heads / kv_heads;
  p.length = length;
  p.rows = p.q_per_kv * length;
  p.head_dim = head_dim;
  p.keys = packed_keys(key_codes, key_scales, key_zeros, key_count, key_group, key_bits, batch, kv_heads, head_dim);
  p.values = packed_values(value_codes, value_scales, value_zeros, value_count, value_group, value_bits, batch,
                           kv_heads);
  p.value_dim = value_codes.size(3) * (8 / value_bits);
  TORCH_CHECK(p.value_dim <= decode::kMaxDim, "decode_attention: the value head_dim must be <= ", decode::kMaxDim,
              ", got ", p.value_dim);
  p.key_tail = exact(key_tail, "key_tail", batch, kv_heads, head_dim);
  p.value_tail = exact(value_tail, "value_tail", batch, kv_heads, p.value_dim);
  p.key_sinks = optional_exact(key_sinks, "key_sinks", key_tail, head_dim);
  p.value_sinks = optional_exact(value_sinks, "value_sinks", key_tail, p.value_dim);
  TORCH_CHECK(p.key_sinks.tokens == p.value_sinks.tokens, "decode_attention: `key_sinks` holds ", p.key_sinks.tokens,
              " tokens but `value_sinks` holds ", p.value_sinks.tokens);
  p.sinks = p.key_sinks.tokens;
  p.n = p.sinks + key_count + p.key_tail.tokens;
  TORCH_CHECK(p.sinks + value_count + p.value_tail.tokens == p.n, "decode_attention: keys cover ", p.n,
              " positions (sinks ", p.sinks, " + key_count ", key_count, " + key_tail ", p.key_tail.tokens,
              ") but values cover ", p.sinks + value_count + p.value_tail.tokens, " (sinks ", p.sinks,
              " + value_count ", value_count, " + value_tail ", p.value_tail.tokens, ")");
  TORCH_CHECK(p.n > 0, "decode_attention: the layer holds no token to attend to");
  p.softcap = (float)cap;
  p.integer = current_dot() == Dot::kInt8;

  at::Tensor mask_keep;
  describe_mask(mask, p, mask_keep, q_heads);

  p.chunk = decode::chunk_tokens(p.n - p.sinks, key_group, batch * kv_heads);
  p.chunks = std::max<int64_t>(1, (p.n - p.sinks + p.chunk - 1) / p.chunk);

  const float* key_q = rotation(key_rotation, "key_rotation", head_dim);
  const float* value_q = rotation(value_rotation, "value_rotation", p.value_dim);
  if (value_q != nullptr) value_q = decode::transposed(value_q, p.value_dim);  // (packed sum) Qᵀ: rows times Qᵀ
  p.packed_acc = value_q != nullptr ? (p.value_dim + 15) / 16 * 16 : 0;
  p.acc_width = p.packed_acc + p.value_dim;
  p.acc_row = (decode::kAccOffset + p.acc_width + 15) / 16 * 16;
  p.score_row = decode::task_score_row(p.sinks, p.chunk);
  // One allocation for the query rows, the partials [B, Hkv, chunks, rows, acc_row] and, with rotated values, the
  // packed sum [B, Hkv, rows, Dv] (each part 64-byte aligned).
  const int64_t out_floats = batch * kv_heads * p.rows * p.value_dim;
  const int64_t partial_floats = batch * kv_heads * p.chunks * p.rows * p.acc_row;
  const int64_t packed_floats = value_q != nullptr ? (out_floats + 15) / 16 * 16 : 0;
  const decode::QueryRows q = decode::query_rows(query, scaling, key_q, partial_floats + packed_floats);
  p.query = q.scaled;
  p.packed_query = q.rotated;
  p.partials = q.workspace;
  float* packed_sum = p.partials + partial_floats;

  const int64_t first_task[2] = {0, batch * kv_heads * p.chunks};
  decode::run_problems(&p, first_task, 1);

  // [B, Hq, L, Dv] is [B, Hkv, rows, Dv] in memory (row r of kv head h: query head h * q_per_kv + r / L, position
  // r % L). Allocated in its final shape, and returned as is for a float32 query: a view and a same-dtype `to` are two
  // dispatcher calls, 2.6 us per call in the model (batch 4 / 8064, Zen 4), where their code comes cold.
  at::Tensor out = at::empty({batch, q_heads, length, p.value_dim}, query.options().dtype(at::kFloat));
  if (value_q == nullptr) {
    decode::merge_chunks(p, out.data_ptr<float>(), nullptr);
  } else {  // exact sum + (packed sum) Qᵀ
    std::fill(packed_sum, packed_sum + out_floats, 0.0f);
    decode::merge_chunks(p, out.data_ptr<float>(), packed_sum);
    decode::rows_times(packed_sum, value_q, out_floats / p.value_dim, p.value_dim, out.data_ptr<float>(), true);
  }
  return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

// Time-stamp-counter ticks per second, measured once against the steady clock (the TSC of the CPUs this runs on is
// invariant: constant_tsc / nonstop_tsc).
double tick_rate() {
  static const double rate = [] {
    const auto t0 = std::chrono::steady_clock::now();
    const unsigned long long c0 = __builtin_ia32_rdtsc();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(20)) {
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return double(__builtin_ia32_rdtsc() - c0) / seconds;
  }();
  return rate;
}

// The phases' thread seconds since the last reset (decode_attention.h: Phase), by name.
pybind11::dict phase_seconds(bool reset) {
  pybind11::dict out;
  const double rate = tick_rate();
  for (int i = 0; i < decode::kPhaseCount; ++i) {
    out[decode::kPhaseNames[i]] = double(decode::phase_ticks[i]) / rate;
    if (reset) decode::phase_ticks[i] = 0;
  }
  return out;
}

}  // namespace

void register_decode_attention(pybind11::module& m) {
  m.def(
      "set_phase_timing", [](bool on) { decode::phase_timing = on; },
      "Turns the phase timers of the fused decode attention on or off (off by default)", pybind11::arg("on"));
  m.def("phase_seconds", &phase_seconds,
        "Thread seconds per phase of the fused decode attention (summed over threads) since the last reset, by "
        "name; `reset` zeroes them (see csrc/cpu/decode_attention.h: Phase)",
        pybind11::arg("reset") = true);
  m.def("decode_attention", &decode_attention,
        "Fused KIVI decode attention over [sinks | packed history | exact tail] -> [B, Hq, L, Dv] (see "
        "kivi_xpu/ops/reference.py (decode_attention) for the exact semantics)",
        pybind11::arg("query"), pybind11::arg("key_sinks"), pybind11::arg("key_codes"), pybind11::arg("key_scales"),
        pybind11::arg("key_zeros"), pybind11::arg("key_count"), pybind11::arg("key_group"), pybind11::arg("key_bits"),
        pybind11::arg("key_tail"), pybind11::arg("value_sinks"), pybind11::arg("value_codes"),
        pybind11::arg("value_scales"), pybind11::arg("value_zeros"), pybind11::arg("value_count"),
        pybind11::arg("value_group"), pybind11::arg("value_bits"), pybind11::arg("value_tail"),
        pybind11::arg("mask"), pybind11::arg("scaling"), pybind11::arg("softcap"),
        pybind11::arg("key_rotation") = pybind11::none(), pybind11::arg("value_rotation") = pybind11::none());
}


}  // namespace kivi::cpu
