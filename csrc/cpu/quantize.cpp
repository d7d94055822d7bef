// Native CPU quantize / dequantize kernels (to be written).
#include "kernels.h"

namespace kivi::cpu {
void register_quantize(pybind11::module& m) {}
}  // namespace kivi::cpu
