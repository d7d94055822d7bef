// kivi_xpu._C: host side of the SYCL KIVI kernels (built by g++ as a torch CppExtension; the device code in
// csrc/kivi_kernels.cpp is compiled at run time by the sycl_ext_oneapi_kernel_compiler extension). Each op checks
// its arguments into one OpParams (kivi_params.h) and hands it to its launcher (kivi_launch.h); see csrc/README.md.
//
// API (all tensors contiguous; outputs preallocated by the caller; every launch waits for completion):
//   init(filter: str) -> dict
//       Selects the SYCL device matching a canonical filter "backend:device_type:index" (e.g. "opencl:cpu:0",
//       "level_zero:gpu:0"), creates an in-order queue and returns facts: filter, name, backend, device_type,
//       driver_version, max_work_group_size, max_compute_units, sub_group_sizes, usm_system_allocations, fp16, fp64,
//       build_options, variants (how many the table lists). No kernel compiles here: each variant compiles when a
//       launch first needs it (one line on stderr while a build runs > 1 s), once per device and process.
//   variant_names() -> list[str]; compile(filter, name) -> float (build seconds; compiles it now unless it is);
//   compiled(filter) -> {name: build seconds} of this process;
//   set_compile_hook(hook) -> None: hook(filter, names, seconds) runs after every build (kernel cache bookkeeping).
//   quantize_keys(device: str, x, codes, scales, zeros, group_size: int, bits: int) -> None
//       x [B,H,T,D] float32/float16/bfloat16 -> codes uint8 [B,H,D,T*bits/8], scales/zeros [B,H,D,T/G]
//       (keys are channel-major: byte j of channel d holds tokens P*j .. P*j+P-1, P = 8/bits)
//   quantize_values(device: str, x, codes, scales, zeros, group_size: int, bits: int) -> None
//       x [B,H,T,D] -> codes uint8 [B,H,T,D*bits/8], scales/zeros [B,H,T,D/G]
//   dequantize_keys(device: str, codes, scales, zeros, out, num_tokens: int, group_size: int, bits: int) -> None
//       codes [B,H,D,R] (R >= N*bits/8), scales/zeros [B,H,D,M] (M >= N/G) -> out [B,H,N,D]
//   dequantize_values(device: str, codes, scales, zeros, out, num_tokens: int, group_size: int, bits: int) -> None
//       codes [B,H,R,D*bits/8] (R >= N), scales/zeros [B,H,M,D/G] (M >= N) -> out [B,H,N,D]
//   packed_key_scores(device: str, query, codes, scales, zeros, out, num_tokens: int, group_size: int, bits: int)
//       query [B,Hq,L,D] float32, keys as for dequantize_keys with Hkv heads (Hq % Hkv == 0; query head h reads kv
//       head h / (Hq/Hkv)) -> out [B,Hq,L,N] float32 = query @ dequantize_keys(...)^T
//   packed_value_combine(device: str, probs, codes, scales, zeros, partial, num_tokens: int, group_size: int,
//                        bits: int, chunk_tokens: int) -> None
//       probs [B,Hq,L,N] float32, values as for dequantize_values with Hkv heads -> partial [B,Hq,L,C,D] float32,
//       C = ceil(N / chunk_tokens): the sum over chunk c's tokens, in channel order; the caller sums over C (in
//       order, see kivi_xpu/ops/sycl.py).
//   packed_attention(device: str, query, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
//                    bias, bias_fills: bool, chunk_max, chunk_sum, chunk_acc, num_tokens: int, key_group: int,
//                    key_bits: int, value_group: int, value_bits: int, chunk_tokens: int, softcap: float) -> None
//       query [B,Hq,L,D] float32 (scaled), the packed keys and values of N tokens (as above, one metadata dtype),
//       bias None or float32 [B|1,Hq|1,L,N] (unit stride along N; added, or with bias_fills its -inf entries
//       replace the scores, as a bool mask does) -> per chunk of chunk_tokens tokens:
//       chunk_max/chunk_sum [B,Hq,L,C] (max of the softcapped, biased scores; sum of exp(score - max)) and
//       chunk_acc [B,Hq,L,C,Dv] (sum of exp(score - max) * value); the caller merges the chunks in order.
//   paged_attention(device: str, query, plain_query, key_windows, value_windows, key_codes, key_scales, key_zeros,
//                   value_codes, value_scales, value_zeros, block_table, requests, chunk_max, chunk_sum, chunk_acc,
//                   chunk_exact_acc, key_bits: int, value_group: int, value_bits: int, chunk_tokens: int) -> None
//       query [N,Hq,1,D] float32 (scaled, rotated as the keys; plain_query not rotated), continuous batching's
//       windows and pages and the requests table of paged_decode_attention (kivi_xpu/ops/reference.py) -> per chunk
//       of chunk_tokens tokens (a multiple of the page size) of the tokens that either kind holds packed:
//       chunk_max/chunk_sum [N,Hq,1,C], chunk_acc (packed values) and chunk_exact_acc (window values)
//       [N,Hq,1,C,Dv]; the caller merges them with the sinks and the exact tail.
// `device` is a filter string previously passed to init(). Metadata dtypes: float16/bfloat16/float32.
// Every assumption is checked here too (TORCH_CHECK_*), so a direct call with bad tensors raises, never crashes.

#include <torch/extension.h>

#include <string>

#include "kivi_launch.h"
#include "kivi_params.h"
#include "kivi_runtime.h"

namespace kivi {
namespace {

template <Layout L>
void quantize(const std::string& device, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
              const at::Tensor& zeros, int64_t group_size, int64_t bits) {
  DeviceRuntime& rt = runtime(device);
  const OpParams p = check_quantize(rt, L, x, codes, scales, zeros, group_size, bits);
  L == Layout::kKeys ? launch_quantize_keys(rt, p) : launch_quantize_values(rt, p);
}

template <Layout L>
void dequantize(const std::string& device, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                const at::Tensor& out, int64_t num_tokens, int64_t group_size, int64_t bits) {
  DeviceRuntime& rt = runtime(device);
  const OpParams p = check_dequantize(rt, L, codes, scales, zeros, out, num_tokens, group_size, bits);
  L == Layout::kKeys ? launch_dequantize_keys(rt, p) : launch_dequantize_values(rt, p);
}

void packed_key_scores(const std::string& device, const at::Tensor& query, const at::Tensor& codes,
                       const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& out, int64_t num_tokens,
                       int64_t group_size, int64_t bits) {
  DeviceRuntime& rt = runtime(device);
  const OpParams p =
      check_attention(rt, Layout::kKeys, "query", query, codes, scales, zeros, out, num_tokens, group_size, bits);
  launch_packed_key_scores(rt, p);
}

void packed_value_combine(const std::string& device, const at::Tensor& probs, const at::Tensor& codes,
                          const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& partial,
                          int64_t num_tokens, int64_t group_size, int64_t bits, int64_t chunk_tokens) {
  DeviceRuntime& rt = runtime(device);
  const OpParams p = check_attention(rt, Layout::kValues, "probs", probs, codes, scales, zeros, partial, num_tokens,
                                     group_size, bits, chunk_tokens);
  launch_packed_value_combine(rt, p);
}

void packed_attention(const std::string& device, const at::Tensor& query, const at::Tensor& key_codes,
                      const at::Tensor& key_scales, const at::Tensor& key_zeros, const at::Tensor& value_codes,
                      const at::Tensor& value_scales, const at::Tensor& value_zeros,
                      const c10::optional<at::Tensor>& bias, bool bias_fills, const at::Tensor& chunk_max,
                      const at::Tensor& chunk_sum,
                      const at::Tensor& chunk_acc, int64_t num_tokens, int64_t key_group, int64_t key_bits,
                      int64_t value_group, int64_t value_bits, int64_t chunk_tokens, double softcap) {
  DeviceRuntime& rt = runtime(device);
  FusedParams p = check_packed_attention(rt, query, key_codes, key_scales, key_zeros, value_codes, value_scales,
                                         value_zeros, bias, bias_fills, chunk_max, chunk_sum, chunk_acc, num_tokens,
                                         key_group, key_bits, value_group, value_bits, chunk_tokens, softcap);
  const at::Tensor scratch = at::empty({scratch_floats(p)}, query.options());  // on the query's device
  p.scratch = scratch.data_ptr<float>();
  launch_packed_attention(rt, p);
}

void paged_attention(const std::string& device, const at::Tensor& query, const at::Tensor& plain_query,
                     const at::Tensor& key_windows,
                     const at::Tensor& value_windows, const at::Tensor& key_codes, const at::Tensor& key_scales,
                     const at::Tensor& key_zeros, const at::Tensor& value_codes, const at::Tensor& value_scales,
                     const at::Tensor& value_zeros, const at::Tensor& block_table, const at::Tensor& requests,
                     const at::Tensor& chunk_max, const at::Tensor& chunk_sum, const at::Tensor& chunk_acc,
                     const at::Tensor& chunk_exact_acc, int64_t key_bits, int64_t value_group, int64_t value_bits,
                     int64_t chunk_tokens) {
  DeviceRuntime& rt = runtime(device);
  PagedParams p = check_paged_attention(rt, query, plain_query, key_windows, value_windows, key_codes, key_scales,
                                        key_zeros, value_codes, value_scales, value_zeros, block_table, requests,
                                        chunk_max, chunk_sum, chunk_acc, chunk_exact_acc, key_bits, value_group,
                                        value_bits, chunk_tokens);
  const at::Tensor scratch = at::empty({paged_scratch_floats(p)}, query.options());  // on the query's device
  p.scratch = scratch.data_ptr<float>();
  launch_paged_attention(rt, p);
}

}  // namespace
}  // namespace kivi

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace kivi;
  m.doc() = "SYCL KIVI quantize/dequantize kernels (device code compiled at run time); see csrc/kivi_ext.cpp";
  m.def("init", &init, py::arg("filter"),
        "Select the SYCL device `filter` (backend:device_type:index), return device facts (kernels compile on first use)");
  m.def("variant_names", &variant_names, "Template-ids of every kernel variant of csrc/kivi_variants.h");
  m.def("compile", &compile, py::arg("filter"), py::arg("name"), "Compile one variant now unless it is; seconds");
  m.def("compiled", &compiled, py::arg("filter"), "{template-id: build seconds} of the variants compiled so far");
  m.def("set_compile_hook", &set_compile_hook, py::arg("hook"), "hook(filter, names, seconds) after every build");
  m.def("quantize_keys", &quantize<Layout::kKeys>, py::arg("device"), py::arg("x"), py::arg("codes"),
        py::arg("scales"), py::arg("zeros"), py::arg("group_size"), py::arg("bits"));
  m.def("quantize_values", &quantize<Layout::kValues>, py::arg("device"), py::arg("x"), py::arg("codes"),
        py::arg("scales"), py::arg("zeros"), py::arg("group_size"), py::arg("bits"));
  m.def("dequantize_keys", &dequantize<Layout::kKeys>, py::arg("device"), py::arg("codes"), py::arg("scales"),
        py::arg("zeros"), py::arg("out"), py::arg("num_tokens"), py::arg("group_size"), py::arg("bits"));
  m.def("dequantize_values", &dequantize<Layout::kValues>, py::arg("device"), py::arg("codes"), py::arg("scales"),
        py::arg("zeros"), py::arg("out"), py::arg("num_tokens"), py::arg("group_size"), py::arg("bits"));
  m.def("packed_key_scores", &packed_key_scores, py::arg("device"), py::arg("query"), py::arg("codes"),
        py::arg("scales"), py::arg("zeros"), py::arg("out"), py::arg("num_tokens"), py::arg("group_size"),
        py::arg("bits"));
  m.def("packed_value_combine", &packed_value_combine, py::arg("device"), py::arg("probs"), py::arg("codes"),
        py::arg("scales"), py::arg("zeros"), py::arg("partial"), py::arg("num_tokens"), py::arg("group_size"),
        py::arg("bits"), py::arg("chunk_tokens"));
  m.def("packed_attention", &packed_attention, py::arg("device"), py::arg("query"), py::arg("key_codes"),
        py::arg("key_scales"), py::arg("key_zeros"), py::arg("value_codes"), py::arg("value_scales"),
        py::arg("value_zeros"), py::arg("bias"), py::arg("bias_fills"), py::arg("chunk_max"), py::arg("chunk_sum"),
        py::arg("chunk_acc"), py::arg("num_tokens"), py::arg("key_group"), py::arg("key_bits"), py::arg("value_group"),
        py::arg("value_bits"), py::arg("chunk_tokens"), py::arg("softcap"));
  m.def("paged_attention", &paged_attention, py::arg("device"), py::arg("query"), py::arg("plain_query"),
        py::arg("key_windows"),
        py::arg("value_windows"), py::arg("key_codes"), py::arg("key_scales"), py::arg("key_zeros"),
        py::arg("value_codes"), py::arg("value_scales"), py::arg("value_zeros"), py::arg("block_table"),
        py::arg("requests"), py::arg("chunk_max"), py::arg("chunk_sum"), py::arg("chunk_acc"),
        py::arg("chunk_exact_acc"), py::arg("key_bits"),
        py::arg("value_group"), py::arg("value_bits"), py::arg("chunk_tokens"));
  m.attr("build_options") = kBuildOptions;
}
