// AVX2 + FMA paged attention over the KV cache in place (no gather), online softmax, bf16 or fp32.
// Same semantics as csrc/paged_attention.cpp, and it serves every row, prompt chunks included.
//
// Work item: one (row, KV head, tile of consecutive queries of the row). Every query of the tile,
// for each of the heads sharing that KV head (grouped-query attention, Ainslie et al. 2023), keeps a
// running max m, normaliser l and fp32 accumulator; the item walks the row's block table in chunks
// of at most 16 keys and each chunk updates them with the online softmax of Milakov & Gimelshein
// 2018 ("Online normalizer calculation for softmax"), as in FlashAttention (Dao et al. 2022) and
// flash-decoding: m' = max(m, max s), l' = l e^(m - m') + sum e^(s - m'), acc' = acc e^(m - m') +
// sum e^(s - m') v. Query i of a row sits at position seq_len - n + i and sees keys 0..that position.
// A tile of several queries converts and loads each K/V chunk once for all of them (prefill speed).
//
// Batch invariance (the same bits for a query alone, among 1 + k speculative queries, inside a long
// prompt chunk, or after a prefix-cache hit): chunk boundaries depend only on key positions (16-key
// steps inside each cache block), a query's chunk is cut at its own position (masked keys never
// enter its max, sum or accumulator), and every score, sum and accumulator element is computed by
// the same sequence of fp32 operations whatever the tile's size or the query's place in it (the
// kernels below pad tiles instead of taking other code paths).
//
// Sliding window (paged_attention_ex, window W > 0): query position p sees keys p - W + 1 .. p. An item
// starts at the chunk holding its lowest query's first key (earlier blocks are never read); a query
// skips chunks wholly outside its window and masks the keys of a chunk below it, so it keeps the same
// operations whatever its tile. Soft-capping (softcap c > 0, Gemma 2): each scaled score s becomes
// c tanh(s / c) before the mask and the softmax.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

using tandem::avx2::hmax8;
using tandem::avx2::hsum8;
using tandem::avx2::lane_mask8;
using tandem::avx2::load8;
using tandem::avx2::parallel_for;
using tandem::avx2::store8;

constexpr int64_t kChunk = 16;  // keys per online-softmax step (fewer at a block's end)

struct Geometry {
  int64_t num_kv, group, head_dim, dp, block_size;  // dp: head_dim rounded up to 8 lanes
  int64_t q_stride, out_stride;                     // elements between consecutive tokens
  int64_t tile;                                     // queries per work item
  float scale;
  int64_t window;                                   // sliding window in keys; 0: full causal attention
  float softcap;                                    // 0: none
};

// c tanh(s / c) for 8 lanes: tanh(y) = sign(y) (1 - e) / (1 + e) with e = e^(-2|y|), and for |y| < 1/8
// its odd Taylor polynomial to y^9 (no cancellation in 1 - e); relative error < 1e-6.
inline __m256 softcap8(__m256 s, float c) {
  const __m256 cap = _mm256_set1_ps(c), one = _mm256_set1_ps(1.0f), sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 y = _mm256_div_ps(s, cap);
  const __m256 a = _mm256_andnot_ps(sign_bit, y);
  const __m256 e = tandem::avx2::exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 large = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 a2 = _mm256_mul_ps(a, a);
  __m256 poly = _mm256_set1_ps(62.0f / 2835.0f);
  poly = _mm256_fmadd_ps(poly, a2, _mm256_set1_ps(-17.0f / 315.0f));
  poly = _mm256_fmadd_ps(poly, a2, _mm256_set1_ps(2.0f / 15.0f));
  poly = _mm256_fmadd_ps(poly, a2, _mm256_set1_ps(-1.0f / 3.0f));
  poly = _mm256_fmadd_ps(poly, a2, one);
  const __m256 small = _mm256_mul_ps(a, poly);
  const __m256 t = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.125f), _CMP_LT_OQ));
  return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(y, sign_bit)), cap);
}

// Lane sums of 8 vectors, one per lane of the result, each as ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
inline __m256 reduce8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // a0..a3: 0-3 | 4-7
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of queries q0, q1 (fp32, dp lanes, zero-padded) with keys k[0..3] (fp32 rows): s0[0..3], s1[0..3].
inline void scores_2x4(const float* q0, const float* q1, const float* const k[4], int64_t dp, float* s0, float* s1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t c = 0; c < dp; c += 8) {
    const __m256 x = _mm256_loadu_ps(q0 + c), y = _mm256_loadu_ps(q1 + c);
    __m256 kv = _mm256_loadu_ps(k[0] + c);
    a0 = _mm256_fmadd_ps(x, kv, a0);
    b0 = _mm256_fmadd_ps(y, kv, b0);
    kv = _mm256_loadu_ps(k[1] + c);
    a1 = _mm256_fmadd_ps(x, kv, a1);
    b1 = _mm256_fmadd_ps(y, kv, b1);
    kv = _mm256_loadu_ps(k[2] + c);
    a2 = _mm256_fmadd_ps(x, kv, a2);
    b2 = _mm256_fmadd_ps(y, kv, b2);
    kv = _mm256_loadu_ps(k[3] + c);
    a3 = _mm256_fmadd_ps(x, kv, a3);
    b3 = _mm256_fmadd_ps(y, kv, b3);
  }
  const __m256 r = reduce8x8(a0, a1, a2, a3, b0, b1, b2, b3);
  _mm_storeu_ps(s0, _mm256_castps256_ps128(r));
  _mm_storeu_ps(s1, _mm256_extractf128_ps(r, 1));
}

// acc[0 .. 8 NV) += sum_{j in [j0, j1)} p[j] v_j[0 .. 8 NV), one fma per key in key order.
template <int NV>
inline void pv1(float* acc, const float* p, const float* v, int64_t vs, int64_t j0, int64_t j1) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * vs + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

// pv1 for two queries sharing each V load (the same operations per element as pv1).
template <int NV>
inline void pv2(float* acc0, float* acc1, const float* p0, const float* p1, const float* v, int64_t vs, int64_t j1) {
  __m256 a[NV], b[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc0 + 8 * i), b[i] = _mm256_loadu_ps(acc1 + 8 * i);
  for (int64_t j = 0; j < j1; ++j) {
    const __m256 x = _mm256_broadcast_ss(p0 + j), y = _mm256_broadcast_ss(p1 + j);
    for (int i = 0; i < NV; ++i) {
      const __m256 vv = _mm256_loadu_ps(v + j * vs + 8 * i);
      a[i] = _mm256_fmadd_ps(x, vv, a[i]);
      b[i] = _mm256_fmadd_ps(y, vv, b[i]);
    }
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc0 + 8 * i, a[i]), _mm256_storeu_ps(acc1 + 8 * i, b[i]);
}

template <int NV>
inline void pv_pair(float* acc0, float* acc1, const float* p0, const float* p1, const float* v, int64_t vs,
                    int64_t n0, int64_t n1) {
  const int64_t both = std::min(n0, n1);
  pv2<NV>(acc0, acc1, p0, p1, v, vs, both);
  pv1<NV>(acc0, p0, v, vs, both, n0);
  pv1<NV>(acc1, p1, v, vs, both, n1);
}

// acc_x += P_x V over the first n_x keys for queries x0 and x1 (x1 may be null), in slabs of 32 lanes.
void pv_slabs(float* acc0, float* acc1, const float* p0, const float* p1, const float* v, int64_t vs, int64_t dp,
              int64_t n0, int64_t n1) {
  for (int64_t s = 0; s < dp; s += 32) {
    const int64_t nv = std::min<int64_t>(4, (dp - s) / 8);
    float* a1 = acc1 != nullptr ? acc1 + s : nullptr;
    if (a1 == nullptr) {
      switch (nv) {
        case 4: pv1<4>(acc0 + s, p0, v + s, vs, 0, n0); break;
        case 3: pv1<3>(acc0 + s, p0, v + s, vs, 0, n0); break;
        case 2: pv1<2>(acc0 + s, p0, v + s, vs, 0, n0); break;
        default: pv1<1>(acc0 + s, p0, v + s, vs, 0, n0);
      }
      continue;
    }
    switch (nv) {
      case 4: pv_pair<4>(acc0 + s, a1, p0, p1, v + s, vs, n0, n1); break;
      case 3: pv_pair<3>(acc0 + s, a1, p0, p1, v + s, vs, n0, n1); break;
      case 2: pv_pair<2>(acc0 + s, a1, p0, p1, v + s, vs, n0, n1); break;
      default: pv_pair<1>(acc0 + s, a1, p0, p1, v + s, vs, n0, n1);
    }
  }
}

// Rows [0, n) of a chunk of the cache (rows `stride` apart) as fp32 rows of dp lanes (zero-padded).
template <typename T>
void to_fp32(const T* src, int64_t stride, int64_t n, int64_t D, int64_t dp, float* dst) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < dp; c += 8) _mm256_storeu_ps(dst + j * dp + c, load8(src + j * stride + c, D - c));
}

struct Scratch {
  std::vector<float> buf;
  std::vector<int64_t> vis;
};

// One work item: queries [i0, i1) of a row of n queries whose context is seq_len keys, KV head `head`.
template <typename T>
void attend_tile(const Geometry& g, const T* q, const T* kc, const T* vc, const int32_t* table, int64_t seq_len,
                 int64_t n, int64_t head, int64_t i0, int64_t i1, T* out, Scratch& sc) {
  const int64_t D = g.head_dim, dp = g.dp, nq = (i1 - i0) * g.group, nq2 = (nq + 1) & ~int64_t{1};
  const int64_t row_elems = g.num_kv * D;
  // NOTE: fp32 caches with D % 8 == 0 are read in place; otherwise each chunk is converted once per item.
  constexpr bool kFp32 = std::is_same_v<T, float>;
  const bool direct = kFp32 && D % 8 == 0;
  sc.buf.assign(nq2 * dp + nq * dp + nq2 * kChunk + 2 * nq + 2 * kChunk * dp, 0.0f);
  sc.vis.assign(nq, 0);
  float* qf = sc.buf.data();      // [nq2, dp] scaled queries (a zero query pads an odd count)
  float* acc = qf + nq2 * dp;     // [nq, dp]
  float* s = acc + nq * dp;       // [nq2, 16] scores, then probabilities, of the current chunk
  float* m = s + nq2 * kChunk;    // [nq]
  float* l = m + nq;              // [nq]
  float* kbuf = l + nq;           // [16, dp]
  float* vbuf = kbuf + kChunk * dp;
  const __m256 scale = _mm256_set1_ps(g.scale);
  for (int64_t x = 0; x < nq; ++x) {
    const int64_t i = i0 + x / g.group, h = head * g.group + x % g.group;
    const T* src = q + i * g.q_stride + h * D;
    for (int64_t c = 0; c < dp; c += 8) _mm256_storeu_ps(qf + x * dp + c, _mm256_mul_ps(load8(src + c, D - c), scale));
    m[x] = -std::numeric_limits<float>::infinity();
  }
  const int64_t first_pos = seq_len - n, last_pos = first_pos + i1 - 1;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j_start = 0;  // the chunk (16-key step of a block) holding the tile's first visible key
  if (g.window > 0) {
    const int64_t lo = std::max<int64_t>(0, first_pos + i0 - g.window + 1);
    j_start = lo / g.block_size * g.block_size + lo % g.block_size / kChunk * kChunk;
  }
  for (int64_t j0 = j_start; j0 <= last_pos;) {
    const int64_t off = j0 % g.block_size;
    const int64_t cnt = std::min<int64_t>({kChunk, g.block_size - off, seq_len - j0});
    const int64_t nk = std::min<int64_t>(cnt, last_pos + 1 - j0);  // keys some query of the tile sees
    const int64_t base = (static_cast<int64_t>(table[j0 / g.block_size]) * g.block_size + off) * row_elems + head * D;
    const float* krows = kbuf;
    const float* vrows = vbuf;
    int64_t ks = dp;
    if constexpr (kFp32) {
      if (direct) krows = kc + base, vrows = vc + base, ks = row_elems;
    }
    if (!direct) {
      to_fp32(kc + base, row_elems, nk, D, dp, kbuf);
      to_fp32(vc + base, row_elems, nk, D, dp, vbuf);
    }
    for (int64_t jq = 0; jq < nk; jq += 4) {  // scores s[x, j] = q_x . k_j; rows past nk repeat the last key
      const float* k4[4];
      for (int t = 0; t < 4; ++t) k4[t] = krows + std::min<int64_t>(jq + t, nk - 1) * ks;
      for (int64_t x = 0; x < nq2; x += 2)
        scores_2x4(qf + x * dp, qf + (x + 1) * dp, k4, dp, s + x * kChunk + jq, s + (x + 1) * kChunk + jq);
    }
    if (g.softcap > 0.0f) {
      for (int64_t x = 0; x < nq * kChunk; x += 8) _mm256_storeu_ps(s + x, softcap8(_mm256_loadu_ps(s + x), g.softcap));
    }
    for (int64_t x = 0; x < nq; ++x) {  // online softmax update of query x over its visible keys
      const int64_t pos = first_pos + i0 + x / g.group;
      const int64_t visible = std::min<int64_t>(cnt, pos + 1 - j0);
      // keys of this chunk before the query's window (0 without a window: the same masks as then)
      const int64_t skip = g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1 - j0) : 0;
      sc.vis[x] = visible > skip ? visible : 0;
      if (visible <= skip) continue;
      const __m256 mask_lo = _mm256_andnot_ps(_mm256_castsi256_ps(lane_mask8(skip)),
                                              _mm256_castsi256_ps(lane_mask8(visible)));
      const __m256 mask_hi = _mm256_andnot_ps(_mm256_castsi256_ps(lane_mask8(skip - 8)),
                                              _mm256_castsi256_ps(lane_mask8(visible - 8)));
      const __m256 s_lo = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + x * kChunk), mask_lo);
      const __m256 s_hi = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + x * kChunk + 8), mask_hi);
      const float m_new = std::max(m[x], hmax8(_mm256_max_ps(s_lo, s_hi)));
      const float alpha = std::isinf(m[x]) ? 0.0f : std::exp(m[x] - m_new);
      const __m256 mv = _mm256_set1_ps(m_new);
      const __m256 p_lo = _mm256_and_ps(tandem::avx2::exp8(_mm256_sub_ps(s_lo, mv)), mask_lo);
      const __m256 p_hi = _mm256_and_ps(tandem::avx2::exp8(_mm256_sub_ps(s_hi, mv)), mask_hi);
      _mm256_storeu_ps(s + x * kChunk, p_lo);
      _mm256_storeu_ps(s + x * kChunk + 8, p_hi);
      l[x] = l[x] * alpha + hsum8(_mm256_add_ps(p_lo, p_hi));
      m[x] = m_new;
      if (alpha != 1.0f) {
        float* ax = acc + x * dp;
        for (int64_t c = 0; c < dp; c += 8)
          _mm256_storeu_ps(ax + c, _mm256_mul_ps(_mm256_loadu_ps(ax + c), _mm256_set1_ps(alpha)));
      }
    }
    for (int64_t x = 0; x < nq; x += 2) {  // acc_x += p_x V, each query over its own visible keys
      const bool pair = x + 1 < nq;
      pv_slabs(acc + x * dp, pair ? acc + (x + 1) * dp : nullptr, s + x * kChunk, s + (x + 1) * kChunk, vrows, ks, dp,
               sc.vis[x], pair ? sc.vis[x + 1] : 0);
    }
    j0 += cnt;
  }
  for (int64_t x = 0; x < nq; ++x) {
    const int64_t i = i0 + x / g.group, h = head * g.group + x % g.group;
    T* dst = out + i * g.out_stride + h * D;
    const __m256 inv = _mm256_set1_ps(l[x] > 0.0f ? 1.0f / l[x] : 0.0f);
    for (int64_t c = 0; c < D; c += 8) store8(dst + c, _mm256_mul_ps(_mm256_loadu_ps(acc + x * dp + c), inv), D - c);
  }
}

struct Item {
  int64_t row, head, i0, i1, cost;
};

// Work items in an order whose contiguous ranges cost about the same (a static split over threads
// then balances): sorted by cost (query-key pairs), then taken from both ends alternately.
std::vector<Item> plan(const int32_t* starts, const int32_t* lens, int64_t rows, const Geometry& g,
                       int64_t max_query_len) {
  std::vector<Item> items;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    if (n == 0 || n > max_query_len) continue;
    for (int64_t i0 = 0; i0 < n; i0 += g.tile) {
      const int64_t i1 = std::min(n, i0 + g.tile);
      int64_t keys = lens[r] - n + i1;  // the last query's context (its window, plus the tile's spread)
      if (g.window > 0) keys = std::min(keys, g.window + i1 - i0);
      for (int64_t h = 0; h < g.num_kv; ++h) items.push_back({r, h, i0, i1, (i1 - i0) * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<Item> order;
  order.reserve(items.size());
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    order.push_back(items[lo++]);
    if (lo < hi) order.push_back(items[--hi]);
  }
  return order;
}

void check_tokens(const at::Tensor& t, const char* name, int64_t heads, int64_t D) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == D && t.stride(2) == 1 && t.stride(1) == D,
              "paged_attention: ", name, " must be [T, ", heads, ", ", D, "] with contiguous heads");
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
         at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& seq_lens,
         const at::Tensor& qsl, const Geometry& g, int64_t max_query_len) {
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t row_elems = g.num_kv * g.head_dim, num_tokens = q.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {  // store this step's K/V at their slots first
    std::memcpy(kc + slot[t] * row_elems, k.data_ptr<T>() + t * k.stride(0), row_elems * sizeof(T));
    std::memcpy(vc + slot[t] * row_elems, v.data_ptr<T>() + t * v.stride(0), row_elems * sizeof(T));
  }
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t table_stride = tables.stride(0);
  const std::vector<Item> items = plan(starts, lens, seq_lens.size(0), g, max_query_len);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t w = begin; w < end; ++w) {
      const Item& it = items[w];
      const int64_t r = it.row, n = starts[r + 1] - starts[r];
      attend_tile<T>(g, qp + starts[r] * g.q_stride, kc, vc, tab + r * table_stride, lens[r], n, it.head, it.i0,
                     it.i1, op + starts[r] * g.out_stride, sc);
    }
  });
}

}  // namespace

// Writes k, v [T, KV, D] into k_cache, v_cache [N, B, KV, D] at slot_mapping [T] (int64), then for
// every row r with 1 <= n_r <= max_query_len query tokens writes out[T, H, D] (rows with more query
// tokens are left untouched for the caller). block_tables [R, M], seq_lens [R], query_start_loc [R+1]
// are int32. q, k, v, out may have a token stride (views of a fused QKV output).
// paged_attention_ex also takes the sliding window (keys; 0: none) and the score soft-cap (0: none).
void paged_attention_ex(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                        at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                        at::Tensor query_start_loc, double scale, int64_t max_query_len, int64_t window,
                        double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must be >= 0");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "paged_attention: bf16 or fp32 only");
  for (const at::Tensor* t : {&out, &k, &v, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype, "paged_attention: all tensors must share q's dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "paged_attention: caches must be contiguous [N, B, KV, D]");
  Geometry g{};
  g.num_kv = k_cache.size(2);
  g.head_dim = k_cache.size(3);
  g.block_size = k_cache.size(1);
  TORCH_CHECK(g.head_dim <= 256, "paged_attention: head_dim > 256 is not supported");
  TORCH_CHECK(q.dim() == 3 && q.size(1) % g.num_kv == 0, "paged_attention: heads must be a multiple of KV heads");
  g.group = q.size(1) / g.num_kv;
  g.dp = (g.head_dim + 7) / 8 * 8;
  // NOTE: about 2048 fp32 lanes of queries per item keeps queries + accumulators in L1 (16 KiB).
  g.tile = std::max<int64_t>(1, 2048 / (g.group * g.dp));
  check_tokens(q, "q", q.size(1), g.head_dim);
  check_tokens(out, "out", q.size(1), g.head_dim);
  check_tokens(k, "k", g.num_kv, g.head_dim);
  check_tokens(v, "v", g.num_kv, g.head_dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == q.size(0),
              "paged_attention: slot_mapping must be int64 [T]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt, "paged_attention: metadata must be int32");
  g.q_stride = q.stride(0);
  g.out_stride = out.stride(0);
  g.scale = static_cast<float>(scale);
  g.window = window;
  g.softcap = static_cast<float>(softcap);
  auto slots = slot_mapping.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  if (dtype == at::kBFloat16)
    run<c10::BFloat16>(out, q, k, v, k_cache, v_cache, slots, tables, lens, qsl, g, max_query_len);
  else
    run<float>(out, q, k, v, k_cache, v_cache, slots, tables, lens, qsl, g, max_query_len);
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len) {
  paged_attention_ex(out, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                     max_query_len, 0, 0.0);
}
