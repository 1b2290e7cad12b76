// Decode attention straight from the paged KV cache, for the CPU backend.
//
// The torch fallback gathers every decoding request's context out of the cache
// into a padded tensor before attending; at batch 64 that copy moves more bytes
// than the model weights. This kernel reads each K/V row in place, once per KV
// head for all query heads of its group, block by block (no per-token division),
// in two passes (scores + softmax, then the weighted sum of V), parallel over
// (request, KV head). The head size is a compile-time constant for the common
// sizes so the dot products and the V accumulation stay in vector registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

template <typename T, int D>
static void decode_task(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t ctx,
                        int64_t block_size, int64_t group, int64_t head_dim_rt, float scale, T* out,
                        std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t hd = D > 0 ? D : head_dim_rt;
  const int64_t block_elems = block_size * hd;
  const int64_t nblocks = (ctx + block_size - 1) / block_size;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = static_cast<float>(q[g * hd + d]) * scale;
  scores.resize(group * ctx);
  // Pass 1: scores, block by block.
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* kb = k_head + table[b] * block_elems;
    const int64_t n = std::min(block_size, ctx - b * block_size);
    for (int64_t i = 0; i < n; ++i) {
      const T* krow = kb + i * hd;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * hd;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hd; ++d) s += qg[d] * static_cast<float>(krow[d]);
        scores[g * ctx + b * block_size + i] = s;
      }
    }
  }
  // Softmax per query head (the exp loop vectorises).
  std::vector<float> inv(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    inv[g] = 1.f / sum;
  }
  // Pass 2: weighted sum of V.
  std::fill(acc.begin(), acc.end(), 0.f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* vb = v_head + table[b] * block_elems;
    const int64_t n = std::min(block_size, ctx - b * block_size);
    for (int64_t i = 0; i < n; ++i) {
      const T* vrow = vb + i * hd;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * ctx + b * block_size + i];
        float* ag = acc.data() + g * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ag[d] += p * static_cast<float>(vrow[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = static_cast<T>(acc[g * hd + d] * inv[g]);
}

#if defined(__AVX512F__)
#include <immintrin.h>
// fp32, head size 64: one query head at a time, K/V rows as four 16-lane vectors.
static void decode_task_f32_d64(const float* __restrict__ q, const float* __restrict__ k_head,
                                const float* __restrict__ v_head, const int64_t* table, int64_t ctx,
                                int64_t block_size, int64_t group, float scale, float* __restrict__ out,
                                std::vector<float>& scores_buf) {
  constexpr int64_t D = 64;
  const int64_t block_elems = block_size * D;
  const int64_t nblocks = (ctx + block_size - 1) / block_size;
  scores_buf.resize(ctx);
  float* __restrict__ sc = scores_buf.data();
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512 q0 = _mm512_mul_ps(_mm512_loadu_ps(qg), sv), q1 = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), sv);
    const __m512 q2 = _mm512_mul_ps(_mm512_loadu_ps(qg + 32), sv), q3 = _mm512_mul_ps(_mm512_loadu_ps(qg + 48), sv);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* kb = k_head + table[b] * block_elems;
      const int64_t n = std::min(block_size, ctx - b * block_size);
      float* sb = sc + b * block_size;
      if (g == 0 && b + 1 < nblocks) {  // blocks are scattered pages: prefetch the next one
        const char* nk = reinterpret_cast<const char*>(k_head + table[b + 1] * block_elems);
        for (int64_t off = 0; off < block_elems * 4; off += 64) _mm_prefetch(nk + off, _MM_HINT_T0);
      }
      for (int64_t i = 0; i < n; ++i) {
        const float* k = kb + i * D;
        __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
        __m512 c = _mm512_mul_ps(q1, _mm512_loadu_ps(k + 16));
        a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), a);
        c = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), c);
        const float s = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
        sb[i] = s;
        mx = std::max(mx, s);
      }
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* vb = v_head + table[b] * block_elems;
      const int64_t n = std::min(block_size, ctx - b * block_size);
      const float* sb = sc + b * block_size;
      if (g == 0 && b + 1 < nblocks) {
        const char* nv = reinterpret_cast<const char*>(v_head + table[b + 1] * block_elems);
        for (int64_t off = 0; off < block_elems * 4; off += 64) _mm_prefetch(nv + off, _MM_HINT_T0);
      }
      for (int64_t i = 0; i < n; ++i) {
        const float* v = vb + i * D;
        const __m512 p = _mm512_set1_ps(sb[i]);
        a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
        a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
        a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 32), a2);
        a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 48), a3);
      }
    }
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
