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
// Performance rules this file follows (measured on the OpenCL CPU device, which vectorises ACROSS
// work-items along the last nd_range dimension; the same layout coalesces on Intel GPUs):
//   * each kernel is a template over its element types (for attention also bits and rows per item); the runtime
//     instantiates every variant listed in csrc/kivi_variants.h, so the element type is a compile-time constant
//     in every hot loop (no per-element dtype branch; on the CPU device a uniform dispatch inside one attention
//     kernel made its vectorised loop 25-50% slower);
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

// ---- kernels: one template each; csrc/kivi_variants.h lists the instantiations the runtime compiles ------------

// Keys, per-channel groups, stored channel-major. nd_range {B*H, T/G, D (padded)}: one item per (head, group,
// channel d) reads the G tokens of channel d (contiguous across lanes: adjacent d) twice (min/max, then codes; the
// second pass hits cache) and writes the group's G/P code bytes, which are contiguous for the item but T/P apart
// across lanes (a scatter; quantize runs once per block of tokens). With `words` (G/P a multiple of 4 and a 4-byte
// aligned buffer) the bytes go out as 32-bit words: a quarter of the scattered stores, and no byte scatter.
//   x [B,H,T,D] -> codes [B,H,D,T/P], scales/zeros [B,H,D,T/G].
template <typename X, typename M>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_quantize_keys(
    const unsigned char* x_bytes, unsigned char* codes, unsigned char* scales, unsigned char* zeros, size_t tokens,
    size_t head_dim, size_t group_size, int bits, int words) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const size_t d = it.get_global_id(2);
  if (d >= head_dim) return;  // padding of the last dimension
  const size_t head = it.get_global_id(0), group = it.get_global_id(1);
  const typename X::T* x =
      reinterpret_cast<const typename X::T*>(x_bytes) + (head * tokens + group * group_size) * head_dim + d;

  const float qmax = (float)((1 << bits) - 1);
  const GroupParams p = group_params<M>(group_range<X>(x, head_dim, group_size), qmax);
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
    for (int k = 0; k < per_byte; ++k) byte |= quantize_one(X::load(x[(j * per_byte + k) * head_dim]), p, qmax) << (k * bits);
    out[j] = (unsigned char)byte;
  }
}

// Values, per-token groups. 1-D nd_range over B*H*T*(D/G) groups (padded): one item per group of G
// consecutive channels. Groups tile the rows, so the item index is the flat group index (no division).
//   x [B,H,T,D] -> codes [B,H,T,D/P], scales/zeros [B,H,T,D/G].
template <typename X, typename M>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>)) void kivi_quantize_values(
    const unsigned char* x_bytes, unsigned char* codes, unsigned char* scales, unsigned char* zeros, size_t groups,
    size_t group_size, int bits) {
  const size_t item = syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (item >= groups) return;
  const typename X::T* x = reinterpret_cast<const typename X::T*>(x_bytes) + item * group_size;

  const float qmax = (float)((1 << bits) - 1);
  const GroupParams p = group_params<M>(group_range<X>(x, 1, group_size), qmax);
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
  typename O::T* out = reinterpret_cast<typename O::T*>(out_bytes) + (head * num_tokens + group * group_size) * head_dim + d;
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
  const float loaded_scale = has_group ? M::load(reinterpret_cast<const typename M::T*>(scales)[meta_row + my_group]) : 0.0f;
  const float loaded_zero = has_group ? M::load(reinterpret_cast<const typename M::T*>(zeros)[meta_row + my_group]) : 0.0f;

  const unsigned byte = sycl::select_from_group(sg, loaded_byte, (c >> byte_shift) - (c0 >> byte_shift));
  const float scale = sycl::select_from_group(sg, loaded_scale, g - g0);
  const float zero = sycl::select_from_group(sg, loaded_zero, g - g0);
  if (c >= head_dim) return;  // padding of the last dimension (after the collective shuffles)
  const unsigned q = (byte >> ((c & ((1u << byte_shift) - 1u)) * (unsigned)bits)) & ((1u << bits) - 1u);
  reinterpret_cast<typename O::T*>(out_bytes)[(head * num_tokens + token) * head_dim + c] =
      O::store(dequantize_one(q, scale, zero));
}

// ---- fused attention on the packed history ---------------------------------------------------------------------
//
// Both ops dequantize each code ONCE and use it for every query row that reads the same kv head (the query heads of a
// GQA group times the query length: R = (Hq/Hkv)*L consecutive rows of the [B,Hq,L,*] operands), RB <= 4 rows per
// work-item (accumulators in registers; a partial last block re-reads its last row and skips its stores).
// Lanes (the last nd_range dimension) walk consecutive code BYTES, so code loads are contiguous, and all per-row data
// (query / probabilities) are uniform scalars. A lane's scale/zero come from a sub-group shuffle, as in
// dequantize_values: lane l loads the l-th group counting from the group of the sub-group's first byte (contiguous,
// masked: one vector load + conversion), then takes its own group's by select_from_group (one permute on a CPU). Its
// group is at most l groups past the first one (a group holds >= 1 byte), so the source lane exists for any
// sub-group size. Padding lanes skip their loads and stores but no early return (they must join the shuffles).
// Uniform values are combined with plain operators and ternaries, never sycl::min & co.: the CPU vectorizer does not
// know those builtins preserve uniformity, so their results become per-lane vectors (a loop bound turns into a masked
// divergent loop, a row index into gathers).

namespace {

// Where a lane finds its group's metadata: the sub-group's first group, the lane's own load slot and shuffle source.
struct LaneGroup {
  size_t first;  // group of the sub-group's first byte (uniform)
  size_t slot;   // group this lane loads: first + lane (contiguous across lanes)
  bool loads;    // slot < number of groups (masked load)
  unsigned src;  // lane holding this lane's group
};

// `j` is the lane's byte, `groups` the number of groups along the byte axis. The sub-group's first byte is computed
// from uniform ids (j - lane would be per-lane data to the CPU vectorizer, and so would every index derived from it).
// lane_group_at takes the sub-group's first byte `sg_first` (uniform) explicitly: the fused kernel's lanes walk a
// chunk in steps of the work-group, so its bytes are not its global ids.
inline LaneGroup lane_group_at(const sycl::sub_group& sg, size_t j, size_t sg_first, size_t bytes_per_group,
                               size_t groups) {
  LaneGroup lg;
  lg.first = sg_first / bytes_per_group;
  lg.slot = lg.first + sg.get_local_linear_id();
  lg.loads = lg.slot < groups;
  lg.src = (unsigned)(j / bytes_per_group - lg.first);
  return lg;
}

inline LaneGroup lane_group(const sycl::nd_item<3>& it, const sycl::sub_group& sg, size_t j, size_t bytes_per_group,
                            size_t groups) {
  const size_t sg_first = it.get_group(2) * it.get_local_range(2) +
                          (size_t)sg.get_group_linear_id() * (size_t)sg.get_max_local_range()[0];
  return lane_group_at(sg, j, sg_first, bytes_per_group, groups);
}

// Scale and zero of the lane's group from one metadata row (scales/zeros point at group 0 of the row).
template <typename M>
inline void lane_meta(const sycl::sub_group& sg, const LaneGroup& lg, const typename M::T* scales,
                      const typename M::T* zeros, float& scale, float& zero) {
  const float s = lg.loads ? M::load(scales[lg.slot]) : 0.0f;
  const float z = lg.loads ? M::load(zeros[lg.slot]) : 0.0f;
  scale = sycl::select_from_group(sg, s, lg.src);
  zero = sycl::select_from_group(sg, z, lg.src);
}

// Dequantizes the P codes of `byte` with `scale`/`zero`, then adds weight(r) * code k into acc[r][k] for the RB rows
// of uniform weights weights[r * stride] (a partial last block re-reads row `last`).
template <int bits, int RB>
inline void accumulate_codes(unsigned byte, float scale, float zero, const float* weights, size_t stride, size_t last,
                             float (&acc)[RB][8 / bits]) {
  constexpr int P = 8 / bits;
  constexpr unsigned mask = (1u << bits) - 1u;
  float code[P];
  for (int k = 0; k < P; ++k) code[k] = sycl::fma((float)((byte >> (k * bits)) & mask), scale, zero);
  for (int r = 0; r < RB; ++r) {
    const float weight = weights[((size_t)r < last ? (size_t)r : last) * stride];
    for (int k = 0; k < P; ++k) acc[r][k] = sycl::fma(weight, code[k], acc[r][k]);
  }
}

// accumulate_codes with the lane's group's scale/zero from the metadata row at scales/zeros (by sub-group shuffle).
template <typename M, int bits, int RB>
inline void accumulate_byte(const sycl::sub_group& sg, const LaneGroup& lg, unsigned byte, const typename M::T* scales,
                            const typename M::T* zeros, const float* weights, size_t stride, size_t last,
                            float (&acc)[RB][8 / bits]) {
  float scale, zero;
  lane_meta<M>(sg, lg, scales, zeros, scale, zero);
  accumulate_codes<bits, RB>(byte, scale, zero, weights, stride, last, acc);
}

}  // namespace

// Scores. nd_range {B*Hkv, ceil(R/RB), Tk/P (padded)}: item = (kv head, block of RB query rows, code byte j of the
// token axis, i.e. tokens P*j .. P*j+P-1). For each channel d it loads byte j of channel d's code row (contiguous
// across lanes), dequantizes its P codes with the group's scale/zero and accumulates query[row][d] * key into P
// scores per row. Stores: out[row][P*j + k] (P consecutive floats per lane; once per item, so the scatter is cheap
// next to the channel loop: writing them as contiguous vectors through sub-group shuffles measured no faster).
//   query [B,Hq,L,D] f32, codes [B,Hkv,D,code_cols], scales/zeros [B,Hkv,D,meta_cols] -> out [B,Hq,L,Tk] f32.
template <typename M, int bits, int RB>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_packed_key_scores(
    const float* query, const unsigned char* codes, const typename M::T* scales, const typename M::T* zeros,
    float* out, size_t rows, size_t num_tokens, size_t head_dim, size_t code_cols, size_t meta_cols,
    size_t group_size) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const sycl::sub_group sg = it.get_sub_group();
  constexpr int P = 8 / bits;  // codes per byte
  const size_t total_bytes = num_tokens / P;
  const size_t j = it.get_global_id(2);
  const bool active = j < total_bytes;  // padding lanes load and store nothing, but join the shuffles
  const size_t kv = it.get_global_id(0), row0 = it.get_global_id(1) * RB;
  const LaneGroup lg = lane_group(it, sg, j, group_size / P, num_tokens / group_size);

  // Query rows addressed by uniform scalar arithmetic (an array of row pointers would be per-lane data, and the
  // uniform loads from it gathers); a partial last block re-reads its last row.
  const float* q0 = query + (kv * rows + row0) * head_dim;
  const size_t last = rows - 1 - row0;
  float acc[RB][P];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < P; ++k) acc[r][k] = 0.0f;
  const unsigned char* code_row = codes + kv * head_dim * code_cols + j;
  const typename M::T* scale_row = scales + kv * head_dim * meta_cols;
  const typename M::T* zero_row = zeros + kv * head_dim * meta_cols;
  for (size_t d = 0; d < head_dim; ++d) {
    const unsigned byte = active ? code_row[d * code_cols] : 0u;
    accumulate_byte<M, bits, RB>(sg, lg, byte, scale_row + d * meta_cols, zero_row + d * meta_cols, q0 + d, head_dim,
                                 last, acc);
  }
  if (!active) return;
  for (int r = 0; r < RB; ++r) {
    if (row0 + r >= rows) break;  // uniform
    float* o = out + (kv * rows + row0 + r) * num_tokens + j * P;
    for (int k = 0; k < P; ++k) o[k] = acc[r][k];
  }
}

// Value combine. nd_range {B*Hkv, ceil(R/RB) * chunks, D/P (padded)}: item = (kv head, block of RB probability rows,
// token chunk, code byte w of a token row, i.e. channels P*w .. P*w+P-1). For each token t of its chunk it loads byte
// w of token t's code row (contiguous across lanes), dequantizes its P codes and accumulates probs[row][t] * value.
// Stores partial sums partial[row][chunk][P*w + k]; the host sums the chunks in order.
//   probs [B,Hq,L,Tv] f32, codes [B,Hkv,code_rows,D/P], scales/zeros [B,Hkv,meta_rows,D/G]
//   -> partial [B,Hq,L,chunks,D] f32.
template <typename M, int bits, int RB>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_packed_value_combine(
    const float* probs, const unsigned char* codes, const typename M::T* scales, const typename M::T* zeros,
    float* partial, size_t rows, size_t num_tokens, size_t head_dim, size_t code_rows, size_t meta_rows,
    size_t group_size, size_t chunk_tokens, size_t chunks) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const sycl::sub_group sg = it.get_sub_group();
  constexpr int P = 8 / bits;
  const size_t row_bytes = head_dim / P;
  const size_t w = it.get_global_id(2);
  const bool active = w < row_bytes;  // padding lanes load nothing and store nothing, but join the shuffles
  const size_t kv = it.get_global_id(0);
  const size_t block = it.get_global_id(1) / chunks, chunk = it.get_global_id(1) % chunks;  // uniform
  const size_t row0 = block * RB;
  const size_t groups = head_dim / group_size;
  const LaneGroup lg = lane_group(it, sg, w, group_size / P, groups);

  const float* p0 = probs + (kv * rows + row0) * num_tokens;  // uniform rows, as in kivi_packed_key_scores
  const size_t last = rows - 1 - row0;
  float acc[RB][P];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < P; ++k) acc[r][k] = 0.0f;
  const size_t t_begin = chunk * chunk_tokens;
  const size_t t_end = t_begin + chunk_tokens < num_tokens ? t_begin + chunk_tokens : num_tokens;
  const unsigned char* code_col = codes + kv * code_rows * row_bytes + w;
  const typename M::T* scale_rows = scales + kv * meta_rows * groups;
  const typename M::T* zero_rows = zeros + kv * meta_rows * groups;
  // Two tokens per iteration (then an odd last one): halves the loop and address overhead of a body that is only
  // ~30 vector instructions per token.
  const auto add_token = [&](size_t t) {
    const unsigned byte = active ? code_col[t * row_bytes] : 0u;
    accumulate_byte<M, bits, RB>(sg, lg, byte, scale_rows + t * groups, zero_rows + t * groups, p0 + t, num_tokens,
                                 last, acc);
  };
  size_t t = t_begin;
  for (; t + 1 < t_end; t += 2) {
    add_token(t);
    add_token(t + 1);
  }
  if (t < t_end) add_token(t);  // uniform
  if (!active) return;
  // Channel order (P floats per lane, strided across lanes): written once per chunk, so the scatter is cheap next to
  // the token loop, and the host needs no transposing copy.
  for (int r = 0; r < RB; ++r) {
    if (row0 + r >= rows) break;  // uniform
    float* o = partial + ((kv * rows + row0 + r) * chunks + chunk) * head_dim + w * P;
    for (int k = 0; k < P; ++k) o[k] = acc[r][k];
  }
}

// ---- fused decode attention over the packed history ---------------------------------------------------------------
//
// One work-group per (kv head, block of RB query rows, chunk of packed tokens): the split-over-tokens attention of the
// native CPU kernel (csrc/cpu/decode_attention_impl.h). Phase 1: lanes walk the chunk's key code bytes (P_K tokens
// each) and score them against the RB rows with the same arithmetic as kivi_packed_key_scores (accumulate_codes;
// then softcap and the mask), into the scratch rows. Phase 2: per row the chunk's max m and sum l of exp(s - m) (group
// reductions; a fully masked chunk has m = -inf and zero weights). Phase 3: lanes walk the value code bytes (P_V
// channels each) and accumulate exp(s - m) * value as kivi_packed_value_combine does. The host merges the chunks'
// (m, l, acc) with the exact sinks and window in order (kivi_xpu/ops/sycl.py). In the key loop each lane loads its
// own group's scale/zero (at most two groups per sub-group: a gather of two addresses) instead of the shuffle of the
// other kernels (see the comment there).
//   query [B,Hq,L,D] f32 (scaled, rotated); keys codes [B,Hkv,D,*], scales/zeros [B,Hkv,D,*]; values codes
//   [B,Hkv,*,Dv/P_V], scales/zeros [B,Hkv,*,Dv/G_V]; bias: nullptr or f32 with strides (bias_b, bias_h, bias_l, 1),
//   column t = packed token t, added to the scores or, with bias_fills (a bool mask as 0 / -inf), setting -inf
//   -> chunk_max / chunk_sum [B,Hq,L,chunks], chunk_acc [B,Hq,L,chunks,Dv] f32. scratch [B*Hkv, blocks*chunks, RB,
//   chunk_tokens] f32 holds each work-group's scores, then weights (global memory: the run-time compiler of the pip
//   DPC++ crashed on group_local_memory in a free-function kernel; a work-group's rows stay in its cache).
// nd_range {B*Hkv, blocks*chunks, W} with work-groups {1, 1, W}. Every lane runs every loop iteration (inactive ones
// load nothing), so the group reductions and barriers see the whole group.
inline float negative_infinity() { return bits_float(0xFF800000u); }

// Phase 2 of the chunked attention kernels, once every lane has written its scores into `probs` [RB][chunk_tokens]
// and its running maxima `mx`: per row the chunk's max m and sum l of exp(s - m) over its n tokens (group reductions; a
// row masked out over the whole chunk keeps m = -inf and zero weights), the scores replaced by those weights, and m, l
// stored for this work-group's rows. Every lane of the work-group calls it (barriers inside).
template <int RB>
inline void chunk_statistics(const sycl::group<3>& wg, size_t lane, size_t width, float* probs, size_t chunk_tokens,
                             size_t n, const float (&mx)[RB], size_t rows, size_t row0, size_t chunks,
                             size_t out_row0, float* chunk_max, float* chunk_sum) {
  sycl::group_barrier(wg);  // every token's score is written
  float m[RB], l[RB];
  for (int r = 0; r < RB; ++r) m[r] = sycl::reduce_over_group(wg, mx[r], sycl::maximum<float>());
  for (int r = 0; r < RB; ++r) {
    float sum = 0.0f;
    for (size_t t = lane; t < n; t += width) {
      const float p = m[r] == negative_infinity() ? 0.0f : sycl::exp(probs[r * chunk_tokens + t] - m[r]);
      probs[r * chunk_tokens + t] = p;
      sum += p;
    }
    l[r] = sycl::reduce_over_group(wg, sum, sycl::plus<float>());
  }
  sycl::group_barrier(wg);  // every token's weights are written
  if (lane == 0) {
    for (int r = 0; r < RB; ++r) {
      if (row0 + r >= rows) break;  // uniform
      chunk_max[out_row0 + r * chunks] = m[r];
      chunk_sum[out_row0 + r * chunks] = l[r];
    }
  }
}

template <typename M, int key_bits, int value_bits, int RB>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_packed_attention(
    const float* query, const unsigned char* key_codes, const typename M::T* key_scales,
    const typename M::T* key_zeros, const unsigned char* value_codes, const typename M::T* value_scales,
    const typename M::T* value_zeros, const float* bias, float* chunk_max, float* chunk_sum, float* chunk_acc,
    float* scratch, size_t rows, size_t length, size_t heads_per_kv, size_t kv_heads, size_t num_tokens,
    size_t head_dim, size_t value_dim, size_t key_code_cols, size_t key_meta_cols, size_t value_code_rows,
    size_t value_meta_rows, size_t key_group, size_t value_group, size_t chunk_tokens, size_t chunks, size_t bias_b,
    size_t bias_h, size_t bias_l, int bias_fills, float softcap) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const sycl::group<3> wg = it.get_group();
  const sycl::sub_group sg = it.get_sub_group();
  constexpr int PK = 8 / key_bits, PV = 8 / value_bits;
  constexpr unsigned key_mask = (1u << key_bits) - 1u;
  const size_t lane = it.get_local_id(2), width = it.get_local_range(2);
  const size_t sg_offset = (size_t)sg.get_group_linear_id() * (size_t)sg.get_max_local_range()[0];
  const size_t kv = it.get_global_id(0);
  const size_t block = it.get_global_id(1) / chunks, chunk = it.get_global_id(1) % chunks;  // uniform
  const size_t row0 = block * RB, last = rows - 1 - row0;
  const size_t t_begin = chunk * chunk_tokens;
  const size_t t_end = t_begin + chunk_tokens < num_tokens ? t_begin + chunk_tokens : num_tokens;
  const size_t n = t_end - t_begin;  // a multiple of PK (num_tokens and chunk_tokens are)
  float* probs = scratch + (kv * it.get_global_range(1) + it.get_global_id(1)) * RB * chunk_tokens;  // [RB][chunk]

  // Phase 1: scores.
  const float* q0 = query + (kv * rows + row0) * head_dim;
  const unsigned char* key_rows = key_codes + kv * head_dim * key_code_cols;
  const typename M::T* kscale_rows = key_scales + kv * head_dim * key_meta_cols;
  const typename M::T* kzero_rows = key_zeros + kv * head_dim * key_meta_cols;
  const float* bias_row[RB];
  for (int r = 0; r < RB; ++r) {
    const size_t row = row0 + ((size_t)r < last ? (size_t)r : last);  // uniform
    const size_t b = kv / kv_heads, head = (kv % kv_heads) * heads_per_kv + row / length;
    bias_row[r] = bias == nullptr ? nullptr : bias + b * bias_b + head * bias_h + (row % length) * bias_l + t_begin;
  }
  float mx[RB];
  for (int r = 0; r < RB; ++r) mx[r] = negative_infinity();
  for (size_t b0 = 0; b0 < n / PK; b0 += width) {
    const size_t jl = b0 + lane, j = t_begin / PK + jl;  // lane's byte: in the chunk, in the key code row
    const bool active = jl < n / PK;
    float acc[RB][PK];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < PK; ++k) acc[r][k] = 0.0f;
    for (size_t d = 0; d < head_dim; ++d) {
      const unsigned byte = active ? key_rows[d * key_code_cols + j] : 0u;
      // The lane's key group's scale and zero loaded directly, no shuffle, and the products written out here: with
      // accumulate_byte or accumulate_codes in this loop the OpenCL CPU device's vectorizer gave up on the kernel
      // (4-5x slower); with this form the fused kernel runs at 0.7-0.9x of the composed ones there.
      const size_t g = active ? j / (key_group / PK) : 0;
      const float scale = M::load(kscale_rows[d * key_meta_cols + g]);
      const float zero = M::load(kzero_rows[d * key_meta_cols + g]);
      float code[PK];
      for (int k = 0; k < PK; ++k) code[k] = sycl::fma((float)((byte >> (k * key_bits)) & key_mask), scale, zero);
      for (int r = 0; r < RB; ++r) {
        const float weight = q0[((size_t)r < last ? (size_t)r : last) * head_dim + d];
        for (int k = 0; k < PK; ++k) acc[r][k] = sycl::fma(weight, code[k], acc[r][k]);
      }
    }
    if (active) {
      for (int r = 0; r < RB; ++r)
        for (int k = 0; k < PK; ++k) {
          float s = acc[r][k];
          if (softcap != 0.0f) s = sycl::tanh(s / softcap) * softcap;
          if (bias != nullptr) {  // a fill mask sets -inf (a masked NaN is ignored), an additive one adds
            const float b = bias_row[r][PK * jl + k];
            s = bias_fills ? (b == negative_infinity() ? b : s) : s + b;
          }
          probs[r * chunk_tokens + PK * jl + k] = s;
          mx[r] = sycl::fmax(mx[r], s);  // a NaN score is dropped here but reaches l below through exp
        }
    }
  }
  // Phase 2.
  const size_t out_row0 = (kv * rows + row0) * chunks + chunk;
  chunk_statistics<RB>(wg, lane, width, probs, chunk_tokens, n, mx, rows, row0, chunks, out_row0, chunk_max, chunk_sum);
  // Phase 3: the weighted sum of the chunk's values.
  const size_t row_bytes = value_dim / PV, groups = value_dim / value_group;
  const unsigned char* value_col = value_codes + kv * value_code_rows * row_bytes;
  const typename M::T* vscale_rows = value_scales + kv * value_meta_rows * groups;
  const typename M::T* vzero_rows = value_zeros + kv * value_meta_rows * groups;
  for (size_t w0 = 0; w0 < row_bytes; w0 += width) {
    const size_t w = w0 + lane;
    const bool active = w < row_bytes;
    const LaneGroup lg = lane_group_at(sg, w, w0 + sg_offset, value_group / PV, groups);
    float acc[RB][PV];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < PV; ++k) acc[r][k] = 0.0f;
    for (size_t t = t_begin; t < t_end; ++t) {
      const unsigned byte = active ? value_col[t * row_bytes + w] : 0u;
      accumulate_byte<M, value_bits, RB>(sg, lg, byte, vscale_rows + t * groups, vzero_rows + t * groups,
                                         probs + (t - t_begin), chunk_tokens, RB - 1, acc);
    }
    if (active) {
      for (int r = 0; r < RB; ++r) {
        if (row0 + r >= rows) break;  // uniform
        float* o = chunk_acc + (out_row0 + r * chunks) * value_dim + w * PV;
        for (int k = 0; k < PV; ++k) o[k] = acc[r][k];
      }
    }
  }
}

// ---- paged decode attention over KIVI pages (continuous batching) --------------------------------------------------
//
// kivi_packed_attention for the decode rows of continuous batching: one work-group per (request n, kv head, block of
// RB query rows, chunk of chunk_tokens tokens), reading request n's packed tokens in place from the pages of its
// block table row (block_table[n][t / T]: page of T tokens, key codes [H, D, T/P_K] with one key group per page,
// values [H, T, Dv/P_V]; every section a view of one byte pool, so each has its own stride between blocks). Row n of
// `requests` is (slot, sinks, key_count, key_tail_row, value_count, value_tail_row, length), as paged_decode_attention
// (kivi_xpu/ops/reference.py) defines it. The kernel covers the tokens after the sinks that at least one kind holds
// packed, t < max(key_count, value_count): a token packed in one kind only (keys leave the window a block at a time,
// values one by one) reads the other kind's exact row of the request's window slot (key row key_tail_row + t -
// key_count, value row value_tail_row + t - value_count). The sinks and the rest of the tail are the host's
// (kivi_xpu/ops/sycl.py), which merges them with the chunks' (m, l, acc) in order. A rotated history is scored with
// the rotated query and its value sums are rotated back by the host, while a window row is exact: so exact keys are
// scored with the plain query and exact values summed into their own chunk_exact_acc. No mask, no softcap
// (continuous batching refuses both).
//   query, plain_query [N,Hq,1,D] f32 (scaled; the first rotated as the keys); windows X [slots, H, W, D] (strides in
//   elements); block_table [N, cols] and requests [N, 7] int64 -> chunk_max / chunk_sum [N,Hq,1,chunks], chunk_acc
//   and chunk_exact_acc [N,Hq,1,chunks,Dv] f32; scratch as kivi_packed_attention's. nd_range {N*Hkv, blocks*chunks,
//   W}, work-groups {1, 1, W}.
template <typename M, typename X, int key_bits, int value_bits, int RB>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_paged_attention(
    const float* query, const float* plain_query, const unsigned char* key_codes, const typename M::T* key_scales,
    const typename M::T* key_zeros, const unsigned char* value_codes, const typename M::T* value_scales,
    const typename M::T* value_zeros, const typename X::T* key_windows, const typename X::T* value_windows,
    const long long* block_table, const long long* requests, float* chunk_max, float* chunk_sum, float* chunk_acc,
    float* chunk_exact_acc, float* scratch, size_t rows, size_t kv_heads, size_t head_dim, size_t value_dim,
    size_t page_tokens, size_t value_group, size_t key_code_block, size_t key_meta_block, size_t value_code_block,
    size_t value_meta_block, size_t key_window_slot, size_t key_window_head, size_t value_window_slot,
    size_t value_window_head, size_t table_cols, size_t chunk_tokens, size_t chunks) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  const sycl::group<3> wg = it.get_group();
  const sycl::sub_group sg = it.get_sub_group();
  constexpr int PK = 8 / key_bits, PV = 8 / value_bits;
  constexpr unsigned key_mask = (1u << key_bits) - 1u;
  const size_t lane = it.get_local_id(2), width = it.get_local_range(2);
  const size_t sg_offset = (size_t)sg.get_group_linear_id() * (size_t)sg.get_max_local_range()[0];
  const size_t kv = it.get_global_id(0), request = kv / kv_heads, head = kv % kv_heads;  // uniform
  const size_t block = it.get_global_id(1) / chunks, chunk = it.get_global_id(1) % chunks;
  const size_t row0 = block * RB, last = rows - 1 - row0;
  const long long* r = requests + request * 7;
  const size_t slot = (size_t)r[0], key_count = (size_t)r[2], key_tail = (size_t)r[3];
  const size_t value_count = (size_t)r[4], value_tail = (size_t)r[5];
  const size_t top = key_count > value_count ? key_count : value_count;
  const size_t t_begin = chunk * chunk_tokens;
  const size_t left = top > t_begin ? top - t_begin : 0;
  const size_t n = left < chunk_tokens ? left : chunk_tokens;  // this chunk's tokens (0: nothing, still reduces)
  const long long* table = block_table + request * table_cols;
  float* probs = scratch + (kv * it.get_global_range(1) + it.get_global_id(1)) * RB * chunk_tokens;  // [RB][chunk]

  // Phase 1: scores, PK tokens per lane and step (a page holds whole key bytes: T is a multiple of PK).
  const float* q0 = query + (kv * rows + row0) * head_dim;
  const float* plain_q0 = plain_query + (kv * rows + row0) * head_dim;
  const size_t page_bytes = page_tokens / PK;
  const size_t bytes = (n + PK - 1) / PK;
  float mx[RB];
  for (int q = 0; q < RB; ++q) mx[q] = negative_infinity();
  for (size_t b0 = 0; b0 < bytes; b0 += width) {
    const size_t jl = b0 + lane;
    const bool active = jl < bytes;
    const size_t t0 = t_begin + PK * jl;  // the byte's first token
    const bool packed = active && t0 < key_count;
    const size_t page = packed ? (size_t)table[t0 / page_tokens] : 0;
    const unsigned char* code_row = key_codes + page * key_code_block + head * head_dim * page_bytes +
                                    (t0 % page_tokens) / PK;
    const typename M::T* scale_row = key_scales + page * key_meta_block + head * head_dim;
    const typename M::T* zero_row = key_zeros + page * key_meta_block + head * head_dim;
    const typename X::T* exact_rows =  // the window row of token t0 (an exact key: t0 >= key_count)
        key_windows + slot * key_window_slot + head * key_window_head +
        (active && !packed ? key_tail + t0 - key_count : 0) * head_dim;
    float acc[RB][PK];
    for (int q = 0; q < RB; ++q)
      for (int k = 0; k < PK; ++k) acc[q][k] = 0.0f;
    for (size_t d = 0; d < head_dim; ++d) {
      float key[PK];
      if (packed) {
        const unsigned byte = code_row[d * page_bytes];
        const float scale = M::load(scale_row[d]), zero = M::load(zero_row[d]);
        for (int k = 0; k < PK; ++k) key[k] = sycl::fma((float)((byte >> (k * key_bits)) & key_mask), scale, zero);
      } else {
        for (int k = 0; k < PK; ++k) key[k] = active && PK * jl + k < n ? X::load(exact_rows[k * head_dim + d]) : 0.0f;
      }
      for (int q = 0; q < RB; ++q) {
        const size_t at = ((size_t)q < last ? (size_t)q : last) * head_dim + d;
        const float weight = packed ? q0[at] : plain_q0[at];
        for (int k = 0; k < PK; ++k) acc[q][k] = sycl::fma(weight, key[k], acc[q][k]);
      }
    }
    if (active) {
      for (int q = 0; q < RB; ++q)
        for (int k = 0; k < PK; ++k) {
          if (PK * jl + k >= n) break;
          probs[q * chunk_tokens + PK * jl + k] = acc[q][k];
          mx[q] = sycl::fmax(mx[q], acc[q][k]);  // a NaN score is dropped here but reaches l below through exp
        }
    }
  }
  // Phase 2 (an empty chunk keeps m = -inf, l = 0).
  const size_t out_row0 = (kv * rows + row0) * chunks + chunk;
  chunk_statistics<RB>(wg, lane, width, probs, chunk_tokens, n, mx, rows, row0, chunks, out_row0, chunk_max, chunk_sum);
  // Phase 3: the weighted sum of the chunk's values, a token at a time (uniform: packed or exact for the whole group).
  const size_t row_bytes = value_dim / PV, groups = value_dim / value_group;
  const typename X::T* value_rows = value_windows + slot * value_window_slot + head * value_window_head;
  for (size_t w0 = 0; w0 < row_bytes; w0 += width) {
    const size_t w = w0 + lane;
    const bool active = w < row_bytes;
    const LaneGroup lg = lane_group_at(sg, w, w0 + sg_offset, value_group / PV, groups);
    float acc[RB][PV], exact[RB][PV];
    for (int q = 0; q < RB; ++q)
      for (int k = 0; k < PV; ++k) acc[q][k] = exact[q][k] = 0.0f;
    for (size_t t = t_begin; t < t_begin + n; ++t) {
      const float* weights = probs + (t - t_begin);
      if (t < value_count) {
        const size_t page = (size_t)table[t / page_tokens];
        const size_t token = head * page_tokens + t % page_tokens;  // row in the page's [H, T, *]
        const unsigned byte = active ? value_codes[page * value_code_block + token * row_bytes + w] : 0u;
        const size_t meta = page * value_meta_block + token * groups;
        accumulate_byte<M, value_bits, RB>(sg, lg, byte, value_scales + meta, value_zeros + meta, weights,
                                           chunk_tokens, RB - 1, acc);
      } else {
        const typename X::T* row = value_rows + (value_tail + t - value_count) * value_dim + w * PV;
        for (int k = 0; k < PV; ++k) {
          const float v = active ? X::load(row[k]) : 0.0f;
          for (int q = 0; q < RB; ++q) exact[q][k] = sycl::fma(weights[q * chunk_tokens], v, exact[q][k]);
        }
      }
    }
    if (active) {
      for (int q = 0; q < RB; ++q) {
        if (row0 + q >= rows) break;  // uniform
        const size_t at = (out_row0 + q * chunks) * value_dim + w * PV;
        for (int k = 0; k < PV; ++k) {
          chunk_acc[at + k] = acc[q][k];
          chunk_exact_acc[at + k] = exact[q][k];
        }
      }
    }
  }
}
