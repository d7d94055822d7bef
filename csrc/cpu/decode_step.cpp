// A layer's cache work of one decode step in one native call (kivi_xpu/ops/reference.py: append_decode_step is its
// twin): the new key and value tokens copied into their full-precision windows, the value tokens that leave the
// window quantized into the packed value storage, and the tails attention reads returned as views of the windows.
// In Python the same step is ~10 torch calls (views, copies, the quantizer), whose dispatch costs more than the work
// itself at short contexts.
#include <torch/extension.h>

#include <cstring>

#include "kernels.h"
#include "quantize.h"

namespace kivi::cpu {
namespace {

// Checks one kind's window and the states appended to it; returns the number of new tokens.
int64_t check_window(const at::Tensor& states, const at::Tensor& window, int64_t start, int64_t end,
                     const char* states_name, const char* window_name) {
  TORCH_CHECK_VALUE(states.defined() && window.defined(), "`", states_name, "` and `", window_name,
                    "` must be defined tensors");
  TORCH_CHECK_VALUE(states.device().is_cpu() && window.device().is_cpu(), "`", states_name, "` and `", window_name,
                    "` must be CPU tensors, got ", states.device(), " and ", window.device());
  TORCH_CHECK_VALUE(states.dim() == 4 && window.dim() == 4, "`", states_name, "` and `", window_name,
                    "` must have rank 4 [batch, heads, tokens, head_dim], got ", states.sizes(), " and ",
                    window.sizes());
  TORCH_CHECK_VALUE(states.size(0) == window.size(0) && states.size(1) == window.size(1) &&
                        states.size(3) == window.size(3),
                    "`", states_name, "` ", states.sizes(), " must match `", window_name, "` ", window.sizes(),
                    " in batch, heads and head_dim");
  TORCH_CHECK_TYPE(states.scalar_type() == window.scalar_type(), "`", states_name, "` (", states.scalar_type(),
                   ") must have the dtype of `", window_name, "` (", window.scalar_type(), ")");
  TORCH_CHECK_VALUE(window.is_contiguous(), "`", window_name, "` must be contiguous (a window buffer)");
  const int64_t m = states.size(2);
  TORCH_CHECK_VALUE(0 <= start && start <= end && end + m <= window.size(2), "`", window_name,
                    "` rows: need 0 <= start (", start, ") <= end (", end, ") and end + new tokens (", m,
                    ") <= capacity (", window.size(2), ")");
  return m;
}

// window[:, :, end:end + m] = states, one memcpy per token row (states may be strided, e.g. [B, m, H, D] transposed).
void copy_rows(const at::Tensor& states, const at::Tensor& window, int64_t end) {
  const int64_t b = states.size(0), h = states.size(1), m = states.size(2), d = states.size(3);
  if (states.stride(3) != 1) {
    window.narrow(2, end, m).copy_(states);
    return;
  }
  const int64_t element = states.element_size(), row_bytes = d * element, capacity = window.size(2);
  const auto* src = static_cast<const char*>(states.data_ptr());
  auto* dst = static_cast<char*>(window.data_ptr());
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < h; ++j) {
      for (int64_t t = 0; t < m; ++t) {
        const int64_t from = i * states.stride(0) + j * states.stride(1) + t * states.stride(2);
        std::memcpy(dst + ((i * h + j) * capacity + end + t) * row_bytes, src + from * element, row_bytes);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> append_decode_step(
    const at::Tensor& key_states, const at::Tensor& value_states, const at::Tensor& key_window, int64_t key_start,
    int64_t key_end, const at::Tensor& value_window, int64_t value_start, int64_t value_end,
    const at::Tensor& value_codes, const at::Tensor& value_scales, const at::Tensor& value_zeros,
    int64_t value_offset, int64_t value_leaving, int64_t value_group, int64_t value_bits,
    const c10::optional<at::Tensor>& value_rotation, const std::string& value_fit) {
  least_squares_fit(value_fit, "value_fit");  // checked even when no token leaves
  const int64_t m = check_window(key_states, key_window, key_start, key_end, "key_states", "key_window");
  TORCH_CHECK_VALUE(value_states.defined() && value_states.dim() == 4 && value_states.size(2) == m,
                    "`value_states` must hold as many tokens as `key_states` (", m, ")");
  check_window(value_states, value_window, value_start, value_end, "value_states", "value_window");
  TORCH_CHECK_VALUE(value_leaving >= 0 && value_start + value_leaving <= value_end + m, "`value_leaving` (",
                    value_leaving, ") must be within the window's rows after the append (", value_end + m - value_start,
                    ")");
  copy_rows(key_states, key_window, key_end);
  copy_rows(value_states, value_window, value_end);
  if (value_leaving > 0) {  // oldest first: rows [start, start + leaving), already in place
    quantize_values_into(value_window.narrow(2, value_start, value_leaving), value_codes, value_scales, value_zeros,
                         value_offset, value_group, value_bits, value_rotation, value_fit);
  }
  return {key_window.narrow(2, key_start, key_end + m - key_start),
          value_window.narrow(2, value_start, value_end + m - value_start)};
}

}  // namespace

void register_decode_step(pybind11::module& m) {
  namespace py = pybind11;
  m.def("append_decode_step", &append_decode_step,
        "A layer's decode step: key/value states [B,H,m,D] copied into rows [end, end+m) of their windows "
        "[B,H,capacity,D]; value window rows [value_start, value_start+value_leaving) quantized into value storage "
        "rows from value_offset; returns the tails window[:, :, start:end+m] (views) of keys and values.",
        py::arg("key_states"), py::arg("value_states"), py::arg("key_window"), py::arg("key_start"),
        py::arg("key_end"), py::arg("value_window"), py::arg("value_start"), py::arg("value_end"),
        py::arg("value_codes"), py::arg("value_scales"), py::arg("value_zeros"), py::arg("value_offset"),
        py::arg("value_leaving"), py::arg("value_group"), py::arg("value_bits"), py::arg("value_rotation") = py::none(),
        py::arg("value_fit") = "minmax");
}

}  // namespace kivi::cpu
