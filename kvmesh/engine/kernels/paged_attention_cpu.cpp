// Decode attention straight from the paged KV cache, for the CPU backend.
//
// The torch fallback gathers every decoding request's context out of the cache
// into a padded tensor before attending; at batch 64 that copy moves more bytes
// than the model weights. This kernel reads each K/V row in place from its block,
// in two passes (scores + softmax, then the weighted sum of V), parallel over
// (request, KV head). The head size is a compile-time constant for the common
// sizes, and fp32 head size 64 has an AVX-512 path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

// Calls f(row, t) for the context's rows t = 0..ctx-1 of one head, block by block
// (no per-token division). With `prefetch`, the next block is requested while this
// one is read: blocks are scattered pages the hardware prefetcher does not follow.
template <typename T, typename F>
static inline void for_each_row(const T* head, const int64_t* table, int64_t ctx, int64_t block_size,
                                int64_t head_dim, bool prefetch, F&& f) {
  const int64_t block_elems = block_size * head_dim;
  const int64_t nblocks = (ctx + block_size - 1) / block_size;
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* blk = head + table[b] * block_elems;
    if (prefetch && b + 1 < nblocks) {
      const char* next = reinterpret_cast<const char*>(head + table[b + 1] * block_elems);
      for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64)
        __builtin_prefetch(next + off);
    }
    const int64_t n = std::min(block_size, ctx - b * block_size);
    for (int64_t i = 0; i < n; ++i) f(blk + i * head_dim, b * block_size + i);
  }
}

// s[t] = exp(s[t] - mx) in place; returns the sum (the loop vectorises with -ffast-math).
static inline float exp_and_sum(float* s, int64_t n, float mx) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return sum;
}

template <typename T, int D>
static void decode_task(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t ctx,
                        int64_t block_size, int64_t group, int64_t head_dim_rt, float scale, T* out,
                        std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t hd = D > 0 ? D : head_dim_rt;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = static_cast<float>(q[g * hd + d]) * scale;
  scores.resize(group * ctx);
  // Pass 1: scores of all query heads of the group, each K row read once.
  for_each_row(k_head, table, ctx, block_size, hd, false, [&](const T* krow, int64_t t) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * hd;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < hd; ++d) s += qg[d] * static_cast<float>(krow[d]);
      scores[g * ctx + t] = s;
    }
  });
  // Softmax per query head.
  std::vector<float> inv(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
    inv[g] = 1.f / exp_and_sum(sg, ctx, mx);
  }
  // Pass 2: weighted sum of V, each V row read once.
  std::fill(acc.begin(), acc.end(), 0.f);
  for_each_row(v_head, table, ctx, block_size, hd, false, [&](const T* vrow, int64_t t) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * ctx + t];
      float* ag = acc.data() + g * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) ag[d] += p * static_cast<float>(vrow[d]);
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = static_cast<T>(acc[g * hd + d] * inv[g]);
}

#if defined(__AVX512F__)
#include <immintrin.h>
// fp32, head size 64: one query head at a time (its K/V rows are re-read from L2 for the
// other heads of the group), rows as four 16-lane vectors kept in registers.
static void decode_task_f32_d64(const float* __restrict__ q, const float* __restrict__ k_head,
                                const float* __restrict__ v_head, const int64_t* table, int64_t ctx,
                                int64_t block_size, int64_t group, float scale, float* __restrict__ out,
                                std::vector<float>& scores_buf) {
  constexpr int64_t D = 64;
  scores_buf.resize(ctx);
  float* __restrict__ sc = scores_buf.data();
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512 q0 = _mm512_mul_ps(_mm512_loadu_ps(qg), sv), q1 = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), sv);
    const __m512 q2 = _mm512_mul_ps(_mm512_loadu_ps(qg + 32), sv), q3 = _mm512_mul_ps(_mm512_loadu_ps(qg + 48), sv);
    float mx = -std::numeric_limits<float>::infinity();
    for_each_row(k_head, table, ctx, block_size, D, g == 0, [&](const float* k, int64_t t) {
      __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
      __m512 c = _mm512_mul_ps(q1, _mm512_loadu_ps(k + 16));
      a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), a);
      c = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), c);
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
      sc[t] = s;
      mx = std::max(mx, s);
    });
    const float sum = exp_and_sum(sc, ctx, mx);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for_each_row(v_head, table, ctx, block_size, D, g == 0, [&](const float* v, int64_t t) {
      const __m512 p = _mm512_set1_ps(sc[t]);
      a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
      a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
      a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 32), a2);
      a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 48), a3);
    });
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    float* o = out + g * D;
    _mm512_storeu_ps(o, _mm512_mul_ps(a0, inv));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(a1, inv));
    _mm512_storeu_ps(o + 32, _mm512_mul_ps(a2, inv));
    _mm512_storeu_ps(o + 48, _mm512_mul_ps(a3, inv));
  }
}
#endif

template <typename T, int D>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* ctx_lens, T* out, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                          int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t head_base = kvh * num_blocks * block_size * head_dim;
      const int64_t qoff = (r * num_heads + kvh * group) * head_dim;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float> && D == 64) {
        decode_task_f32_d64(q + qoff, k_cache + head_base, v_cache + head_base, tables + r * max_blocks,
                            ctx_lens[r], block_size, group, scale, out + qoff, scores);
        continue;
      }
#endif
      decode_task<T, D>(q + qoff, k_cache + head_base, v_cache + head_base, tables + r * max_blocks,
                        ctx_lens[r], block_size, group, head_dim, scale, out + qoff, qf, scores, acc);
    }
  });
}

// q: [R, H, D]; k_cache, v_cache: [Hkv, NB, B, D]; block_tables: [R, max_blocks] int64;
// ctx_lens: [R] int64 (every length >= 1). Returns [R, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), B = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto d_const) {
      constexpr int Dc = decltype(d_const)::value;
      decode_kernel<scalar_t, Dc>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                  R, H, Hkv, NB, B, D, tables.size(1), static_cast<float>(scale));
    };
    if (D == 64) run(std::integral_constant<int, 64>{});
    else if (D == 128) run(std::integral_constant<int, 128>{});
    else run(std::integral_constant<int, 0>{});
  });
  return out;
}
