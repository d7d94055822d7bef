// Registration hooks of the native CPU kernel files (one per file), called by module.cpp.
#pragma once
#include <torch/extension.h>

namespace kivi::cpu {
void register_isa(pybind11::module& m);               // isa.cpp
void register_quantize(pybind11::module& m);          // quantize.cpp
void register_decode_attention(pybind11::module& m);  // decode_attention.cpp
void register_decode_step(pybind11::module& m);       // decode_step.cpp
void register_paged_attention(pybind11::module& m);   // paged_attention.cpp
}  // namespace kivi::cpu
