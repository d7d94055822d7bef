// SYCL device source (csrc/device/, after 40_decode_attention.cpp): the paged decode attention over KIVI pages
// (continuous batching), on the work-item and phase 2 of 40_decode_attention.cpp.
//
// kivi_packed_attention for the decode rows of continuous batching: one work-group per (request n, kv head, block of
// RB query rows, chunk of chunk_tokens tokens), reading request n's packed tokens in place from the pages of its
// block table row (block_table[n][t / T]: page of T tokens, key codes [H, D, T/P_K] and key metadata group-major
// [H, T/G, D] for its T/G key groups of G tokens, values [H, T, Dv/P_V]; every section a view of one byte pool, so
// each has its own stride between blocks). Row n of
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
    size_t page_tokens, size_t key_group, size_t value_group, size_t key_code_block, size_t key_meta_block, size_t value_code_block,
    size_t value_meta_block, size_t key_window_slot, size_t key_window_head, size_t value_window_slot,
    size_t value_window_head, size_t table_cols, size_t chunk_tokens, size_t chunks) {
  const ChunkItem<RB> c = chunk_item<RB>(rows, chunks, chunk_tokens, scratch);
  constexpr int PK = 8 / key_bits, PV = 8 / value_bits;
  constexpr unsigned key_mask = (1u << key_bits) - 1u;
  const size_t kv = c.kv, row0 = c.row0, last = c.last, t_begin = c.t_begin;
  const size_t request = kv / kv_heads, head = kv % kv_heads;  // uniform
  const long long* r = requests + request * 7;
  const size_t slot = (size_t)r[0], key_count = (size_t)r[2], key_tail = (size_t)r[3];
  const size_t value_count = (size_t)r[4], value_tail = (size_t)r[5];
  const size_t top = key_count > value_count ? key_count : value_count;
  const size_t left = top > t_begin ? top - t_begin : 0;
  const size_t n = left < chunk_tokens ? left : chunk_tokens;  // this chunk's tokens (0: nothing, still reduces)
  const long long* table = block_table + request * table_cols;

  // Phase 1: scores, PK tokens per lane and step (a page holds whole key bytes: T is a multiple of PK).
  const float* q0 = query + (kv * rows + row0) * head_dim;
  const float* plain_q0 = plain_query + (kv * rows + row0) * head_dim;
  const size_t page_bytes = page_tokens / PK;
  const size_t bytes = (n + PK - 1) / PK;
  float mx[RB];
  for (int q = 0; q < RB; ++q) mx[q] = negative_infinity();
  for (size_t b0 = 0; b0 < bytes; b0 += c.width) {
    const size_t jl = b0 + c.lane;
    const bool active = jl < bytes;
    const size_t t0 = t_begin + PK * jl;  // the byte's first token
    const bool packed = active && t0 < key_count;
    const size_t page = packed ? (size_t)table[t0 / page_tokens] : 0;
    const unsigned char* code_row = key_codes + page * key_code_block + head * head_dim * page_bytes +
                                    (t0 % page_tokens) / PK;
    const size_t meta = page * key_meta_block + (head * (page_tokens / key_group) + (t0 % page_tokens) / key_group) *
                                                    head_dim;  // the D channels of t0's key group
    const typename M::T* scale_row = key_scales + meta;
    const typename M::T* zero_row = key_zeros + meta;
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
          c.probs[q * chunk_tokens + PK * jl + k] = acc[q][k];
          mx[q] = sycl::fmax(mx[q], acc[q][k]);  // a NaN score is dropped here but reaches l below through exp
        }
    }
  }
  // Phase 2 (an empty chunk keeps m = -inf, l = 0).
  chunk_statistics<RB>(c, n, mx, chunk_max, chunk_sum);
  // Phase 3: the weighted sum of the chunk's values, a token at a time (uniform: packed or exact for the whole group).
  const size_t row_bytes = value_dim / PV, groups = value_dim / value_group;
  const typename X::T* value_rows = value_windows + slot * value_window_slot + head * value_window_head;
  for (size_t w0 = 0; w0 < row_bytes; w0 += c.width) {
    const size_t w = w0 + c.lane;
    const bool active = w < row_bytes;
    const LaneGroup lg = lane_group_at(c.sg, w, w0 + c.sg_offset, value_group / PV, groups);
    float acc[RB][PV], exact[RB][PV];
    for (int q = 0; q < RB; ++q)
      for (int k = 0; k < PV; ++k) acc[q][k] = exact[q][k] = 0.0f;
    for (size_t t = t_begin; t < t_begin + n; ++t) {
      const float* weights = c.probs + (t - t_begin);
      if (t < value_count) {
        const size_t page = (size_t)table[t / page_tokens];
        const size_t token = head * page_tokens + t % page_tokens;  // row in the page's [H, T, *]
        const unsigned byte = active ? value_codes[page * value_code_block + token * row_bytes + w] : 0u;
        const size_t meta = page * value_meta_block + token * groups;
        accumulate_byte<M, value_bits, RB>(c.sg, lg, byte, value_scales + meta, value_zeros + meta, weights,
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
        const size_t at = (c.out_row0 + q * chunks) * value_dim + w * PV;
        for (int k = 0; k < PV; ++k) {
          chunk_acc[at + k] = acc[q][k];
          chunk_exact_acc[at + k] = exact[q][k];
        }
      }
    }
  }
}
