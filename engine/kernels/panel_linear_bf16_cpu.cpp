// Linear layers over bf16 weights packed in panels of 16 output features, input features in pairs,
// for the CPU backend's bf16 decode steps (fp32 accumulation, the output rounded to bf16 once).
//
//   pack_panels_bf16(w [N, K] bf16) -> [ceil(N / 16), ceil(K / 2), 32] bf16
//       panel p, pair r: w[16p + j, 2r] and w[16p + j, 2r + 1] side by side for j = 0..15 (zero past K)
//   panel_linear_bf16(x [M, K] bf16, panels, N, bias?) -> [M, N] bf16   x @ w.T (+ bias)
//
// Why: torch's bf16 linear for one row is ~16x slower than its fp32 one on an AVX-512 CPU, while a
// decode-size linear is a stream over its weights, which bf16 halves. A panel row is 64 bytes, the
// layout AVX512-BF16's dot product reads: one `vdpbf16ps` multiplies 16 outputs' weight pairs by
// a row's input pair (broadcast) and adds both products into 16 fp32 sums. Without AVX512-BF16 an
// AVX-512 build widens the pairs to fp32 in registers (a shift and a mask) for two FMAs, still
// reading half the bytes; other builds run a portable loop over the same layout.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kPairRow = 2 * kPanel;  // bf16 values in a panel row: 16 outputs x 2 inputs
constexpr int64_t kRowBlock = 16;
// As panel_linear_cpu.cpp: panel rows (64 bytes) prefetched ahead into L1, and farther into L2.
constexpr int64_t kPrefetchRows = 32;
constexpr int64_t kPrefetchL2Rows = 1024;

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
// Rows [0, MB) of x (stride ldx, bf16) against one panel: sums[m][0..15] in fp32. With fewer
// than 4 rows the pairs are split KS ways, so 4+ independent chains hide the latency.
template <int MB, int KS>
inline void panel_block(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, float* sums) {
  const int64_t pairs = K / 2;
  __m512 acc[KS][MB];
  for (int s = 0; s < KS; ++s)
    for (int m = 0; m < MB; ++m) acc[s][m] = _mm512_setzero_ps();
  auto step = [&](int s, int64_t r, const __m512i w, auto pair_of) {
#if defined(__AVX512BF16__)
    for (int m = 0; m < MB; ++m)
      acc[s][m] = _mm512_dpbf16_ps(acc[s][m], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of(m, r))), (__m512bh)w);
#else
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    for (int m = 0; m < MB; ++m) {
      const uint32_t xp = pair_of(m, r);
      acc[s][m] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp << 16))), lo, acc[s][m]);
      acc[s][m] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp & 0xFFFF0000u))), hi,
                                  acc[s][m]);
    }
#endif
  };
  auto full_pair = [&](int m, int64_t r) { return load_pair(x + m * ldx + 2 * r); };
  int64_t r = 0;
  for (; r + KS <= pairs; r += KS) {
    for (int s = 0; s < KS; ++s) {
      const uint16_t* row = panel + (r + s) * kPairRow;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * kPairRow), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchL2Rows * kPairRow), _MM_HINT_T1);
      step(s, r + s, _mm512_loadu_si512(row), full_pair);
    }
  }
  for (; r < pairs; ++r) step(0, r, _mm512_loadu_si512(panel + r * kPairRow), full_pair);
  if (K % 2)  // the last input alone: its pair's second weight is the packing's zero
    step(0, pairs, _mm512_loadu_si512(panel + pairs * kPairRow),
         [&](int m, int64_t) { return static_cast<uint32_t>(x[m * ldx + K - 1]); });
  for (int m = 0; m < MB; ++m) {
    __m512 sum = acc[0][m];
    for (int s = 1; s < KS; ++s) sum = _mm512_add_ps(sum, acc[s][m]);
    _mm512_storeu_ps(sums + m * kPanel, sum);
  }
}

using BlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*);

constexpr BlockFn kBlocks[kRowBlock + 1] = {
    nullptr,
    panel_block<1, 4>, panel_block<2, 2>, panel_block<3, 2>, panel_block<4, 1>,
    panel_block<5, 1>, panel_block<6, 1>, panel_block<7, 1>, panel_block<8, 1>,
    panel_block<9, 1>, panel_block<10, 1>, panel_block<11, 1>, panel_block<12, 1>,
    panel_block<13, 1>, panel_block<14, 1>, panel_block<15, 1>, panel_block<16, 1>,
};

inline void block_sums(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel, int64_t K, float* sums) {
  kBlocks[rows](x, ldx, panel, K, sums);
}
#else
// Without AVX-512: the same sums in a loop the compiler vectorises.
inline void block_sums(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel, int64_t K, float* sums) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t m = 0; m < rows; ++m) {
    float acc[kPanel] = {0.f};
    for (int64_t r = 0; r < pairs; ++r) {
      const float x0 = bf16_to_float(x[m * ldx + 2 * r]);
      const float x1 = 2 * r + 1 < K ? bf16_to_float(x[m * ldx + 2 * r + 1]) : 0.f;
      const uint16_t* w = panel + r * kPairRow;
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += x0 * bf16_to_float(w[2 * j]) + x1 * bf16_to_float(w[2 * j + 1]);
    }
    std::memcpy(sums + m * kPanel, acc, sizeof(acc));
  }
}
#endif

}  // namespace

torch::Tensor pack_panels_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_panels_bf16: a 2-d bf16 weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  auto panels = torch::zeros({P, pairs, kPairRow}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(panels.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k)
          dst[(p * pairs + k / 2) * kPairRow + 2 * j + k % 2] = src[(p * kPanel + j) * K + k];
  });
  return panels;
}

torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "panel_linear_bf16: x is [M, K] bf16, rows contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPairRow &&
                  panels.scalar_type() == at::kBFloat16,
              "panel_linear_bf16: packed bf16 panels");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == (K + 1) / 2 && N > (P - 1) * kPanel && N <= P * kPanel,
              "panel_linear_bf16: shapes do not match");
  torch::Tensor bias_f;  // added in fp32, before the one rounding to bf16
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "panel_linear_bf16: bias");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ldx = x.stride(0), pairs = panels.size(1);
  // Panels split across threads (at least 4 per task); each panel is read once per block of 16
  // rows, from cache after the first.
  at::parallel_for(0, P, 4, [&](int64_t b, int64_t e) {
    alignas(64) float sums[kRowBlock * kPanel];
    for (int64_t p = b; p < e; ++p) {
      const uint16_t* panel = wp + p * pairs * kPairRow;
      const int64_t width = std::min(kPanel, N - p * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - m0);
        block_sums(xp + m0 * ldx, ldx, rows, panel, K, sums);
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t j = 0; j < width; ++j)
            op[(m0 + m) * N + p * kPanel + j] =
                static_cast<at::BFloat16>(sums[m * kPanel + j] + (bp ? bp[p * kPanel + j] : 0.f));
      }
    }
  });
  return out;
}
