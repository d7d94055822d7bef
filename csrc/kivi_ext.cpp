// kivi_xpu._C: host side of the SYCL KIVI kernels (built by g++ as a torch CppExtension; the device code in
// csrc/device/ is compiled at run time by the sycl_ext_oneapi_kernel_compiler extension). Each op checks
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
//   quantize_keys(device: str, x, codes, scales, zeros, group_size: int, bits: int, refit: bool) -> None
//       x [B,H,T,D] float32/float16/bfloat16 -> codes uint8 [B,H,D,T*bits/8], scales/zeros [B,H,D,T/G]
//       (keys are channel-major: byte j of channel d holds tokens P*j .. P*j+P-1, P = 8/bits)
//   quantize_values(device: str, x, codes, scales, zeros, group_size: int, bits: int, refit: bool) -> None
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

// An op of the Python API: `device` (a filter passed to init()), then the arguments of its check in kivi_params.h,
// whose signature is the op's (so it is written once, plus the argument names of its m.def below); it runs the check,
// then the launcher on that device.
template <auto Check, auto Launch>
struct Op;
template <typename Params, typename... Args, Params (*Check)(const DeviceRuntime&, Args...),
          void (*Launch)(DeviceRuntime&, const Params&)>
struct Op<Check, Launch> {
  static void run(const std::string& device, Args... args) {
    DeviceRuntime& rt = runtime(device);
    Launch(rt, Check(rt, args...));
  }
};

// Defines op `name` of the module with the names of its check's arguments (pybind11 checks that they are as many).
template <auto Check, auto Launch, typename... Names>
void def_op(py::module_& m, const char* name, Names... names) {
  m.def(name, &Op<Check, Launch>::run, py::arg("device"), py::arg(names)...);
}

}  // namespace
}  // namespace kivi

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace kivi;
  m.doc() = "SYCL KIVI quantize/dequantize kernels (device code compiled at run time); see csrc/kivi_ext.cpp";
  m.def("init", &init, py::arg("filter"),
        "Select the SYCL device `filter` (backend:device_type:index), return device facts (kernels compile on first "
        "use)");
  m.def("variant_names", &variant_names, "Template-ids of every kernel variant of csrc/kivi_variants.h");
  m.def("compile", &compile, py::arg("filter"), py::arg("name"), "Compile one variant now unless it is; seconds");
  m.def("compiled", &compiled, py::arg("filter"), "{template-id: build seconds} of the variants compiled so far");
  m.def("set_compile_hook", &set_compile_hook, py::arg("hook"), "hook(filter, names, seconds) after every build");
  def_op<&check_quantize<Layout::kKeys>, &launch_quantize_keys>(m, "quantize_keys", "x", "codes", "scales", "zeros",
                                                                 "group_size", "bits", "refit");
  def_op<&check_quantize<Layout::kValues>, &launch_quantize_values>(m, "quantize_values", "x", "codes", "scales",
                                                                     "zeros", "group_size", "bits", "refit");
  def_op<&check_dequantize<Layout::kKeys>, &launch_dequantize_keys>(m, "dequantize_keys", "codes", "scales", "zeros",
                                                                     "out", "num_tokens", "group_size", "bits");
  def_op<&check_dequantize<Layout::kValues>, &launch_dequantize_values>(m, "dequantize_values", "codes", "scales",
                                                                         "zeros", "out", "num_tokens", "group_size",
                                                                         "bits");
  def_op<&check_key_scores, &launch_packed_key_scores>(m, "packed_key_scores", "query", "codes", "scales", "zeros",
                                                       "out", "num_tokens", "group_size", "bits");
  def_op<&check_value_combine, &launch_packed_value_combine>(m, "packed_value_combine", "probs", "codes", "scales",
                                                             "zeros", "partial", "num_tokens", "group_size", "bits",
                                                             "chunk_tokens");
  def_op<&check_packed_attention, &launch_packed_attention>(
      m, "packed_attention", "query", "key_codes", "key_scales", "key_zeros", "value_codes", "value_scales",
      "value_zeros", "bias", "bias_fills", "chunk_max", "chunk_sum", "chunk_acc", "num_tokens", "key_group", "key_bits",
      "value_group", "value_bits", "chunk_tokens", "softcap");
  def_op<&check_paged_attention, &launch_paged_attention>(
      m, "paged_attention", "query", "plain_query", "key_windows", "value_windows", "key_codes", "key_scales",
      "key_zeros", "value_codes", "value_scales", "value_zeros", "block_table", "requests", "chunk_max", "chunk_sum",
      "chunk_acc", "chunk_exact_acc", "key_bits", "value_group", "value_bits", "chunk_tokens");
  m.attr("build_options") = kBuildOptions;
}
