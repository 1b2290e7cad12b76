// Decode attention straight from the paged KV cache, for the CPU backend.
//
// The torch fallback gathers every decoding request's context out of the cache
// into a padded tensor before attending; at batch 64 that copy moves more bytes
// than the model weights. This kernel reads each K/V row in place, once per KV
// head for all query heads of its group, in two passes (scores + softmax, then
// the weighted sum of V), parallel over (request, KV head).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* ctx_lens, T* out, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                          int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t ctx = ctx_lens[r];
      const int64_t* table = tables + r * max_blocks;
      scores.assign(group * ctx, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + (r * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qrow[d]);
      }
      const int64_t head_base = kvh * num_blocks * block_size * head_dim;
      for (int64_t t = 0; t < ctx; ++t) {
        const T* krow = k_cache + head_base + (table[t / block_size] * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * static_cast<float>(krow[d]);
          scores[g * ctx + t] = s * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        denom[g] = sum;
      }
      for (int64_t t = 0; t < ctx; ++t) {
        const T* vrow = v_cache + head_base + (table[t / block_size] * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(vrow[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = out + (r * num_heads + kvh * group + g) * head_dim;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
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
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            R, H, Hkv, NB, B, D, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache");
}
