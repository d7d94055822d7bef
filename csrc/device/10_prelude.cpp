// The SYCL device source of kivi_xpu._C, first part: the rules every kernel follows and the element types.
//
// The device source is the files of csrc/device/ concatenated in the order of their names (csrc/README.md):
// setup.py embeds that concatenation as the one string kKiviKernelSource, which the sycl_ext_oneapi_kernel_compiler
// extension compiles at RUN TIME (there is no icpx on the build machines, so nothing is compiled ahead of time). A
// part uses what the parts before it define and includes nothing itself; only this one includes sycl.hpp.
//
// Performance rules the kernels follow (found on the OpenCL CPU device, which vectorises ACROSS work-items along the
// last nd_range dimension; the same layout coalesces on Intel GPUs):
//   * each kernel is a template over its element types (for attention also bits and rows per item); the runtime
//     instantiates every variant listed in csrc/kivi_variants.h, so the element type is a compile-time constant
//     in every hot loop (no per-element dtype branch: on the CPU device a uniform dispatch inside one attention
//     kernel slowed its vectorised loop down);
//   * 3-D nd_ranges whose indices come from the nd_item: the channel (or byte) index is the LAST dimension,
//     so adjacent work-items touch adjacent addresses (vector loads / stores, coalescing on a GPU), and
//     everything derived from the other dimensions is uniform across the vector (scalar arithmetic; no
//     per-item integer division, which does not vectorise);
//   * enough work per item: a key item walks a whole group of tokens with its scale/zero in registers.
// Every kernel guards the padded last dimension; no fp64 is used, no sub-group size is assumed, so the same
// source is valid on Intel GPUs.

#include <sycl/sycl.hpp>

namespace syclext = sycl::ext::oneapi;
namespace syclexp = sycl::ext::oneapi::experimental;

namespace {

inline unsigned float_bits(float f) { return sycl::bit_cast<unsigned>(f); }
inline float bits_float(unsigned u) { return sycl::bit_cast<float>(u); }

// fp16 -> fp32: exact (every fp16 value, subnormals included, is an fp32 value), so the hardware conversion gives
// the same bits as any software decode (F16C / AVX-512 vcvtph2ps on a CPU, native on Intel GPUs) at a fraction of
// the ~20 branchy instructions of a bit-manipulation decode. Only fp16 -> fp32 goes through sycl::half; the
// rounding direction (float_to_half below) stays explicit.
inline float half_to_float(unsigned short h) { return static_cast<float>(sycl::bit_cast<sycl::half>(h)); }

// fp32 -> fp16 with round-to-nearest-even, overflow to Inf, gradual underflow; NaN -> quiet NaN
// (0x7E00 for a positive NaN, as torch stores float('nan') in float16).
inline unsigned short float_to_half(float f) {
  const unsigned u = float_bits(f);
  const unsigned short sign = (unsigned short)((u >> 16) & 0x8000u);
  const unsigned abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return (unsigned short)(sign | 0x7E00u);  // NaN
  if (abs_bits >= 0x477FF000u) return (unsigned short)(sign | 0x7C00u);  // rounds to >= 65520: Inf
  if (abs_bits >= 0x38800000u) {                                         // normal fp16 range (>= 2^-14)
    const unsigned rounded = abs_bits + 0xFFFu + ((abs_bits >> 13) & 1u);  // RNE on the dropped 13 bits
    return (unsigned short)(sign | ((rounded - 0x38000000u) >> 13));      // rebias exponent 127 -> 15
  }
  // Subnormal or zero fp16: value = m * 2^-24 with m = rint(|f| * 2^24). Exact in fp32: |f| < 2^-14
  // and the scaling by a power of two is exact; rint is round-half-to-even.
  const float m = sycl::rint(bits_float(abs_bits) * bits_float(0x4B800000u));  // * 2^24
  return (unsigned short)(sign | (unsigned short)m);
}

inline float bf16_to_float(unsigned short b) { return bits_float((unsigned)b << 16); }

// fp32 -> bf16 with round-to-nearest-even; NaN -> 0x7FC0 (torch's c10::BFloat16 rule).
inline unsigned short float_to_bf16(float f) {
  const unsigned u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

// Element types as tag structs: storage type plus exact conversions to / from fp32. Outside the anonymous namespace:
// they are template arguments of the kernels, whose instantiations must have external linkage to be found by name.
struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F16 {
  using T = unsigned short;
  static float load(T v) { return half_to_float(v); }
  static T store(float v) { return float_to_half(v); }
};
struct BF16 {
  using T = unsigned short;
  static float load(T v) { return bf16_to_float(v); }
  static T store(float v) { return float_to_bf16(v); }
};
