// Native CPU fused decode attention over [sinks | packed history | exact tail] (to be written).
#include "kernels.h"

namespace kivi::cpu {
void register_decode_attention(pybind11::module& m) {}
}  // namespace kivi::cpu
