// SYCL device source (csrc/device/, after 20_quantize.cpp): attention on the packed history as two kernels, the
// scores against the packed keys and the probabilities' sum over the packed values, and the lane helpers every
// attention kernel (also 40_decode_attention.cpp and 50_paged_attention.cpp) shares.
//
// Both kernels dequantize each code ONCE and use it for every query row that reads the same kv head (the query heads of
// a GQA group times the query length: R = (Hq/Hkv)*L consecutive rows of the [B,Hq,L,*] operands), RB <= 4 rows per
// work-item (accumulators in registers; a partial last block re-reads its last row and skips its stores). Lanes (the
// last nd_range dimension) walk consecutive code BYTES, so code loads are contiguous, and all per-row data (query /
// probabilities) are uniform scalars. A lane's scale/zero come from a sub-group shuffle, as in dequantize_values: lane
// l loads the l-th group counting from the group of the sub-group's first byte (contiguous, masked: one vector load +
// conversion), then takes its own group's by select_from_group (one permute on a CPU). Its group is at most l groups
// past the first one (a group holds >= 1 byte), so the source lane exists for any sub-group size. Padding lanes skip
// their loads and stores but no early return (they must join the shuffles). Uniform values are combined with plain
// operators and ternaries, never sycl::min & co.: the CPU vectorizer does not know those builtins preserve uniformity,
// so their results become per-lane vectors (a loop bound turns into a masked divergent loop, a row index into gathers).

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
