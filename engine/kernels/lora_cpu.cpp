// The LoRA terms of a short step's adapter rows on the CPU, one call per projection. At decode
// sizes the torch GEMMs (or batched GEMMs) behind them cost more in dispatch and thread wake-ups
// than in arithmetic; here each row's terms are a few dot products and row updates over weights
// that stay in cache for the adapter's next row.
//
//   lora_add_rows(out [T, N], x [T, K], gather [G, M], counts [G], a [G, R, K], bt [G, R, N], ranks [G])
//       for each adapter g and each of its rows j = gather[g, i], i < counts[g]:
//       out[j] += (a[g, :ranks[g]] @ x[j]) @ bt[g, :ranks[g]]     (the scaling is in bt)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <utility>
#include <vector>

#include "cpu_ops.h"

void lora_add_rows(torch::Tensor out, torch::Tensor x, torch::Tensor gather, torch::Tensor counts,
                   torch::Tensor a, torch::Tensor bt, torch::Tensor ranks) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat && x.scalar_type() == torch::kFloat &&
                  a.scalar_type() == torch::kFloat && bt.scalar_type() == torch::kFloat,
              "lora_add_rows: fp32 only");
  TORCH_CHECK(gather.scalar_type() == torch::kLong && counts.scalar_type() == torch::kLong &&
                  ranks.scalar_type() == torch::kLong,
              "lora_add_rows: int64 indices");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.stride(1) == 1 && x.stride(1) == 1,
              "lora_add_rows: rows of out and x must be contiguous");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && gather.is_contiguous() &&
                  counts.is_contiguous() && ranks.is_contiguous(),
              "lora_add_rows: contiguous weights and indices");
  const int64_t G = gather.size(0), M = gather.size(1), R = a.size(1), K = a.size(2), N = bt.size(2);
  TORCH_CHECK(x.size(1) == K && out.size(1) == N && bt.size(0) == G && a.size(0) == G &&
                  counts.size(0) == G && ranks.size(0) == G && bt.size(1) == R,
              "lora_add_rows: shapes do not match");
  const int64_t* rows = gather.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  const int64_t T = out.size(0);
  std::vector<std::pair<int64_t, int64_t>> items;  // (adapter, row): distinct rows, disjoint writes
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(count[g] >= 0 && count[g] <= M && rank[g] >= 0 && rank[g] <= R, "lora_add_rows: bad counts or ranks");
    if (rank[g] == 0) continue;
    for (int64_t i = 0; i < count[g]; ++i) {
      const int64_t row = rows[g * M + i];
      TORCH_CHECK(row >= 0 && row < T && row < x.size(0), "lora_add_rows: row out of range");
      items.emplace_back(g, row);
    }
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> t(R);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = items[it].first, row = items[it].second, r_n = rank[g];
      const float* xr = xp + row * xs;
      const float* ag = ap + g * R * K;
      for (int64_t r = 0; r < r_n; ++r) {
        const float* ar = ag + r * K;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += ar[k] * xr[k];
        t[r] = s;
      }
      float* orow = op + row * os;
      const float* bg = bp + g * R * N;
      for (int64_t r = 0; r < r_n; ++r) {
        const float tr = t[r];
        const float* br = bg + r * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) orow[n] += tr * br[n];
      }
    }
  });
}
