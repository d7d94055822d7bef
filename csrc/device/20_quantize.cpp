// SYCL device source (csrc/device/, after 10_prelude.cpp): the KIVI quantizer, its group arithmetic and the
// quantize / dequantize kernels of keys and values at 2, 4 or 8 bits.
//
// Semantics are those of kivi_xpu/ops/reference.py, bit for bit:
//   scale = meta((mx - mn) / qmax), zero = meta(mn)     (meta = cast to the metadata dtype, RNE)
//   q     = clamp(rint((x - zero32) / scale32), 0, qmax), q = 0 where scale32 == 0
//   a group with a non-finite input, scale or zero gets codes 0 and scale = zero = NaN
//   x'    = q * scale32 + zero32 (two roundings, no fma), cast to the output dtype
//   refit (fit="least_squares"): the line refit to the min-max codes, then quantized again (refit_group)

namespace {

// Rounds to the metadata dtype and back, as torch's `.to(meta_dtype).float()` does.
template <typename M>
inline float round_to(float value) {
  return M::load(M::store(value));
}

inline bool is_finite(float f) { return (float_bits(f) & 0x7F800000u) != 0x7F800000u; }

// Min/max of one group; `finite` is false if any element is NaN/Inf (fmin/fmax alone would skip a NaN).
struct GroupRange {
  float lo, hi;
  bool finite;
};

template <typename X>
inline GroupRange group_range(const typename X::T* x, size_t stride, size_t count) {
  GroupRange r{X::load(x[0]), X::load(x[0]), true};
  for (size_t i = 0; i < count; ++i) {
    const float v = X::load(x[i * stride]);
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

template <typename M>
inline GroupParams group_params(const GroupRange& r, float qmax) {
  GroupParams p;
  p.scale = round_to<M>((r.hi - r.lo) / qmax);
  p.zero = round_to<M>(r.lo);
  p.valid = r.finite && is_finite(p.scale) && is_finite(p.zero);
  return p;
}

inline unsigned quantize_one(float v, const GroupParams& p, float qmax) {
  if (!p.valid || !(p.scale > 0.0f)) return 0u;
  const float q = sycl::fmin(sycl::fmax(sycl::rint((v - p.zero) / p.scale), 0.0f), qmax);
  return (unsigned)q;
}

// fit="least_squares" (kivi_xpu/ops/reference.py): the least-squares line through the group's min-max codes where it
// is usable, else `p`. The sums are added in element order and each product rounded, as the reference adds them.
template <typename X, typename M>
inline GroupParams refit_group(const typename X::T* x, size_t stride, size_t count, const GroupParams& p, float qmax) {
  float sq = 0.0f, sqq = 0.0f, sx = 0.0f, sqx = 0.0f;
  for (size_t i = 0; i < count; ++i) {
    const float v = X::load(x[i * stride]);
    const float q = (float)quantize_one(v, p, qmax);
    sq = sq + q, sqq = sqq + q * q, sx = sx + v, sqx = sqx + q * v;  // from +0, as quantize_impl.h's FitSums
  }
  const float n = (float)count;
  const float det = n * sqq - sq * sq;
  if (!(det > 0.0f)) return p;
  const float slope = (n * sqx - sq * sx) / det;
  const float scale = round_to<M>(slope), zero = round_to<M>((sx - slope * sq) / n);
  if (!(scale > 0.0f) || !is_finite(scale) || !is_finite(zero)) return p;
  return GroupParams{scale, zero, p.valid};
}

template <typename M>
inline void store_params(unsigned char* scales, unsigned char* zeros, size_t index, const GroupParams& p) {
  const float nan = bits_float(0x7FC00000u);
  reinterpret_cast<typename M::T*>(scales)[index] = M::store(p.valid ? p.scale : nan);
  reinterpret_cast<typename M::T*>(zeros)[index] = M::store(p.valid ? p.zero : nan);
}

// q * scale + zero as two separately rounded fp32 operations (the reference does not fuse them).
inline float dequantize_one(unsigned q, float scale, float zero) {
  const float product = (float)q * scale;  // not fused into an fma: built with -ffp-contract=off
  return product + zero;
}

}  // namespace

// Keys, per-channel groups, stored channel-major. nd_range {B*H, T/G, D (padded)}: one item per (head, group,
// channel d) reads the G tokens of channel d (contiguous across lanes: adjacent d) twice (min/max, then codes; the
// second pass hits cache) and writes the group's G/P code bytes, which are contiguous for the item but T/P apart
// across lanes (a scatter; quantize runs once per block of tokens). With `words` (G/P a multiple of 4 and a 4-byte
// aligned buffer) the bytes go out as 32-bit words: a quarter of the scattered stores, and no byte scatter.
//   x [B,H,T,D] -> codes [B,H,D,T/P], scales/zeros [B,H,D,T/G].
template <typename X, typename M>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_quantize_keys(
    const unsigned char* x_bytes, unsigned char* codes, unsigned char* scales, unsigned char* zeros, size_t tokens,
    size_t head_dim, size_t group_size, int bits, int words, int refit) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const size_t d = it.get_global_id(2);
  if (d >= head_dim) return;  // padding of the last dimension
  const size_t head = it.get_global_id(0), group = it.get_global_id(1);
  const typename X::T* x =
      reinterpret_cast<const typename X::T*>(x_bytes) + (head * tokens + group * group_size) * head_dim + d;

  const float qmax = (float)((1 << bits) - 1);
  GroupParams p = group_params<M>(group_range<X>(x, head_dim, group_size), qmax);
  if (refit) p = refit_group<X, M>(x, head_dim, group_size, p, qmax);
  const size_t groups = tokens / group_size;
  store_params<M>(scales, zeros, (head * head_dim + d) * groups + group, p);

  const int per_byte = 8 / bits;
  const size_t bytes_per_group = group_size / per_byte;
  unsigned char* out = codes + (head * head_dim + d) * (tokens / per_byte) + group * bytes_per_group;
  if (words) {
    unsigned* out_words = reinterpret_cast<unsigned*>(out);
    const int per_word = 4 * per_byte;
    for (size_t w = 0; w < bytes_per_group / 4; ++w) {
      unsigned word = 0;
      for (int k = 0; k < per_word; ++k)
        word |= quantize_one(X::load(x[(w * per_word + k) * head_dim]), p, qmax) << (k * bits);
      out_words[w] = word;
    }
    return;
  }
  for (size_t j = 0; j < bytes_per_group; ++j) {
    unsigned byte = 0;
    for (int k = 0; k < per_byte; ++k)
      byte |= quantize_one(X::load(x[(j * per_byte + k) * head_dim]), p, qmax) << (k * bits);
    out[j] = (unsigned char)byte;
  }
}

// Values, per-token groups. 1-D nd_range over B*H*T*(D/G) groups (padded): one item per group of G
// consecutive channels. Groups tile the rows, so the item index is the flat group index (no division).
//   x [B,H,T,D] -> codes [B,H,T,D/P], scales/zeros [B,H,T,D/G].
template <typename X, typename M>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>)) void kivi_quantize_values(
    const unsigned char* x_bytes, unsigned char* codes, unsigned char* scales, unsigned char* zeros, size_t groups,
    size_t group_size, int bits, int refit) {
  const size_t item = syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (item >= groups) return;
  const typename X::T* x = reinterpret_cast<const typename X::T*>(x_bytes) + item * group_size;

  const float qmax = (float)((1 << bits) - 1);
  GroupParams p = group_params<M>(group_range<X>(x, 1, group_size), qmax);
  if (refit) p = refit_group<X, M>(x, 1, group_size, p, qmax);
  store_params<M>(scales, zeros, item, p);

  const int per_byte = 8 / bits;
  unsigned char* out = codes + item * (group_size / per_byte);
  for (size_t j = 0; j < group_size / per_byte; ++j) {
    unsigned byte = 0;
    for (int k = 0; k < per_byte; ++k) byte |= quantize_one(X::load(x[j * per_byte + k]), p, qmax) << (k * bits);
    out[j] = (unsigned char)byte;
  }
}

// Keys. nd_range {B*H, N/G, D (padded)}: one item per (head, group, channel d) loads its scale/zero once and
// expands the group's G/P code bytes of channel d (contiguous for the item; a gather across lanes, as 32-bit words
// when `words`, see kivi_quantize_keys) into G outputs, stored contiguously across lanes. Buffers may be over-allocated
// along their last dim, so the per-channel strides are their capacities (code_cols bytes, meta_cols groups).
//   codes [B,H,D,code_cols], scales/zeros [B,H,D,meta_cols] -> out [B,H,N,D].
template <typename M, typename O>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_dequantize_keys(
    const unsigned char* codes, const unsigned char* scales, const unsigned char* zeros, unsigned char* out_bytes,
    size_t num_tokens, size_t head_dim, size_t code_cols, size_t meta_cols, size_t group_size, int bits, int words) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const size_t d = it.get_global_id(2);
  if (d >= head_dim) return;
  const size_t head = it.get_global_id(0), group = it.get_global_id(1);
  const size_t meta_index = (head * head_dim + d) * meta_cols + group;
  const float scale = M::load(reinterpret_cast<const typename M::T*>(scales)[meta_index]);
  const float zero = M::load(reinterpret_cast<const typename M::T*>(zeros)[meta_index]);
  const int per_byte = 8 / bits;
  const unsigned mask = (1u << bits) - 1u;
  const size_t bytes_per_group = group_size / per_byte;
  const unsigned char* in = codes + (head * head_dim + d) * code_cols + group * bytes_per_group;
  typename O::T* out =
      reinterpret_cast<typename O::T*>(out_bytes) + (head * num_tokens + group * group_size) * head_dim + d;
  if (words) {
    const unsigned* in_words = reinterpret_cast<const unsigned*>(in);
    const int per_word = 4 * per_byte;
    for (size_t w = 0; w < bytes_per_group / 4; ++w) {
      const unsigned word = in_words[w];
      for (int k = 0; k < per_word; ++k)
        out[(w * per_word + k) * head_dim] = O::store(dequantize_one((word >> (k * bits)) & mask, scale, zero));
    }
    return;
  }
  for (size_t j = 0; j < bytes_per_group; ++j) {
    const unsigned byte = in[j];
    for (int k = 0; k < per_byte; ++k)
      out[(j * per_byte + k) * head_dim] = O::store(dequantize_one((byte >> (k * bits)) & mask, scale, zero));
  }
}

// Values. nd_range {B*H, N, D (padded)}: one item per output element (head, token, channel c), so stores are
// contiguous. Lane l of a sub-group needs code byte c/P and group c/G: indices that repeat across lanes, which a
// CPU would load with gathers (slow; no byte gather at all). Instead each lane loads ONE CONTIGUOUS byte / scale /
// zero counting from lane 0's, and takes its own by a sub-group shuffle: with consecutive channels in a sub-group,
// c/P - c0/P <= c - c0 = l < sub-group size, for any sub-group size. No early return before the shuffles.
//   codes [B,H,code_rows,D/P], scales/zeros [B,H,meta_rows,D/G] -> out [B,H,N,D].
template <typename M, typename O>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_dequantize_values(
    const unsigned char* codes, const unsigned char* scales, const unsigned char* zeros, unsigned char* out_bytes,
    size_t num_tokens, size_t head_dim, size_t code_rows, size_t meta_rows, size_t group_size, int group_shift,
    int bits) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const sycl::sub_group sg = it.get_sub_group();
  const size_t head = it.get_global_id(0), token = it.get_global_id(1);
  const unsigned lane = (unsigned)sg.get_local_linear_id();
  const unsigned c = (unsigned)it.get_global_id(2);  // head_dim < 2^32 (checked on the host)
  const unsigned c0 = c - lane;                      // channel of the sub-group's lane 0
  const unsigned byte_shift = bits == 2 ? 2 : bits == 4 ? 1 : 0;  // log2(codes per byte)
  const unsigned bytes_per_token = (unsigned)head_dim >> byte_shift;
  const unsigned groups_per_token = (unsigned)(head_dim / group_size);
  // Group of a channel: a shift when G is a power of two (uniform branch), else a division.
  const unsigned g = group_shift >= 0 ? c >> group_shift : c / (unsigned)group_size;
  const unsigned g0 = group_shift >= 0 ? c0 >> group_shift : c0 / (unsigned)group_size;

  const unsigned my_byte = (c0 >> byte_shift) + lane, my_group = g0 + lane;  // contiguous across lanes
  const unsigned char* code_row = codes + (head * code_rows + token) * bytes_per_token;
  const size_t meta_row = (head * meta_rows + token) * groups_per_token;
  const unsigned loaded_byte = my_byte < bytes_per_token ? code_row[my_byte] : 0u;
  const bool has_group = my_group < groups_per_token;
  const typename M::T* scale_row = reinterpret_cast<const typename M::T*>(scales) + meta_row;
  const typename M::T* zero_row = reinterpret_cast<const typename M::T*>(zeros) + meta_row;
  const float loaded_scale = has_group ? M::load(scale_row[my_group]) : 0.0f;
  const float loaded_zero = has_group ? M::load(zero_row[my_group]) : 0.0f;

  const unsigned byte = sycl::select_from_group(sg, loaded_byte, (c >> byte_shift) - (c0 >> byte_shift));
  const float scale = sycl::select_from_group(sg, loaded_scale, g - g0);
  const float zero = sycl::select_from_group(sg, loaded_zero, g - g0);
  if (c >= head_dim) return;  // padding of the last dimension (after the collective shuffles)
  const unsigned q = (byte >> ((c & ((1u << byte_shift) - 1u)) * (unsigned)bits)) & ((1u << bits) - 1u);
  reinterpret_cast<typename O::T*>(out_bytes)[(head * num_tokens + token) * head_dim + c] =
      O::store(dequantize_one(q, scale, zero));
}
