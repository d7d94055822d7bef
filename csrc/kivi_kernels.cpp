// KIVI 2/4/8-bit quantize / dequantize kernels: the device source, compiled at RUN TIME by the
// sycl_ext_oneapi_kernel_compiler extension (there is no icpx on the build machines, so nothing is
// compiled ahead of time). setup.py embeds this file verbatim into a generated header.
//
// Semantics are those of kivi_xpu/ops/reference.py, bit for bit:
//   scale = meta((mx - mn) / qmax), zero = meta(mn)     (meta = cast to the metadata dtype, RNE)
//   q     = clamp(rint((x - zero32) / scale32), 0, qmax), q = 0 where scale32 == 0
//   a group with a non-finite input, scale or zero gets codes 0 and scale = zero = NaN
//   x'    = q * scale32 + zero32 (two roundings, no fma), cast to the output dtype
//
// Tensors arrive as raw byte pointers plus dtype tags (a branch that is uniform across the launch), so
// only four kernels are compiled instead of one per (data dtype x metadata dtype) combination.
// All index arithmetic is 64-bit; every kernel guards against the padded global range; no fp64 is used
// so that the same source is valid on Intel GPUs.

#include <sycl/sycl.hpp>

namespace syclext = sycl::ext::oneapi;
namespace syclexp = sycl::ext::oneapi::experimental;

// Dtype tags, shared with csrc/kivi_ext.cpp.
#define KIVI_F32 0
#define KIVI_F16 1
#define KIVI_BF16 2

namespace {

inline unsigned float_bits(float f) { return sycl::bit_cast<unsigned>(f); }
inline float bits_float(unsigned u) { return sycl::bit_cast<float>(u); }

// fp16 -> fp32 by bit manipulation (exact, subnormals included): independent of the device's half support.
inline float half_to_float(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  const unsigned exponent = (h >> 10) & 0x1Fu;
  unsigned mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));  // Inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);  // +-0
  // Subnormal: value = mantissa * 2^-24, exact in fp32.
  const float magnitude = (float)mantissa * bits_float(0x33800000u);  // 2^-24
  return bits_float(sign | float_bits(magnitude));
}

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

inline float load_float(const unsigned char* base, long long index, int dtype) {
  if (dtype == KIVI_F32) return reinterpret_cast<const float*>(base)[index];
  const unsigned short raw = reinterpret_cast<const unsigned short*>(base)[index];
  return dtype == KIVI_F16 ? half_to_float(raw) : bf16_to_float(raw);
}

inline void store_float(unsigned char* base, long long index, int dtype, float value) {
  if (dtype == KIVI_F32) {
    reinterpret_cast<float*>(base)[index] = value;
  } else {
    reinterpret_cast<unsigned short*>(base)[index] = dtype == KIVI_F16 ? float_to_half(value) : float_to_bf16(value);
  }
}

// Rounds to the metadata dtype and back, as torch's `.to(meta_dtype).float()` does.
inline float round_to_meta(float value, int meta_dtype) {
  if (meta_dtype == KIVI_F16) return half_to_float(float_to_half(value));
  if (meta_dtype == KIVI_BF16) return bf16_to_float(float_to_bf16(value));
  return value;
}

inline bool is_finite(float f) { return (float_bits(f) & 0x7F800000u) != 0x7F800000u; }

// Quotient and remainder of non-negative indices: 32-bit division whenever both fit (64-bit integer division is
// several times slower on CPUs and GPUs, and dominates the cheap dequantize kernels), 64-bit otherwise.
struct DivMod {
  long long quot, rem;
};

inline DivMod divmod(long long n, long long d) {
  if (n <= 0xFFFFFFFFll && d <= 0xFFFFFFFFll) {
    const unsigned q = (unsigned)n / (unsigned)d;
    return {(long long)q, (long long)((unsigned)n - q * (unsigned)d)};
  }
  const long long q = n / d;
  return {q, n - q * d};
}

// Min/max of one group of `count` elements strided by `stride`; `finite` is false if any element is
// NaN/Inf (fmin/fmax alone would silently skip a NaN).
struct GroupRange {
  float lo, hi;
  bool finite;
};

inline GroupRange group_range(const unsigned char* x, long long first, long long stride, long long count,
                              int x_dtype) {
  GroupRange r{load_float(x, first, x_dtype), load_float(x, first, x_dtype), true};
  for (long long i = 0; i < count; ++i) {
    const float v = load_float(x, first + i * stride, x_dtype);
    r.finite = r.finite && is_finite(v);
    r.lo = sycl::fmin(r.lo, v);
    r.hi = sycl::fmax(r.hi, v);
  }
  return r;
}

// Stored (metadata-rounded) scale and zero of a group, back in fp32; `valid` false -> codes 0, NaN meta.
struct GroupParams {
  float scale, zero;
  bool valid;
};

inline GroupParams group_params(const GroupRange& r, int bits, int meta_dtype) {
  const float qmax = (float)((1 << bits) - 1);
  GroupParams p;
  p.scale = round_to_meta((r.hi - r.lo) / qmax, meta_dtype);
  p.zero = round_to_meta(r.lo, meta_dtype);
  p.valid = r.finite && is_finite(p.scale) && is_finite(p.zero);
  return p;
}

inline unsigned quantize_one(float v, const GroupParams& p, int bits) {
  if (!p.valid || !(p.scale > 0.0f)) return 0u;
  const float qmax = (float)((1 << bits) - 1);
  const float q = sycl::fmin(sycl::fmax(sycl::rint((v - p.zero) / p.scale), 0.0f), qmax);
  return (unsigned)q;
}

inline void store_params(unsigned char* scales, unsigned char* zeros, long long index, int meta_dtype,
                         const GroupParams& p) {
  const float nan = bits_float(0x7FC00000u);
  store_float(scales, index, meta_dtype, p.valid ? p.scale : nan);
  store_float(zeros, index, meta_dtype, p.valid ? p.zero : nan);
}

// q * scale + zero as two separately rounded fp32 operations (the reference does not fuse them).
inline float dequantize_one(unsigned q, float scale, float zero) {
  const float product = (float)q * scale;  // not fused into an fma: built with -ffp-contract=off
  return product + zero;
}

}  // namespace

// Keys, per-channel groups. One work-item per (b, h, group g, channel d): it reads G tokens of channel d
// (adjacent work-items read adjacent channels, so loads coalesce on a GPU) and writes G/P code bytes.
//   x [B,H,T,D] -> codes [B,H,T/P,D], scales/zeros [B,H,T/G,D];  items = B*H*(T/G)*D.
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kivi_quantize_keys(const unsigned char* x, unsigned char* codes, unsigned char* scales, unsigned char* zeros,
                        long long items, long long tokens, long long head_dim, long long group_size, int bits,
                        int x_dtype, int meta_dtype) {
  const long long item = (long long)syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (item >= items) return;  // padding of the global range
  const long long groups_per_head = tokens / group_size;
  const DivMod by_channel = divmod(item, head_dim);
  const DivMod by_group = divmod(by_channel.quot, groups_per_head);
  const long long d = by_channel.rem, group = by_group.rem, head = by_group.quot;  // head: flattened (b, h)
  const long long first = (head * tokens + group * group_size) * head_dim + d;

  const GroupParams p = group_params(group_range(x, first, head_dim, group_size, x_dtype), bits, meta_dtype);
  store_params(scales, zeros, item, meta_dtype, p);

  const int per_byte = 8 / bits;
  const long long code_row0 = (head * tokens + group * group_size) / per_byte;  // first packed row of the group
  for (long long row = 0; row < group_size / per_byte; ++row) {
    unsigned byte = 0;
    for (int k = 0; k < per_byte; ++k) {
      const float v = load_float(x, first + (row * per_byte + k) * head_dim, x_dtype);
      byte |= quantize_one(v, p, bits) << (k * bits);
    }
    codes[(code_row0 + row) * head_dim + d] = (unsigned char)byte;
  }
}

// Values, per-token groups. One work-item per (b, h, t, group g) of G consecutive channels.
//   x [B,H,T,D] -> codes [B,H,T,D/P], scales/zeros [B,H,T,D/G];  items = B*H*T*(D/G).
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kivi_quantize_values(const unsigned char* x, unsigned char* codes, unsigned char* scales, unsigned char* zeros,
                          long long items, long long group_size, int bits, int x_dtype, int meta_dtype) {
  const long long item = (long long)syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (item >= items) return;
  const long long first = item * group_size;  // groups tile each row of D channels, so this is flat

  const GroupParams p = group_params(group_range(x, first, 1, group_size, x_dtype), bits, meta_dtype);
  store_params(scales, zeros, item, meta_dtype, p);

  const int per_byte = 8 / bits;
  for (long long j = 0; j < group_size / per_byte; ++j) {
    unsigned byte = 0;
    for (int k = 0; k < per_byte; ++k) byte |= quantize_one(load_float(x, first + j * per_byte + k, x_dtype), p, bits) << (k * bits);
    codes[first / per_byte + j] = (unsigned char)byte;
  }
}

// Keys. One work-item per code byte of the first num_tokens tokens: (b, h, packed row r, channel d).
// Buffers may be over-allocated along dim 2, so the per-head strides use their capacities.
//   codes [B,H,code_rows,D], scales/zeros [B,H,meta_rows,D] -> out [B,H,N,D];  items = B*H*(N/P)*D.
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kivi_dequantize_keys(const unsigned char* codes, const unsigned char* scales, const unsigned char* zeros,
                          unsigned char* out, long long items, long long num_tokens, long long head_dim,
                          long long code_rows, long long meta_rows, long long group_size, int bits, int meta_dtype,
                          int out_dtype) {
  const long long item = (long long)syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (item >= items) return;
  const int per_byte = 8 / bits;
  const long long rows = num_tokens / per_byte;
  const DivMod by_channel = divmod(item, head_dim);
  const DivMod by_row = divmod(by_channel.quot, rows);
  const long long d = by_channel.rem, row = by_row.rem, head = by_row.quot;
  const long long token0 = row * per_byte;
  const long long group = divmod(token0, group_size).quot;  // a byte never spans two groups
  const long long meta_index = (head * meta_rows + group) * head_dim + d;
  const float scale = load_float(scales, meta_index, meta_dtype);
  const float zero = load_float(zeros, meta_index, meta_dtype);
  const unsigned byte = codes[(head * code_rows + row) * head_dim + d];
  const unsigned mask = (1u << bits) - 1u;
  for (int k = 0; k < per_byte; ++k) {
    const long long out_index = (head * num_tokens + token0 + k) * head_dim + d;
    store_float(out, out_index, out_dtype, dequantize_one((byte >> (k * bits)) & mask, scale, zero));
  }
}

// Values. One work-item per code byte of the first num_tokens tokens: (b, h, t, byte j).
//   codes [B,H,code_rows,D/P], scales/zeros [B,H,meta_rows,D/G] -> out [B,H,N,D];  items = B*H*N*(D/P).
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kivi_dequantize_values(const unsigned char* codes, const unsigned char* scales, const unsigned char* zeros,
                            unsigned char* out, long long items, long long num_tokens, long long head_dim,
                            long long code_rows, long long meta_rows, long long group_size, int bits,
                            int meta_dtype, int out_dtype) {
  const long long item = (long long)syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (item >= items) return;
  const int per_byte = 8 / bits;
  const long long bytes_per_token = head_dim / per_byte;
  const long long groups_per_token = head_dim / group_size;
  const DivMod by_byte = divmod(item, bytes_per_token);
  const DivMod by_token = divmod(by_byte.quot, num_tokens);
  const long long j = by_byte.rem, token = by_token.rem, head = by_token.quot;
  const long long channel0 = j * per_byte;
  const long long meta_index = (head * meta_rows + token) * groups_per_token + divmod(channel0, group_size).quot;
  const float scale = load_float(scales, meta_index, meta_dtype);
  const float zero = load_float(zeros, meta_index, meta_dtype);
  const unsigned byte = codes[(head * code_rows + token) * bytes_per_token + j];
  const unsigned mask = (1u << bits) - 1u;
  for (int k = 0; k < per_byte; ++k) {
    const long long out_index = (head * num_tokens + token) * head_dim + channel0 + k;
    store_float(out, out_index, out_dtype, dequantize_one((byte >> (k * bits)) & mask, scale, zero));
  }
}
