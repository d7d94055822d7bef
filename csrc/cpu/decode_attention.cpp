// Fused decode attention over a KIVI layer: [sinks | packed history | exact tail] in one pass (flash-decoding).
// This file checks the arguments and describes them as one decode::Problem (raw pointers and strides, no copies of
// the cache); decode_problem.h's solve() runs the ISA's chunk kernel over its (batch, kv head, chunk) tasks in torch's
// intra-op pool and merges the chunks' partial softmaxes in order (deterministic). Also the phase timers' Python
// side. Semantics: kivi_xpu/ops/reference.py (decode_attention).
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <string>

#include "decode_problem.h"
#include "kernels.h"

namespace kivi::cpu {
namespace {

using decode::Exact;
using decode::Packed;
using decode::Problem;

constexpr const char* kOp = "decode_attention";

// An exact [B, H, T, width] tensor: the model dtype, any strides except a unit last one.
Exact exact(const at::Tensor& t, const char* name, int64_t batch, int64_t heads, int64_t width) {
  decode::check_cpu(kOp, t, name, 4);
  const Dtype dtype = decode::float_dtype(kOp, t, name);
  TORCH_CHECK_VALUE(t.size(0) == batch && t.size(1) == heads && t.size(3) == width, kOp, ": `", name,
                    "` must have shape [", batch, ", ", heads, ", tokens, ", width, "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(3) == 1 || t.size(3) <= 1, kOp, ": `", name,
                    "` must have a unit stride along its last dim (a narrow view is fine), got strides ", t.strides());
  return Exact{t.data_ptr(), dtype, t.size(2), t.stride(0), t.stride(1), t.stride(2)};
}

Exact optional_exact(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& like, int64_t width) {
  if (t.has_value()) return exact(*t, name, like.size(0), like.size(1), width);
  return Exact{nullptr, kF32, 0, 0, 0, 0};
}

// Codes, scales and zeros of one kind (`prefix`: key or value): rank-4 CPU tensors, uint8 codes, float metadata of one
// dtype and shape, all contiguous. Returns the metadata's Dtype.
Dtype check_packed_tensors(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                           const char* prefix) {
  const std::string c = std::string(prefix) + "_codes", s = std::string(prefix) + "_scales",
                    z = std::string(prefix) + "_zeros";
  decode::check_cpu(kOp, codes, c.c_str(), 4);
  decode::check_cpu(kOp, scales, s.c_str(), 4);
  decode::check_cpu(kOp, zeros, z.c_str(), 4);
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, kOp, ": `", c, "` must be uint8, got ", codes.dtype());
  const Dtype meta = decode::float_dtype(kOp, scales, s.c_str());
  TORCH_CHECK_VALUE(scales.scalar_type() == zeros.scalar_type(), kOp, ": `", s, "` and `", z,
                    "` must share a dtype, got ", scales.dtype(), " and ", zeros.dtype());
  TORCH_CHECK_VALUE(scales.sizes() == zeros.sizes(), kOp, ": `", s, "` and `", z, "` must have the same shape, got ",
                    scales.sizes(), " and ", zeros.sizes());
  TORCH_CHECK_VALUE(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(), kOp, ": `", c, "`, `",
                    s, "` and `", z, "` must be contiguous (packed storage is dense)");
  return meta;
}

// Contiguous packed storage: rows `codes.size(3)` bytes / `scales.size(3)` elements apart, one (batch, head) after
// the other.
Packed packed(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, Dtype meta, int64_t count,
              int64_t group, int64_t bits) {
  return Packed{codes.data_ptr<uint8_t>(), scales.data_ptr(), zeros.data_ptr(), meta, count, group, bits,
                codes.size(3), scales.size(3), codes.size(2) * codes.size(3), scales.size(2) * scales.size(3)};
}

// Keys: codes [B, H, D, >= count/P] packed along tokens, scales/zeros [B, H, D, >= count/G].
Packed packed_keys(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t count,
                   int64_t group, int64_t bits, int64_t batch, int64_t heads, int64_t head_dim) {
  const Dtype meta = check_packed_tensors(codes, scales, zeros, "key");
  const int64_t per = decode::codes_per_byte(kOp, bits, "key_bits");
  TORCH_CHECK_VALUE(group > 0 && group % per == 0, kOp, ": `key_group` must be a positive multiple of ", per, " for ",
                    bits, "-bit codes, got ", group);
  TORCH_CHECK_VALUE(count >= 0 && count % group == 0, kOp, ": `key_count` must be a non-negative multiple of ",
                    "`key_group` (", group, "), got ", count);
  TORCH_CHECK_VALUE(codes.size(0) == batch && codes.size(1) == heads && codes.size(2) == head_dim, kOp,
                    ": `key_codes` must have shape [", batch, ", ", heads, ", ", head_dim, ", tokens/", per,
                    "], got ", codes.sizes());
  TORCH_CHECK_VALUE(scales.size(0) == batch && scales.size(1) == heads && scales.size(2) == head_dim, kOp,
                    ": `key_scales` must have shape [", batch, ", ", heads, ", ", head_dim, ", tokens/group], got ",
                    scales.sizes());
  TORCH_CHECK_VALUE(codes.size(3) * per >= count && scales.size(3) * group >= count, kOp, ": `key_count` (", count,
                    ") exceeds the stored keys: codes hold ", codes.size(3) * per, ", scales hold ",
                    scales.size(3) * group);
  return packed(codes, scales, zeros, meta, count, group, bits);
}

// Values: codes [B, H, >= count, Dv/P] packed along channels, scales/zeros [B, H, >= count, Dv/G].
Packed packed_values(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t count,
                     int64_t group, int64_t bits, int64_t batch, int64_t heads) {
  const Dtype meta = check_packed_tensors(codes, scales, zeros, "value");
  const int64_t per = decode::codes_per_byte(kOp, bits, "value_bits");
  const int64_t value_dim = codes.size(3) * per;
  TORCH_CHECK_VALUE(group > 0 && group % per == 0 && value_dim % group == 0, kOp, ": `value_group` must be a ",
                    "positive multiple of ", per, " dividing the value head_dim ", value_dim, ", got ", group);
  TORCH_CHECK_VALUE(codes.size(0) == batch && codes.size(1) == heads, kOp, ": `value_codes` must have shape [", batch,
                    ", ", heads, ", tokens, head_dim/", per, "], got ", codes.sizes());
  TORCH_CHECK_VALUE(scales.size(0) == batch && scales.size(1) == heads && scales.size(3) == value_dim / group, kOp,
                    ": `value_scales` must have shape [", batch, ", ", heads, ", tokens, ", value_dim / group,
                    "], got ", scales.sizes());
  TORCH_CHECK_VALUE(count >= 0 && codes.size(2) >= count && scales.size(2) >= count, kOp, ": `value_count` (", count,
                    ") must be >= 0 and within the stored values: codes hold ", codes.size(2), ", scales hold ",
                    scales.size(2));
  return packed(codes, scales, zeros, meta, count, group, bits);
}

// The mask's strides into `p` (0 where broadcast); a float mask of another dtype is converted into `keep`.
void describe_mask(const c10::optional<at::Tensor>& mask_arg, Problem& p, at::Tensor& keep, int64_t q_heads) {
  if (!mask_arg.has_value()) {
    TORCH_CHECK_VALUE(p.length == 1 || p.n >= p.length, kOp, ": without a mask, ", p.length,
                      " queries are the last positions and need n >= ", p.length, " tokens, got n = ", p.n);
    return;
  }
  const at::Tensor& mask = *mask_arg;
  decode::check_cpu(kOp, mask, "mask", 4);
  TORCH_CHECK_VALUE((mask.size(0) == 1 || mask.size(0) == p.batch) && (mask.size(1) == 1 || mask.size(1) == q_heads) &&
                        mask.size(2) == p.length && mask.size(3) >= p.n,
                    kOp, ": `mask` must have shape [1 or ", p.batch, ", 1 or ", q_heads, ", ", p.length, ", >= ", p.n,
                    "], got ", mask.sizes());
  if (mask.scalar_type() == at::kBool) {
    keep = mask;
    p.mask_kind = decode::kMaskBool;
  } else {
    decode::float_dtype(kOp, mask, "mask");
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
  decode::check_cpu(kOp, query, "query", 4);
  decode::float_dtype(kOp, query, "query");
  decode::check_cpu(kOp, key_tail, "key_tail", 4);
  const int64_t batch = query.size(0), q_heads = query.size(1), length = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = key_tail.size(1);
  TORCH_CHECK_VALUE(kv_heads > 0 && q_heads % kv_heads == 0, kOp, ": the query heads (", q_heads,
                    ") must be a multiple of the kv heads of `key_tail` (", kv_heads, ")");
  TORCH_CHECK_VALUE(length > 0 && head_dim > 0 && head_dim <= decode::kMaxDim, kOp, ": `query` must have ",
                    "L > 0 and 0 < head_dim <= ", decode::kMaxDim, ", got shape ", query.sizes());
  TORCH_CHECK_VALUE(std::isfinite(scaling), kOp, ": `scaling` must be finite, got ", scaling);
  const double cap = softcap.has_value() ? *softcap : 0.0;
  TORCH_CHECK_VALUE(std::isfinite(cap), kOp, ": `softcap` must be finite (0 or None: none), got ", cap);

  Problem p{};
  p.batch = batch;
  p.kv_heads = kv_heads;
  p.q_per_kv = q_heads / kv_heads;
  p.length = length;
  p.head_dim = head_dim;
  p.keys = packed_keys(key_codes, key_scales, key_zeros, key_count, key_group, key_bits, batch, kv_heads, head_dim);
  p.values = packed_values(value_codes, value_scales, value_zeros, value_count, value_group, value_bits, batch,
                           kv_heads);
  p.value_dim = value_codes.size(3) * (8 / value_bits);
  TORCH_CHECK_VALUE(p.value_dim <= decode::kMaxDim, kOp, ": the value head_dim must be <= ", decode::kMaxDim,
                    ", got ", p.value_dim);
  p.key_tail = exact(key_tail, "key_tail", batch, kv_heads, head_dim);
  p.value_tail = exact(value_tail, "value_tail", batch, kv_heads, p.value_dim);
  p.key_sinks = optional_exact(key_sinks, "key_sinks", key_tail, head_dim);
  p.value_sinks = optional_exact(value_sinks, "value_sinks", key_tail, p.value_dim);
  TORCH_CHECK_VALUE(p.key_sinks.tokens == p.value_sinks.tokens, kOp, ": `key_sinks` holds ", p.key_sinks.tokens,
                    " tokens but `value_sinks` holds ", p.value_sinks.tokens);
  decode::plan(p);
  TORCH_CHECK_VALUE(p.sinks + value_count + p.value_tail.tokens == p.n, kOp, ": keys cover ", p.n, " positions (sinks ",
                    p.sinks, " + key_count ", key_count, " + key_tail ", p.key_tail.tokens, ") but values cover ",
                    p.sinks + value_count + p.value_tail.tokens, " (sinks ", p.sinks, " + value_count ", value_count,
                    " + value_tail ", p.value_tail.tokens, ")");
  TORCH_CHECK_VALUE(p.n > 0, kOp, ": the layer holds no token to attend to");
  p.softcap = (float)cap;
  at::Tensor mask_keep;
  describe_mask(mask, p, mask_keep, q_heads);

  const float* key_q = decode::rotation(kOp, key_rotation, "key_rotation", head_dim);
  const float* value_q = decode::rotation(kOp, value_rotation, "value_rotation", p.value_dim);
  int64_t first_task[2];
  return decode::solve(&p, first_task, 1, query, scaling, key_q, value_q);
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
  using namespace pybind11::literals;
  m.def(
      "set_phase_timing", [](bool on) { decode::phase_timing = on; },
      "Turns the phase timers of the fused decode attention on or off (off by default)", "on"_a);
  m.def("phase_seconds", &phase_seconds,
        "Thread seconds per phase of the fused decode attention (summed over threads) since the last reset, by "
        "name; `reset` zeroes them (see csrc/cpu/decode_attention.h: Phase)",
        "reset"_a = true);
  m.def("decode_attention", &decode_attention,
        "Fused KIVI decode attention over [sinks | packed history | exact tail] -> [B, Hq, L, Dv] (see "
        "kivi_xpu/ops/reference.py (decode_attention) for the exact semantics)",
        "query"_a, "key_sinks"_a, "key_codes"_a, "key_scales"_a, "key_zeros"_a, "key_count"_a, "key_group"_a,
        "key_bits"_a, "key_tail"_a, "value_sinks"_a, "value_codes"_a, "value_scales"_a, "value_zeros"_a,
        "value_count"_a, "value_group"_a, "value_bits"_a, "value_tail"_a, "mask"_a, "scaling"_a, "softcap"_a,
        "key_rotation"_a = pybind11::none(), "value_rotation"_a = pybind11::none());
}

}  // namespace kivi::cpu
