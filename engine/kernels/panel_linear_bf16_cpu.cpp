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
// Rows [0, MB) of x (stride ldx, bf16) against NP adjacent panels (`stride` bf16 values apart):
// sums[p][m][0..15] in fp32, one chain per output over the pairs in order, whatever MB and NP,
// so a row's result does not depend on the rows batched with it. At 1-3 rows the chains that
// hide the latency come from several panels at once, not from splitting the pairs.
template <int NP, int MB>
inline void panel_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t stride, int64_t K,
                       float* sums) {
  const int64_t pairs = K / 2;
  __m512 acc[NP][MB];
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m] = _mm512_setzero_ps();
  auto step = [&](int p, int64_t r, const __m512i w, auto pair_of) {
#if defined(__AVX512BF16__)
    for (int m = 0; m < MB; ++m)
      acc[p][m] = _mm512_dpbf16_ps(acc[p][m], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of(m, r))), (__m512bh)w);
#else
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    for (int m = 0; m < MB; ++m) {
      const uint32_t xp = pair_of(m, r);
      acc[p][m] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp << 16))), lo, acc[p][m]);
      acc[p][m] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp & 0xFFFF0000u))), hi,
                                  acc[p][m]);
    }
#endif
  };
  auto full_pair = [&](int m, int64_t r) { return load_pair(x + m * ldx + 2 * r); };
  for (int64_t r = 0; r < pairs; ++r) {
    for (int p = 0; p < NP; ++p) {
      const uint16_t* row = panel + p * stride + r * kPairRow;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * kPairRow), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchL2Rows * kPairRow), _MM_HINT_T1);
      step(p, r, _mm512_loadu_si512(row), full_pair);
    }
  }
  if (K % 2)  // the last input alone: its pair's second weight is the packing's zero
    for (int p = 0; p < NP; ++p)
      step(p, pairs, _mm512_loadu_si512(panel + p * stride + pairs * kPairRow),
           [&](int m, int64_t) { return static_cast<uint32_t>(x[m * ldx + K - 1]); });
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(sums + (p * MB + m) * kPanel, acc[p][m]);
}

using BlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);

constexpr BlockFn kBlocks[kRowBlock + 1] = {
    nullptr,
    panel_tile<1, 1>, panel_tile<1, 2>, panel_tile<1, 3>, panel_tile<1, 4>,
    panel_tile<1, 5>, panel_tile<1, 6>, panel_tile<1, 7>, panel_tile<1, 8>,
    panel_tile<1, 9>, panel_tile<1, 10>, panel_tile<1, 11>, panel_tile<1, 12>,
    panel_tile<1, 13>, panel_tile<1, 14>, panel_tile<1, 15>, panel_tile<1, 16>,
};

inline void block_sums(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel, int64_t K, float* sums) {
  kBlocks[rows](x, ldx, panel, 0, K, sums);
}

// A batch of up to 10 rows takes register tiles over several panels, so each broadcast of a
// row's pair feeds several dot products and the chains come from panels (1-3 rows), not from
// splitting the pairs: 4 panels at 1-6 rows, 3 at 7, 2 at 8-10. Sums laid out [panel][row][16].
// One thread, SmolLM2's four shapes, vs one panel at a time (with split pairs below 4 rows):
// 1.0-1.1x at 1-3 rows, 1.4-1.8x at 4-7, 1.2-1.3x at 8-10; 2-panel tiles at 11-12 rows measured
// 0.83x (spills), so from 11 rows up one panel at a time.
constexpr int64_t kTileRows = 10;
constexpr int64_t kTileMaxPanels = 4;
constexpr BlockFn kTiles[kTileRows + 1] = {
    nullptr,          panel_tile<4, 1>, panel_tile<4, 2>, panel_tile<4, 3>, panel_tile<4, 4>,
    panel_tile<4, 5>, panel_tile<4, 6>, panel_tile<3, 7>, panel_tile<2, 8>, panel_tile<2, 9>, panel_tile<2, 10>,
};
constexpr int64_t kTilePanels[kTileRows + 1] = {0, 4, 4, 4, 4, 4, 4, 3, 2, 2, 2};
#else
// Without AVX-512: the same sums in a loop the compiler vectorises (one per output, in order).
constexpr int64_t kTileMaxPanels = 1;  // no multi-panel tiles
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
    alignas(64) float sums[kTileMaxPanels * kRowBlock * kPanel];
    // Rows [m0, m0 + rows) of panel p from their fp32 sums: the bias, then the one rounding.
    auto emit = [&](int64_t p, int64_t m0, int64_t rows, const float* s) {
      const int64_t width = std::min(kPanel, N - p * kPanel);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < width; ++j)
          op[(m0 + m) * N + p * kPanel + j] = static_cast<at::BFloat16>(s[m * kPanel + j] + (bp ? bp[p * kPanel + j] : 0.f));
    };
    int64_t p = b;
#if defined(__AVX512F__)
    if (M <= kTileRows) {  // tiles over several panels (the same sums as one panel at a time)
      const int64_t np = kTilePanels[M];
      for (; p + np <= e; p += np) {
        kTiles[M](xp, ldx, wp + p * pairs * kPairRow, pairs * kPairRow, K, sums);
        for (int64_t i = 0; i < np; ++i) emit(p + i, 0, M, sums + i * M * kPanel);
      }
    }
#endif
    // Otherwise (and the panels left over) one panel at a time, read once per block of 16 rows,
    // from cache after the first.
    for (; p < e; ++p) {
      const uint16_t* panel = wp + p * pairs * kPairRow;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - m0);
        block_sums(xp + m0 * ldx, ldx, rows, panel, K, sums);
        emit(p, m0, rows, sums);
      }
    }
  });
  return out;
}
