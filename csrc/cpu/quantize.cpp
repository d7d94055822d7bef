// Native CPU quantize / dequantize: argument checks, output allocation and threading (torch's intra-op pool via
// at::parallel_for). The kernels are in quantize_impl.h, compiled per ISA in isa_<name>_quantize.cpp; kernels()
// (kernel_table.h) gives those of the ISA in use.
// Semantics and layouts: kivi_xpu/ops/reference.py (bit-identical).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "kernel_table.h"
#include "kernels.h"
#include "quantize.h"
#include "quantize_job.h"
#include "torch_dtype.h"

namespace kivi::cpu {
namespace {

using quant::DequantizeJob;
using quant::QuantizeJob;

// Elements a parallel chunk should hold at least, so a one-token decode call runs on the calling thread.
constexpr int64_t kMinElementsPerChunk = 1 << 15;

Dtype float_dtype(at::ScalarType type, const char* name) {
  Dtype dtype;
  TORCH_CHECK_TYPE(kernel_dtype(type, &dtype), "`", name, "` must be one of (float32, float16, bfloat16), got ", type);
  return dtype;
}

void check_bits_and_group(int64_t group_size, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 2 || bits == 4 || bits == 8, "`bits` must be one of (2, 4, 8), got ", bits);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % (8 / bits) == 0, "`group_size` must be a positive multiple of ",
                    8 / bits, " for ", bits, "-bit codes, got ", group_size);
}

void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "`", name, "` is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "`", name, "` must be a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 4, "`", name, "` must have rank 4, got shape ", t.sizes());
}

void run(int64_t tasks, int64_t elements_per_task, const std::function<void(int64_t, int64_t)>& body) {
  if (tasks == 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerChunk / std::max<int64_t>(1, elements_per_task));
  at::parallel_for(0, tasks, grain, body);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& input, int64_t group_size, int64_t bits,
                                                         at::ScalarType meta_dtype, const std::string& fit, bool keys) {
  check_tensor(input, "x");
  check_bits_and_group(group_size, bits);
  QuantizeJob job{};
  job.refit = least_squares_fit(fit, "fit");
  job.x_dtype = float_dtype(input.scalar_type(), "x");
  job.meta_dtype = float_dtype(meta_dtype, "meta_dtype");
  const at::Tensor x = input.contiguous();
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const int64_t grouped = keys ? t : d;
  TORCH_CHECK_VALUE(grouped % group_size == 0, "`group_size` (", group_size, ") must divide the ",
                    keys ? "number of tokens x.shape[2] (" : "head_dim x.shape[3] (", grouped, ")");
  const auto meta_options = x.options().dtype(meta_dtype);
  at::Tensor codes, scales, zeros;
  if (keys) {
    codes = at::empty({b, h, d, t * bits / 8}, x.options().dtype(at::kByte));
    scales = at::empty({b, h, d, t / group_size}, meta_options);
  } else {
    codes = at::empty({b, h, t, d * bits / 8}, x.options().dtype(at::kByte));
    scales = at::empty({b, h, t, d / group_size}, meta_options);
  }
  zeros = at::empty_like(scales);
  job.x = x.data_ptr();
  job.codes = codes.data_ptr<uint8_t>();
  job.scales = scales.data_ptr();
  job.zeros = zeros.data_ptr();
  job.heads = b * h, job.tokens = t, job.head_dim = d, job.group = group_size, job.bits = bits;
  const QuantizeKernels& k = *kernels().quantize;
  if (keys) {
    run(b * h * (t / group_size), group_size * d, [&](int64_t s, int64_t e) { k.quantize_keys(job, s, e); });
  } else {
    run(b * h * t, d, [&](int64_t s, int64_t e) { k.quantize_values(job, s, e); });
  }
  return {codes, scales, zeros};
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t num_tokens,
                      int64_t group_size, int64_t bits, at::ScalarType out_dtype, bool keys) {
  check_tensor(codes, "codes");
  check_tensor(scales, "scales");
  check_tensor(zeros, "zeros");
  check_bits_and_group(group_size, bits);
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "`codes` must be uint8, got ", codes.scalar_type());
  DequantizeJob job{};
  job.meta_dtype = float_dtype(scales.scalar_type(), "scales");
  job.out_dtype = float_dtype(out_dtype, "out_dtype");
  TORCH_CHECK_TYPE(zeros.scalar_type() == scales.scalar_type(), "`scales` and `zeros` must share a dtype, got ",
                   scales.scalar_type(), " and ", zeros.scalar_type());
  TORCH_CHECK_VALUE(scales.sizes() == zeros.sizes(), "`scales` and `zeros` must have the same shape, got ",
                    scales.sizes(), " and ", zeros.sizes());
  TORCH_CHECK_VALUE(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(),
                    "`codes`, `scales` and `zeros` must be contiguous (packed storage is laid out densely)");
  TORCH_CHECK_VALUE(num_tokens >= 0, "`num_tokens` must be non-negative, got ", num_tokens);
  const int64_t b = codes.size(0), h = codes.size(1), per = 8 / bits;
  TORCH_CHECK_VALUE(scales.size(0) == b && scales.size(1) == h, "`scales` batch/heads ", scales.sizes(),
                    " do not match `codes` batch/heads ", codes.sizes());
  int64_t d;
  if (keys) {
    d = codes.size(2);
    TORCH_CHECK_VALUE(num_tokens % group_size == 0, "`num_tokens` (", num_tokens,
                      ") must be a multiple of `group_size` (", group_size, ") for keys");
    TORCH_CHECK_VALUE(scales.size(2) == d, "`scales` dim 2 (", scales.size(2), ") must equal head_dim ", d);
    TORCH_CHECK_VALUE(codes.size(3) >= num_tokens / per && scales.size(3) >= num_tokens / group_size,
                      "`num_tokens` (", num_tokens, ") exceeds the stored tokens: codes hold ", codes.size(3) * per,
                      ", scales hold ", scales.size(3) * group_size);
    job.code_len = codes.size(3), job.meta_len = scales.size(3);
  } else {
    d = codes.size(3) * per;
    TORCH_CHECK_VALUE(d % group_size == 0, "`group_size` (", group_size, ") must divide head_dim (", d, ")");
    TORCH_CHECK_VALUE(scales.size(3) == d / group_size, "`scales` last dim ", scales.size(3),
                      " must equal head_dim / group_size = ", d / group_size);
    TORCH_CHECK_VALUE(codes.size(2) >= num_tokens && scales.size(2) >= num_tokens, "`num_tokens` (", num_tokens,
                      ") exceeds the stored tokens: codes hold ", codes.size(2), ", scales hold ", scales.size(2));
    job.code_len = codes.size(2), job.meta_len = scales.size(2);
  }
  at::Tensor out = at::empty({b, h, num_tokens, d}, codes.options().dtype(out_dtype));
  job.codes = codes.data_ptr<uint8_t>();
  job.scales = scales.data_ptr();
  job.zeros = zeros.data_ptr();
  job.out = out.data_ptr();
  job.heads = b * h, job.num_tokens = num_tokens, job.head_dim = d, job.group = group_size, job.bits = bits;
  const QuantizeKernels& k = *kernels().quantize;
  if (keys) {
    run(b * h * (num_tokens / group_size), group_size * d, [&](int64_t s, int64_t e) { k.dequantize_keys(job, s, e); });
  } else {
    run(b * h * num_tokens, d, [&](int64_t s, int64_t e) { k.dequantize_values(job, s, e); });
  }
  return out;
}

}  // namespace

bool least_squares_fit(const std::string& fit, const char* name) {
  TORCH_CHECK_VALUE(fit == "minmax" || fit == "least_squares", "`", name,
                    "` must be one of ('minmax', 'least_squares'), got '", fit, "'");
  return fit == "least_squares";
}

// Floats of the stack buffer that holds a block of rotated rows (kRotatedFloats / D rows at a time).
constexpr int64_t kRotatedFloats = 4096;

// Values quantized straight into token rows [offset, offset + n) of packed value storage: codes [B,H,capacity,
// D*bits/8], scales/zeros [B,H,capacity,D/G] (their dtype is the metadata dtype). One kernel range per (batch, head),
// whose n rows are contiguous in the storage: a decode step's departing token needs no temporaries and no copies.
// With a `rotation` Q [D, D] (float32), the rows stored are x @ Q, rotated a block of rows at a time into a stack
// buffer (a decode step's token costs no torch call for its rotation).
void quantize_values_into(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t offset, int64_t group_size, int64_t bits,
                          const c10::optional<at::Tensor>& rotation, const std::string& fit) {
  check_tensor(input, "x");
  check_tensor(codes, "codes");
  check_tensor(scales, "scales");
  check_tensor(zeros, "zeros");
  check_bits_and_group(group_size, bits);
  QuantizeJob job{};
  job.refit = least_squares_fit(fit, "fit");
  job.x_dtype = float_dtype(input.scalar_type(), "x");
  job.meta_dtype = float_dtype(scales.scalar_type(), "scales");
  // Rows of one (batch, head) must be contiguous; batch and head may be strided (a window's rows in place).
  const bool rows_contiguous = input.stride(3) == 1 && (input.size(2) <= 1 || input.stride(2) == input.size(3));
  const at::Tensor x = rows_contiguous ? input : input.contiguous();
  const int64_t b = x.size(0), h = x.size(1), n = x.size(2), d = x.size(3);
  TORCH_CHECK_VALUE(d % group_size == 0, "`group_size` (", group_size, ") must divide the head_dim x.shape[3] (", d,
                    ")");
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "`codes` must be uint8, got ", codes.scalar_type());
  TORCH_CHECK_TYPE(zeros.scalar_type() == scales.scalar_type(), "`scales` and `zeros` must share a dtype, got ",
                   scales.scalar_type(), " and ", zeros.scalar_type());
  const int64_t capacity = codes.size(2), row_bytes = d * bits / 8, groups = d / group_size;
  TORCH_CHECK_VALUE(codes.sizes() == at::IntArrayRef({b, h, capacity, row_bytes}), "`codes` must have shape [", b,
                    ", ", h, ", capacity, ", row_bytes, "], got ", codes.sizes());
  TORCH_CHECK_VALUE(scales.sizes() == at::IntArrayRef({b, h, capacity, groups}) && zeros.sizes() == scales.sizes(),
                    "`scales` and `zeros` must have shape [", b, ", ", h, ", ", capacity, ", ", groups, "], got ",
                    scales.sizes(), " and ", zeros.sizes());
  TORCH_CHECK_VALUE(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(),
                    "`codes`, `scales` and `zeros` must be contiguous (packed storage is laid out densely)");
  TORCH_CHECK_VALUE(offset >= 0 && offset + n <= capacity, "`offset` + tokens (", offset, " + ", n,
                    ") must lie within the storage capacity (", capacity, ")");
  at::Tensor q;
  if (rotation.has_value()) {
    q = rotation->contiguous();
    TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 2 && q.size(0) == d &&
                          q.size(1) == d,
                      "`rotation` must be a float32 [", d, ", ", d, "] CPU tensor, got ", q.scalar_type(), " ",
                      q.sizes(), " on ", q.device());
    if (d > decode::kMaxDim) {  // wider than the kernels' row buffers: rotate with torch, then as without rotation
      return quantize_values_into(at::matmul(x.to(at::kFloat), q), codes, scales, zeros, offset, group_size, bits,
                                  c10::nullopt, fit);
    }
  }
  if (n == 0 || b * h == 0) return;
  const auto* x_bytes = static_cast<const char*>(x.data_ptr());
  auto* scale_bytes = static_cast<char*>(scales.data_ptr());
  auto* zero_bytes = static_cast<char*>(zeros.data_ptr());
  const int64_t x_row = d * (int64_t)x.element_size(), meta_row = groups * (int64_t)scales.element_size();
  job.heads = 1, job.tokens = n, job.head_dim = d, job.group = group_size, job.bits = bits;
  const QuantizeKernels& k = *kernels().quantize;
  const auto rotate_rows = kernels().rotate_rows;
  run(b * h, n * d, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      QuantizeJob rows = job;
      const int64_t first_row = head * capacity + offset;
      rows.x = x_bytes + ((head / h) * x.stride(0) + (head % h) * x.stride(1)) * x.element_size();
      rows.codes = codes.data_ptr<uint8_t>() + first_row * row_bytes;
      rows.scales = scale_bytes + first_row * meta_row;
      rows.zeros = zero_bytes + first_row * meta_row;
      if (!q.defined()) {
        k.quantize_values(rows, 0, n);
        continue;
      }
      alignas(64) float rotated[kRotatedFloats];
      const int64_t block = kRotatedFloats / d;  // >= 8 rows (d <= kMaxDim)
      for (int64_t r0 = 0; r0 < n; r0 += block) {
        QuantizeJob part = rows;
        part.tokens = std::min(block, n - r0);
        rotate_rows(static_cast<const char*>(rows.x) + r0 * x_row, job.x_dtype, part.tokens, d, q.data_ptr<float>(),
                    rotated);
        part.x = rotated, part.x_dtype = kF32;
        part.codes += r0 * row_bytes;
        part.scales = static_cast<char*>(rows.scales) + r0 * meta_row;
        part.zeros = static_cast<char*>(rows.zeros) + r0 * meta_row;
        k.quantize_values(part, 0, part.tokens);
      }
    }
  });
}

void register_quantize(pybind11::module& m) {
  namespace py = pybind11;
  m.def(
      "quantize_keys",
      [](const at::Tensor& x, int64_t group_size, int64_t bits, at::ScalarType meta_dtype, const std::string& fit) {
        return quantize(x, group_size, bits, meta_dtype, fit, true);
      },
      "x [B,H,T,D] -> codes uint8 [B,H,D,T*bits/8], scales, zeros [B,H,D,T/G] (per-channel keys).", py::arg("x"),
      py::arg("group_size"), py::arg("bits"), py::arg("meta_dtype") = at::kHalf, py::arg("fit") = "minmax");
  m.def(
      "quantize_values",
      [](const at::Tensor& x, int64_t group_size, int64_t bits, at::ScalarType meta_dtype, const std::string& fit) {
        return quantize(x, group_size, bits, meta_dtype, fit, false);
      },
      "x [B,H,T,D] -> codes uint8 [B,H,T,D*bits/8], scales, zeros [B,H,T,D/G] (per-token values).", py::arg("x"),
      py::arg("group_size"), py::arg("bits"), py::arg("meta_dtype") = at::kHalf, py::arg("fit") = "minmax");
  m.def("quantize_values_into", &quantize_values_into,
        "x [B,H,n,D] quantized per token into rows [offset, offset+n) of value storage codes [B,H,capacity,D*bits/8] "
        "and scales, zeros [B,H,capacity,D/G] (metadata in their dtype); with a rotation Q [D,D] fp32, x @ Q is stored.",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("offset"), py::arg("group_size"),
        py::arg("bits"), py::arg("rotation") = py::none(), py::arg("fit") = "minmax");
  m.def(
      "dequantize_keys",
      [](const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t num_tokens,
         int64_t group_size, int64_t bits, at::ScalarType out_dtype) {
        return dequantize(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, true);
      },
      "Packed keys (possibly over-allocated) -> [B,H,num_tokens,D].", py::arg("codes"), py::arg("scales"),
      py::arg("zeros"), py::arg("num_tokens"), py::arg("group_size"), py::arg("bits"),
      py::arg("out_dtype") = at::kFloat);
  m.def(
      "dequantize_values",
      [](const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t num_tokens,
         int64_t group_size, int64_t bits, at::ScalarType out_dtype) {
        return dequantize(codes, scales, zeros, num_tokens, group_size, bits, out_dtype, false);
      },
      "Packed values (possibly over-allocated) -> [B,H,num_tokens,D].", py::arg("codes"), py::arg("scales"),
      py::arg("zeros"), py::arg("num_tokens"), py::arg("group_size"), py::arg("bits"),
      py::arg("out_dtype") = at::kFloat);
}

}  // namespace kivi::cpu
