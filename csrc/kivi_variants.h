// The one table of kernel variants. The device source (csrc/device/) defines each kernel ONCE, as a template; the
// runtime instantiates a variant listed here, when a launch first needs it, by its template-id (e.g.
// "kivi_packed_key_scores<F16, 2, 3>", passed to the kernel compiler as registered_names) and looks the compiled
// kernels up by the same positions, so this table alone decides which variants exist, what they are called and where
// each one is stored.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace kivi __attribute__((visibility("hidden"))) {  // hidden, as pybind11's own types are

// Element dtypes of data and metadata, in dtype-tag order: torch dtype and the device-side element type
// (struct F32/F16/BF16 in device/10_prelude.cpp).
struct Dtype {
  at::ScalarType torch;
  const char* device_type;
};
inline const std::vector<Dtype> kDtypes = {{at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}};

// Template arguments along one variant axis; a position on the axis is an index into the list.
using Axis = std::vector<std::string>;
inline Axis dtype_axis() {
  Axis axis;
  for (const Dtype& d : kDtypes) axis.push_back(d.device_type);
  return axis;
}
inline const Axis kDtypeAxis = dtype_axis();
inline const Axis kBitsAxis = {"2", "4", "8"};
inline int bits_position(int bits) { return bits == 2 ? 0 : bits == 4 ? 1 : 2; }  // bits checked by the caller
// Query / probability rows per work-item of the attention kernels (accumulators held in registers): 1..4.
inline const Axis kRowsAxis = {"1", "2", "3", "4"};
constexpr int kMaxRowsPerItem = 4;

// Work-group size of the fused decode attention: lanes walking a chunk's code bytes (and reducing its rows).
constexpr size_t kFusedLocal = 16;

// Work-group size of the attention kernels along their code-byte dimension: one CPU vector (16 fp32 lanes), a GPU
// sub-group of 16. Many small work-groups balance best across cores; 64 measured no faster on the CPU device.
constexpr size_t kAttentionLocal = 16;
// Largest work-group used along the vectorised last dimension of the other kernels: big enough to fill a 16-lane
// AVX-512 CPU vector or a GPU's EUs several times over, small enough to leave many groups for load balancing.
constexpr size_t kMaxLocal = 256;

enum KernelId {
  kQuantizeKeys,
  kQuantizeValues,
  kDequantizeKeys,
  kDequantizeValues,
  kPackedKeyScores,
  kPackedValueCombine,
  kPackedAttention,
  kPagedAttention,
  kNumKernels
};

// One kernel template of the device source: its name, the axes of its template arguments, its largest local size and
// its build group. Variants compile when a launch first needs them, and the variant at the same positions of every
// template of the group is built along (one build: the compiler's fixed start-up cost, most of a small build, is paid
// once for kernels that run together); templates of one group have the same axes.
struct KernelTemplate {
  const char* name;
  std::vector<const Axis*> axes;
  size_t max_local;
  const char* group;
};

// Indexed by KernelId. quantize: <data dtype, metadata dtype>; dequantize: <metadata dtype, output dtype>; attention:
// <metadata dtype, bits, rows per item> (the dense operands are float32); fused attention: <metadata dtype, key bits,
// value bits, rows per item>; paged attention: <metadata dtype, window dtype, key bits, value bits, rows per item>.
inline const std::vector<KernelTemplate> kKernelTemplates = {
    {"kivi_quantize_keys", {&kDtypeAxis, &kDtypeAxis}, kMaxLocal, "quantize"},
    {"kivi_quantize_values", {&kDtypeAxis, &kDtypeAxis}, kMaxLocal, "quantize"},
    {"kivi_dequantize_keys", {&kDtypeAxis, &kDtypeAxis}, kMaxLocal, "dequantize"},
    {"kivi_dequantize_values", {&kDtypeAxis, &kDtypeAxis}, kMaxLocal, "dequantize"},
    {"kivi_packed_key_scores", {&kDtypeAxis, &kBitsAxis, &kRowsAxis}, kAttentionLocal, "attention"},
    {"kivi_packed_value_combine", {&kDtypeAxis, &kBitsAxis, &kRowsAxis}, kAttentionLocal, "attention"},
    {"kivi_packed_attention", {&kDtypeAxis, &kBitsAxis, &kBitsAxis, &kRowsAxis}, kFusedLocal, "fused"},
    {"kivi_paged_attention", {&kDtypeAxis, &kDtypeAxis, &kBitsAxis, &kBitsAxis, &kRowsAxis}, kFusedLocal, "paged"},
};

// Number of variants of a template: the product of its axis lengths.
inline size_t variant_count(const KernelTemplate& t) {
  size_t n = 1;
  for (const Axis* axis : t.axes) n *= axis->size();
  return n;
}

// Position of a variant among its template's variants: row-major over the axes (first axis slowest).
inline size_t variant_index(const KernelTemplate& t, const std::vector<int>& positions) {
  size_t index = 0;
  for (size_t a = 0; a < t.axes.size(); ++a) index = index * t.axes[a]->size() + positions[a];
  return index;
}

// Template-id of variant `index`, e.g. "kivi_quantize_keys<F32, F16>": the registered name the kernel compiler
// instantiates and the key the compiled kernel is fetched by.
inline std::string variant_name(const KernelTemplate& t, size_t index) {
  std::vector<std::string> args(t.axes.size());
  for (size_t a = t.axes.size(); a-- > 0;) {
    args[a] = (*t.axes[a])[index % t.axes[a]->size()];
    index /= t.axes[a]->size();
  }
  std::string name = std::string(t.name) + "<";
  for (size_t a = 0; a < args.size(); ++a) name += (a ? ", " : "") + args[a];
  return name + ">";
}

}  // namespace kivi
