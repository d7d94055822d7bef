// SYCL device source (csrc/device/, after 30_attention.cpp): the fused decode attention over the packed history, and
// the work-item and phase 2 it shares with 50_paged_attention.cpp.

inline float negative_infinity() { return bits_float(0xFF800000u); }

// A work-item of the chunked attention kernels (nd_range {kv heads, blocks * chunks, W}, work-groups {1, 1, W}): its
// group, sub-group and lane, and its uniform ids and the chunk geometry (kernel arguments, kept here so that phase 2
// takes the item alone).
template <int RB>
struct ChunkItem {
  sycl::group<3> wg;
  sycl::sub_group sg;
  size_t lane, width;  // lanes walk a chunk's bytes lane, lane + width, ...
  size_t sg_offset;    // the sub-group's first lane in the work-group (its first byte at a step w0: w0 + this)
  size_t rows, chunks, chunk_tokens;
  size_t kv, chunk, row0;  // kv head (row of the first nd_range dimension), chunk, the block's first query row
  size_t last;             // rows - 1 - row0: a partial last block re-reads row row0 + last
  size_t t_begin;          // the chunk's first token
  size_t out_row0;         // row of (kv, row0, chunk) in chunk_max / chunk_sum; row r of the block: + r * chunks
  float* probs;            // the work-group's scratch rows [RB][chunk_tokens]: scores, then weights
};

template <int RB>
inline ChunkItem<RB> chunk_item(size_t rows, size_t chunks, size_t chunk_tokens, float* scratch) {
  const sycl::nd_item<3> it = syclext::this_work_item::get_nd_item<3>();
  ChunkItem<RB> c{it.get_group(), it.get_sub_group()};
  c.lane = it.get_local_id(2), c.width = it.get_local_range(2);
  c.sg_offset = (size_t)c.sg.get_group_linear_id() * (size_t)c.sg.get_max_local_range()[0];
  c.rows = rows, c.chunks = chunks, c.chunk_tokens = chunk_tokens;
  c.kv = it.get_global_id(0), c.chunk = it.get_global_id(1) % chunks;  // uniform
  c.row0 = it.get_global_id(1) / chunks * RB, c.last = rows - 1 - c.row0;
  c.t_begin = c.chunk * chunk_tokens;
  c.out_row0 = (c.kv * rows + c.row0) * chunks + c.chunk;
  c.probs = scratch + (c.kv * it.get_global_range(1) + it.get_global_id(1)) * RB * chunk_tokens;
  return c;
}

// Phase 2 of the chunked attention kernels, once every lane has written its scores into c.probs and its running
// maxima `mx`: per row the chunk's max m and sum l of exp(s - m) over its n tokens (group reductions; a row masked out
// over the whole chunk keeps m = -inf and zero weights), the scores replaced by those weights, and m, l stored for the
// work-group's rows. Every lane of the work-group calls it (barriers inside).
template <int RB>
inline void chunk_statistics(const ChunkItem<RB>& c, size_t n, const float (&mx)[RB], float* chunk_max,
                             float* chunk_sum) {
  sycl::group_barrier(c.wg);  // every token's score is written
  float m[RB], l[RB];
  for (int r = 0; r < RB; ++r) m[r] = sycl::reduce_over_group(c.wg, mx[r], sycl::maximum<float>());
  for (int r = 0; r < RB; ++r) {
    float sum = 0.0f;
    for (size_t t = c.lane; t < n; t += c.width) {
      const float p = m[r] == negative_infinity() ? 0.0f : sycl::exp(c.probs[r * c.chunk_tokens + t] - m[r]);
      c.probs[r * c.chunk_tokens + t] = p;
      sum += p;
    }
    l[r] = sycl::reduce_over_group(c.wg, sum, sycl::plus<float>());
  }
  sycl::group_barrier(c.wg);  // every token's weights are written
  if (c.lane == 0) {
    for (int r = 0; r < RB; ++r) {
      if (c.row0 + r >= c.rows) break;  // uniform
      chunk_max[c.out_row0 + r * c.chunks] = m[r];
      chunk_sum[c.out_row0 + r * c.chunks] = l[r];
    }
  }
}

// Fused decode attention. One work-group per (kv head, block of RB query rows, chunk of packed tokens): the
// split over tokens of the native CPU decode attention (csrc/cpu/). Phase 1: lanes walk the chunk's key code
// bytes (P_K tokens each) and score them against the RB rows with the same arithmetic as kivi_packed_key_scores
// (accumulate_codes; then softcap and the mask), into the scratch rows. Phase 2: per row the chunk's max m and sum l of
// exp(s - m) (group reductions; a fully masked chunk has m = -inf and zero weights). Phase 3: lanes walk the value code
// bytes (P_V channels each) and accumulate exp(s - m) * value as kivi_packed_value_combine does. The host merges the
// chunks' (m, l, acc) with the exact sinks and window in order (kivi_xpu/ops/sycl.py). In the key loop each lane loads
// its own group's scale/zero (at most two groups per sub-group: a gather of two addresses) instead of the shuffle of
// the other kernels (see the comment there).
//   query [B,Hq,L,D] f32 (scaled, rotated); keys codes [B,Hkv,D,*], scales/zeros [B,Hkv,D,*]; values codes
//   [B,Hkv,*,Dv/P_V], scales/zeros [B,Hkv,*,Dv/G_V]; bias: nullptr or f32 with strides (bias_b, bias_h, bias_l, 1),
//   column t = packed token t, added to the scores or, with bias_fills (a bool mask as 0 / -inf), setting -inf
//   -> chunk_max / chunk_sum [B,Hq,L,chunks], chunk_acc [B,Hq,L,chunks,Dv] f32. scratch [B*Hkv, blocks*chunks, RB,
//   chunk_tokens] f32 holds each work-group's scores, then weights (global memory: the run-time compiler of the pip
//   DPC++ crashed on group_local_memory in a free-function kernel; a work-group's rows stay in its cache).
// nd_range {B*Hkv, blocks*chunks, W} with work-groups {1, 1, W}. Every lane runs every loop iteration (inactive ones
// load nothing), so the group reductions and barriers see the whole group.
template <typename M, int key_bits, int value_bits, int RB>
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>)) void kivi_packed_attention(
    const float* query, const unsigned char* key_codes, const typename M::T* key_scales,
    const typename M::T* key_zeros, const unsigned char* value_codes, const typename M::T* value_scales,
    const typename M::T* value_zeros, const float* bias, float* chunk_max, float* chunk_sum, float* chunk_acc,
    float* scratch, size_t rows, size_t length, size_t heads_per_kv, size_t kv_heads, size_t num_tokens,
    size_t head_dim, size_t value_dim, size_t key_code_cols, size_t key_meta_cols, size_t value_code_rows,
    size_t value_meta_rows, size_t key_group, size_t value_group, size_t chunk_tokens, size_t chunks, size_t bias_b,
    size_t bias_h, size_t bias_l, int bias_fills, float softcap) {
  const ChunkItem<RB> c = chunk_item<RB>(rows, chunks, chunk_tokens, scratch);
  constexpr int PK = 8 / key_bits, PV = 8 / value_bits;
  constexpr unsigned key_mask = (1u << key_bits) - 1u;
  const size_t kv = c.kv, row0 = c.row0, last = c.last, t_begin = c.t_begin;
  const size_t t_end = t_begin + chunk_tokens < num_tokens ? t_begin + chunk_tokens : num_tokens;
  const size_t n = t_end - t_begin;  // a multiple of PK (num_tokens and chunk_tokens are)

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
  for (size_t b0 = 0; b0 < n / PK; b0 += c.width) {
    const size_t jl = b0 + c.lane, j = t_begin / PK + jl;  // lane's byte: in the chunk, in the key code row
    const bool active = jl < n / PK;
    float acc[RB][PK];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < PK; ++k) acc[r][k] = 0.0f;
    for (size_t d = 0; d < head_dim; ++d) {
      const unsigned byte = active ? key_rows[d * key_code_cols + j] : 0u;
      // The lane's key group's scale and zero loaded directly, no shuffle, and the products written out here: with
      // accumulate_byte or accumulate_codes in this loop the OpenCL CPU device's vectorizer gave up on the kernel; in
      // this form it vectorises.
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
          c.probs[r * chunk_tokens + PK * jl + k] = s;
          mx[r] = sycl::fmax(mx[r], s);  // a NaN score is dropped here but reaches l below through exp
        }
    }
  }
  // Phase 2.
  chunk_statistics<RB>(c, n, mx, chunk_max, chunk_sum);
  // Phase 3: the weighted sum of the chunk's values.
  const size_t row_bytes = value_dim / PV, groups = value_dim / value_group;
  const unsigned char* value_col = value_codes + kv * value_code_rows * row_bytes;
  const typename M::T* vscale_rows = value_scales + kv * value_meta_rows * groups;
  const typename M::T* vzero_rows = value_zeros + kv * value_meta_rows * groups;
  for (size_t w0 = 0; w0 < row_bytes; w0 += c.width) {
    const size_t w = w0 + c.lane;
    const bool active = w < row_bytes;
    const LaneGroup lg = lane_group_at(c.sg, w, w0 + c.sg_offset, value_group / PV, groups);
    float acc[RB][PV];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < PV; ++k) acc[r][k] = 0.0f;
    for (size_t t = t_begin; t < t_end; ++t) {
      const unsigned byte = active ? value_col[t * row_bytes + w] : 0u;
      accumulate_byte<M, value_bits, RB>(c.sg, lg, byte, vscale_rows + t * groups, vzero_rows + t * groups,
                                         c.probs + (t - t_begin), chunk_tokens, RB - 1, acc);
    }
    if (active) {
      for (int r = 0; r < RB; ++r) {
        if (row0 + r >= rows) break;  // uniform
        float* o = chunk_acc + (c.out_row0 + r * chunks) * value_dim + w * PV;
        for (int k = 0; k < PV; ++k) o[k] = acc[r][k];
      }
    }
  }
}
