// Paged attention over the KV cache in place (no gather), online softmax, bf16 or fp32.
//
// For each (row, KV head) a thread walks the row's block table 16 keys at a time. Every query of
// the row for the heads sharing that KV head (grouped-query attention, Ainslie et al. 2023) keeps a
// running max m, normaliser l and fp32 accumulator; each chunk of keys updates them with the online
// softmax of Milakov & Gimelshein 2018 ("Online normalizer calculation for softmax"), as in
// FlashAttention / flash-decoding: m' = max(m, max s), l' = l e^(m - m') + sum e^(s - m'),
// acc' = acc e^(m - m') + sum e^(s - m') v. Query i of a row sits at position
// seq_len - n + i and sees keys 0..that position (causal). Memory per thread is O(queries x D),
// independent of the context length; each K and V row is read once per (row tile, KV head), a row's
// queries taken 16 at a time (each tile sees only the keys up to its last query; a query's bits do not
// depend on the tiling: batch invariance, prompt rows included).
#include <ATen/Parallel.h>

#include "avx2/parallel.h"
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using tandem::exp16;
using tandem::lane_mask;
using tandem::load16;
using tandem::store16;

struct Geometry {
  int64_t num_kv, group, head_dim, block_size, chunks;  // chunks: ceil(head_dim / 16)
  int64_t q_stride, out_stride;                          // elements between consecutive tokens
  float scale;
};

// out[k] = _mm512_reduce_add_ps(v[k]) for 16 vectors at once, with that intrinsic's own tree (GCC's
// avx512fintrin.h: lanes i + i+8, then i + i+4, then i + i+2, then 0 + 1), so each sum has its bits:
// four butterfly steps of 8 + 4 + 2 + 1 adds for the 16 sums instead of 4 x 16.
inline __m512 reduce_add16(const __m512* v) {
  __m512 c[8], e[4], gv[2];
  for (int j = 0; j < 8; ++j)  // stride 8: keys 2j (lanes 0-7), 2j+1 (lanes 8-15)
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // stride 4: 128-bit lane L holds key 4j + L
    e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int j = 0; j < 2; ++j)  // stride 2: lane L holds keys 8j + L (elements 0, 1), 8j + 4 + L (2, 3)
    gv[j] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * j], e[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(e[2 * j], e[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // stride 1: element 4L + i holds key 4i + L
  const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(gv[0], gv[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(gv[0], gv[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), h);
}

// One (row, KV head) work item: n queries of each of the group's heads over seq_len keys. Each chunk of
// 16 keys is widened to fp32 once; then the queries, two at a time, take their 16 scores (one FMA chain
// per key over the C 16-lane pieces of head_dim, its lanes summed by reduce_add16), their online softmax
// updates and their P V sums with both accumulators in registers (two independent FMA chains). Same
// operations in the same order per query as the key-at-a-time loop this replaced: the same bits.
template <typename T, int C>
void attend_row_head(const Geometry& g, const T* q, const T* kc, const T* vc, const int32_t* table,
                     int64_t seq_len, int64_t n, int64_t kv_head, T* out, std::vector<float>& buf) {
  constexpr int64_t Dp = 16 * C;
  const int64_t D = g.head_dim, nq = n * g.group;
  const __mmask16 tail = lane_mask(D - 16 * (C - 1));
  buf.assign(nq * (2 * Dp + 2) + 2 * 16 * Dp + 32, 0.0f);
  float* qf = buf.data();        // [nq, Dp] scaled queries
  float* acc = qf + nq * Dp;     // [nq, Dp]
  float* m = acc + nq * Dp;      // [nq]
  float* l = m + nq;             // [nq]
  float* kb = l + nq;            // [16, Dp] the chunk's keys in fp32 (zero past its end)
  float* vb = kb + 16 * Dp;      // [16, Dp] its values
  float* pb = vb + 16 * Dp;      // [2, 16] two queries' probabilities
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < g.group; ++h) {
      const T* src = q + i * g.q_stride + (kv_head * g.group + h) * D;
      float* dst = qf + (i * g.group + h) * Dp;
      for (int c = 0; c < C; ++c) {
        __m512 x = load16(src + 16 * c, c + 1 == C ? tail : (__mmask16)0xFFFF);
        _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(x, _mm512_set1_ps(g.scale)));
      }
      m[i * g.group + h] = -std::numeric_limits<float>::infinity();
    }
  const int64_t first_pos = seq_len - n;
  const int64_t row_elems = g.num_kv * D;
  for (int64_t j0 = 0; j0 < seq_len;) {
    const int64_t off = j0 % g.block_size;
    const int64_t cnt = std::min<int64_t>({16, g.block_size - off, seq_len - j0});
    const int64_t base = (static_cast<int64_t>(table[j0 / g.block_size]) * g.block_size + off) * row_elems +
                         kv_head * D;
    for (int64_t jj = 0; jj < 16; ++jj)
      for (int c = 0; c < C; ++c) {
        const __mmask16 mk = jj < cnt ? (c + 1 == C ? tail : (__mmask16)0xFFFF) : (__mmask16)0;
        _mm512_storeu_ps(kb + jj * Dp + 16 * c, load16(kc + base + jj * row_elems + 16 * c, mk));
        _mm512_storeu_ps(vb + jj * Dp + 16 * c, load16(vc + base + jj * row_elems + 16 * c, mk));
      }
    for (int64_t x0 = 0; x0 < nq; x0 += 2) {  // two queries at a time: independent FMA chains in P V
      const int64_t nu = std::min<int64_t>(2, nq - x0);
      int64_t vis_max = 0;
      float alpha[2] = {1.0f, 1.0f};
      for (int64_t u = 0; u < nu; ++u) {
        const int64_t x = x0 + u;
        const int64_t visible = std::min<int64_t>(cnt, first_pos + x / g.group + 1 - j0);
        if (visible <= 0) {  // no key of this chunk: p = 0, accumulator kept
          _mm512_storeu_ps(pb + 16 * u, _mm512_setzero_ps());
          continue;
        }
        vis_max = std::max(vis_max, visible);
        const float* qx = qf + x * Dp;
        __m512 qr[C], d[16];
        for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(qx + 16 * c);
        for (int jj = 0; jj < 16; ++jj) {  // scores s[jj] = q . k_jj
          const float* kp = kb + jj * Dp;
          d[jj] = _mm512_mul_ps(qr[0], _mm512_loadu_ps(kp));
          for (int c = 1; c < C; ++c) d[jj] = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kp + 16 * c), d[jj]);
        }
        // online softmax update of query x
        const __mmask16 vm = lane_mask(visible);
        const __m512 sv = _mm512_maskz_mov_ps(vm, reduce_add16(d));
        const float m_new = std::max(m[x], _mm512_mask_reduce_max_ps(vm, sv));
        alpha[u] = std::isinf(m[x]) ? 0.0f : std::exp(m[x] - m_new);
        const __m512 p = _mm512_maskz_mov_ps(vm, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
        _mm512_storeu_ps(pb + 16 * u, p);
        l[x] = l[x] * alpha[u] + _mm512_reduce_add_ps(p);
        m[x] = m_new;
      }
      if (vis_max == 0) continue;
      // acc += p[jj] * v_jj in key order; a zero p leaves acc as it is (masked FMA)
      __m512 a[2][C];
      for (int64_t u = 0; u < nu; ++u)
        for (int c = 0; c < C; ++c) {
          a[u][c] = _mm512_loadu_ps(acc + (x0 + u) * Dp + 16 * c);
          if (alpha[u] != 1.0f) a[u][c] = _mm512_mul_ps(a[u][c], _mm512_set1_ps(alpha[u]));
        }
      if (nu == 2) {
        for (int64_t jj = 0; jj < vis_max; ++jj) {
          const __m512 p0 = _mm512_set1_ps(pb[jj]), p1 = _mm512_set1_ps(pb[16 + jj]);
          const __mmask16 k0 = _mm512_cmp_ps_mask(p0, _mm512_setzero_ps(), _CMP_NEQ_UQ);
          const __mmask16 k1 = _mm512_cmp_ps_mask(p1, _mm512_setzero_ps(), _CMP_NEQ_UQ);
          for (int c = 0; c < C; ++c) {
            const __m512 vv = _mm512_loadu_ps(vb + jj * Dp + 16 * c);
            a[0][c] = _mm512_mask3_fmadd_ps(p0, vv, a[0][c], k0);
            a[1][c] = _mm512_mask3_fmadd_ps(p1, vv, a[1][c], k1);
          }
        }
      } else {
        for (int64_t jj = 0; jj < vis_max; ++jj) {
          const __m512 p0 = _mm512_set1_ps(pb[jj]);
          const __mmask16 k0 = _mm512_cmp_ps_mask(p0, _mm512_setzero_ps(), _CMP_NEQ_UQ);
          for (int c = 0; c < C; ++c)
            a[0][c] = _mm512_mask3_fmadd_ps(p0, _mm512_loadu_ps(vb + jj * Dp + 16 * c), a[0][c], k0);
        }
      }
      for (int64_t u = 0; u < nu; ++u)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (x0 + u) * Dp + 16 * c, a[u][c]);
    }
    j0 += cnt;
  }
  for (int64_t x = 0; x < nq; ++x) {
    const int64_t i = x / g.group, h = kv_head * g.group + x % g.group;
    T* dst = out + i * g.out_stride + h * D;
    const __m512 inv = _mm512_set1_ps(l[x] > 0.0f ? 1.0f / l[x] : 0.0f);
    for (int c = 0; c < C; ++c)
      store16(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + x * Dp + 16 * c), inv),
              c + 1 == C ? tail : (__mmask16)0xFFFF);
  }
}

template <typename T>
using AttendFn = void (*)(const Geometry&, const T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t,
                          T*, std::vector<float>&);

// attend_row_head for chunks = ceil(head_dim / 16) pieces (1..16: head_dim <= 256).
template <typename T, int... Cs>
AttendFn<T> attend_for(int64_t chunks, std::integer_sequence<int, Cs...>) {
  constexpr AttendFn<T> table[] = {&attend_row_head<T, Cs + 1>...};
  return table[chunks - 1];
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
  const int64_t rows = seq_lens.size(0), table_stride = tables.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Work items: (row, first query, end query) tiles of at most kQueryTile queries. A tile [i0, i1) of a row
  // with n queries and seq_len L is attended as a row of i1 - i0 queries and L - n + i1 keys: each query
  // sees the same keys in the same 16-key chunks either way, so its bits do not depend on the tiling, on
  // n or on the other rows (batch invariance: a prompt's last token gets the bits it gets decoded alone).
  constexpr int64_t kQueryTile = 16;
  std::vector<int64_t> items;  // 3 per item
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    if (n == 0 || n > max_query_len) continue;
    for (int64_t i0 = 0; i0 < n; i0 += kQueryTile) items.insert(items.end(), {r, i0, std::min(n, i0 + kQueryTile)});
  }
  const int64_t count = static_cast<int64_t>(items.size()) / 3;
  const AttendFn<T> attend = attend_for<T>(g.chunks, std::make_integer_sequence<int, 16>{});
  tandem::avx2::parallel_for(0, count * g.num_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t* it = items.data() + 3 * (w / g.num_kv);
      const int64_t r = it[0], i0 = it[1], i1 = it[2], head = w % g.num_kv, n = starts[r + 1] - starts[r];
      attend(g, qp + (starts[r] + i0) * g.q_stride, kc, vc, tab + r * table_stride, lens[r] - n + i1,
                         i1 - i0, head, op + (starts[r] + i0) * g.out_stride, buf);
    }
  });
}

}  // namespace

// Writes k, v [T, KV, D] into k_cache, v_cache [N, B, KV, D] at slot_mapping [T] (int64), then for
// every row r with 1 <= n_r <= max_query_len query tokens writes out[T, H, D] (rows with more query
// tokens are left untouched for the caller). block_tables [R, M], seq_lens [R], query_start_loc [R+1]
// are int32. q, k, v, out may have a token stride (views of a fused QKV output).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len) {
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
  TORCH_CHECK(q.size(1) % g.num_kv == 0, "paged_attention: heads must be a multiple of KV heads");
  g.group = q.size(1) / g.num_kv;
  g.chunks = (g.head_dim + 15) / 16;
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
  auto slots = slot_mapping.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  if (dtype == at::kBFloat16)
    run<c10::BFloat16>(out, q, k, v, k_cache, v_cache, slots, tables, lens, qsl, g, max_query_len);
  else
    run<float>(out, q, k, v, k_cache, v_cache, slots, tables, lens, qsl, g, max_query_len);
}
