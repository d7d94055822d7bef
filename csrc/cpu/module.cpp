// kivi_xpu._cpu: native CPU kernels of the KIVI ops (SIMD per ISA, run in torch's own intra-op thread pool).
// Each kernel file registers its functions through a register_* hook declared in kernels.h.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native CPU KIVI kernels (AVX-512 / AVX2 / baseline, chosen at run time); see csrc/cpu/";
  kivi::cpu::register_isa(m);
  kivi::cpu::register_quantize(m);
  kivi::cpu::register_decode_attention(m);
  kivi::cpu::register_decode_step(m);
  kivi::cpu::register_paged_attention(m);
}
