// Linear layers over weights packed in panels of 16 output features, for the CPU backend.
//
//   pack_panels(w [N, K]) -> [ceil(N / 16), K, 16]     panel p, row k: w[16p .. 16p + 15, k]
//   panel_linear(x [M, K], panels, N, bias?) -> [M, N]  x @ w.T (+ bias)
//
// bf16 weights go to panel_linear_bf16_cpu.cpp's layout and kernel (both entry points dispatch).
//
// Why: at decode sizes (up to 16 rows) a linear layer is a stream over its weights, and oneDNN's
// fp32 matmul streamed them at about half of this machine's memory bandwidth. Here each panel
// row (16 outputs of one input feature, one 64-byte vector) feeds one FMA per row of x into
// register accumulators, with the panel prefetched ahead: the weights stream through memory
// once, in order. A register tile spans 2-6 panels, so each broadcast of x feeds 2-6 FMAs
// (blocks of up to 12 rows; 13-16 rows read the panels twice, from cache the second time; past 16
// rows, blocks of 16 over each 12 panels). Threads split the panels. Measured on SmolLM2-135M's
// 30 layers, one thread, one panel at a time (before the tiles) vs oneDNN: 1.22x at 1 row, 1.34x
// at 8, 1.47x at 16; with the tiles, two threads, from memory: 1.10-1.22x at 24-64 rows
// (onednn_linear.py's panel_max_rows: where it hands over). Each output is one sum over k in order, whatever the
// row count, so a row's result does not depend on the rows batched with it (every ISA below).
// Builds without AVX-512 get an AVX2 version (below; measured on a Zen 3, 30 layers, one thread,
// vs oneDNN: 2.0x at 1 row, 1.4x at 4, 0.87x at 8 and 16) and, without AVX2, a portable loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>

#include "cpu_ops.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBlock = 16;
// Panel rows (64 bytes each) prefetched ahead of the one being read: the hardware prefetcher
// alone left the stream at half the measured bandwidth (oneDNN's speed); this made it 1.2-1.5x.
// A second prefetch, into L2 and 64 KB ahead, keeps more lines in flight than L1's fill buffers
// allow: 1.1-1.2x at 1-4 rows (the LM head at any row count), within noise at 8-16 rows, where
// the step costs about memory time plus compute time. Past a thread's last panel it prefetches
// the next thread's panels: harmless.
constexpr int64_t kPrefetchRows = 32;
constexpr int64_t kPrefetchL2Rows = 1024;

#if defined(__AVX512F__)
// Rows [0, MB) of x (stride ldx) against one panel: out[m, 0..15] = sum_k x[m, k] * panel[k],
// one FMA chain per output, k ascending, then the bias: the one summation order every row count
// uses (panel_tile below), so a row's result does not depend on the rows batched with it.
template <int MB>
inline void panel_block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
                        __mmask16 mask, const float* bias) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchL2Rows) * kPanel), _MM_HINT_T1);
    const __m512 w = _mm512_loadu_ps(panel + k * kPanel);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), w, acc[m]);
  }
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out + m * ldo, mask, _mm512_add_ps(acc[m], b));
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, __mmask16, const float*);

constexpr BlockFn kBlocks[kRowBlock + 1] = {
    nullptr,
    panel_block<1>, panel_block<2>, panel_block<3>, panel_block<4>,
    panel_block<5>, panel_block<6>, panel_block<7>, panel_block<8>,
    panel_block<9>, panel_block<10>, panel_block<11>, panel_block<12>,
    panel_block<13>, panel_block<14>, panel_block<15>, panel_block<16>,
};

// Rows [0, MB) of x against NP adjacent panels (K * kPanel floats apart): the sums of
// panel_block<MB> (one FMA chain per output, k ascending, then the bias), so the results are
// bit-identical, but each broadcast of x feeds NP FMAs, and the NP x MB chains hide the FMA
// latency (at 1-3 rows one panel has too few; splitting k instead would change the sums with
// the row count). From 4 rows up panel_block is bound by its one broadcast load per FMA.
template <int NP, int MB>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
                       const __mmask16* masks, const float* bias) {
  const int64_t stride = K * kPanel;
  __m512 acc[NP][MB];
#pragma GCC unroll 16
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[p][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const float* row = panel + p * stride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchL2Rows * kPanel), _MM_HINT_T1);
      w[p] = _mm512_loadu_ps(row);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_fmadd_ps(xv, w[p], acc[p][m]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < NP; ++p) {
    const __m512 b = bias ? _mm512_maskz_loadu_ps(masks[p], bias + p * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out + m * ldo + p * kPanel, masks[p], _mm512_add_ps(acc[p][m], b));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const __mmask16*, const float*);

// The tile by row count (of 32 registers: up to 24 accumulators, a weight vector per panel, the
// broadcast): 6 panels at 1 row and 4 at 2-3 (6-12 chains), 4 at 4-6 rows, 3 at 7-8, 2 at 9-12,
// and 13-16 rows in two blocks of 3-panel tiles (the panels read from cache for the second).
// Every count divides the 12 panels panel_linear hands out at a time. One thread, 576 -> 3,072,
// vs one panel at a time (loaded machine): 1.19x at 4 rows, 1.25x at 8, 1.16x at 12, 1.32x at
// 16, about oneDNN's speed at 128 rows; 1.13-1.31x for 576 -> 576 and 1,536 -> 576. At 1-3 rows
// (SmolLM2's four shapes, quiet) 1.09-1.16x over one panel with k split 4 or 2 ways.
constexpr int64_t kTileSplitRows = 13;  // from here on, two blocks of 3-panel tiles
constexpr TileFn kTiles[kTileSplitRows] = {
    nullptr,          panel_tile<6, 1>, panel_tile<4, 2>, panel_tile<4, 3>, panel_tile<4, 4>,
    panel_tile<4, 5>, panel_tile<4, 6>, panel_tile<3, 7>, panel_tile<3, 8>, panel_tile<2, 9>,
    panel_tile<2, 10>, panel_tile<2, 11>, panel_tile<2, 12>,
};
constexpr int kTilePanels[kTileSplitRows] = {0, 6, 4, 4, 4, 4, 4, 3, 3, 2, 2, 2, 2};
constexpr TileFn kTiles3[9] = {
    nullptr,          nullptr,          nullptr,          nullptr,          nullptr,
    nullptr,          panel_tile<3, 6>, panel_tile<3, 7>, panel_tile<3, 8>,
};

inline __mmask16 panel_mask(int64_t N, int64_t p) {
  return static_cast<__mmask16>((1u << std::min(kPanel, N - p * kPanel)) - 1u);
}

// Rows [0, rows) of x (at most kRowBlock) against panels [b, e), a tile's panel count at a time;
// the panels left over go one at a time.
void panel_rows(const float* x, int64_t ldx, int64_t rows, const float* wp, int64_t K, int64_t N, int64_t b,
                int64_t e, float* out, const float* bias) {
  int64_t p = b;
  const bool split = rows >= kTileSplitRows;
  const int np = split ? 3 : kTilePanels[rows];
  const int64_t half = rows / 2;
  for (; p + np <= e; p += np) {
    __mmask16 masks[6];
    for (int i = 0; i < np; ++i) masks[i] = panel_mask(N, p + i);
    const float* panel = wp + p * K * kPanel;
    const float* bias_p = bias ? bias + p * kPanel : nullptr;
    if (split) {
      kTiles3[half](x, ldx, panel, K, out + p * kPanel, N, masks, bias_p);
      kTiles3[rows - half](x + half * ldx, ldx, panel, K, out + half * N + p * kPanel, N, masks, bias_p);
    } else {
      kTiles[rows](x, ldx, panel, K, out + p * kPanel, N, masks, bias_p);
    }
  }
  for (; p < e; ++p)
    kBlocks[rows](x, ldx, wp + p * K * kPanel, K, out + p * kPanel, N, panel_mask(N, p), bias ? bias + p * kPanel : nullptr);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 (e.g. AMD Zen 3): a panel row is two 8-float vectors, and the 16 ymm registers hold the
// accumulators of at most 6 rows, so x goes in blocks of up to 6 rows; each block after the
// first reads the panel from cache. Without this the portable loop below ran 3.5x slower than
// oneDNN at 16 rows on a Zen 3 (it re-reads the panel for every row). Splitting k into chunks
// that stay in L1 across the row blocks measured no faster (0.68x -> 0.51-0.68x at 16 rows).
constexpr int64_t kRowBlockAvx2 = 6;

// Rows [0, MB) of x against NP adjacent panels (K * kPanel floats apart; the last one may be
// narrower: N is the layer's width and out's row stride, p0 the first panel's index): one FMA chain per output, k
// ascending, then the bias, whatever MB and NP, so a row's result does not depend on the rows
// batched with it. At 1-3 rows the chains come from 2-3 panels at once, not from splitting k.
template <int NP, int MB>
inline void panel_tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t N,
                            int64_t p0, const float* bias) {
  const int64_t stride = K * kPanel;
  __m256 acc[NP][MB][2];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[p][m][0] = acc[p][m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const float* row = panel + p * stride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchL2Rows * kPanel), _MM_HINT_T1);
      const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
        acc[p][m][0] = _mm256_fmadd_ps(xv, w0, acc[p][m][0]);
        acc[p][m][1] = _mm256_fmadd_ps(xv, w1, acc[p][m][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t width = std::min(kPanel, N - (p0 + p) * kPanel);
    alignas(32) float b[kPanel] = {0.f};
    if (bias) std::memcpy(b, bias + p * kPanel, width * sizeof(float));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 lo = _mm256_add_ps(acc[p][m][0], _mm256_load_ps(b));
      const __m256 hi = _mm256_add_ps(acc[p][m][1], _mm256_load_ps(b + 8));
      float* o = out + m * N + p * kPanel;
      if (width == kPanel) {
        _mm256_storeu_ps(o, lo);
        _mm256_storeu_ps(o + 8, hi);
      } else {  // the last panel of a layer whose width is not a multiple of 16
        alignas(32) float tmp[kPanel];
        _mm256_store_ps(tmp, lo);
        _mm256_store_ps(tmp + 8, hi);
        std::memcpy(o, tmp, width * sizeof(float));
      }
    }
  }
}

using TileFnAvx2 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*);

// One panel at a time for 1-6 rows (4+ rows: 8-12 chains)...
constexpr TileFnAvx2 kBlocksAvx2[kRowBlockAvx2 + 1] = {
    nullptr, panel_tile_avx2<1, 1>, panel_tile_avx2<1, 2>, panel_tile_avx2<1, 3>,
    panel_tile_avx2<1, 4>, panel_tile_avx2<1, 5>, panel_tile_avx2<1, 6>,
};
// ...and 3 or 2 panels at a time for a batch of 1-3 rows (6, 8 and 12 chains).
constexpr int64_t kSmallRowsAvx2 = 3;
constexpr TileFnAvx2 kSmallTilesAvx2[kSmallRowsAvx2 + 1] = {nullptr, panel_tile_avx2<3, 1>, panel_tile_avx2<2, 2>,
                                                            panel_tile_avx2<2, 3>};
constexpr int kSmallTilePanelsAvx2[kSmallRowsAvx2 + 1] = {0, 3, 2, 2};
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
// The same computation without AVX-512 or AVX2 (a portable build): a fixed-width accumulator
// the compiler vectorises.
void panel_block_portable(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t K, float* out,
                          int64_t ldo, int64_t width, const float* bias) {
  for (int64_t m = 0; m < rows; ++m) {
    float acc[kPanel] = {0.f};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * ldx + k];
      const float* w = panel + k * kPanel;
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += xv * w[j];
    }
    for (int64_t j = 0; j < width; ++j) out[m * ldo + j] = acc[j] + (bias ? bias[j] : 0.f);
  }
}
#endif

}  // namespace

torch::Tensor pack_panels(torch::Tensor w) {
  if (w.scalar_type() == at::kBFloat16) return pack_panels_bf16(w);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_panels: a 2-d fp32 weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto panels = torch::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = src[(p * kPanel + j) * K + k];
  });
  return panels;
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  if (panels.scalar_type() == at::kBFloat16) return panel_linear_bf16(x, panels, N, bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "panel_linear: x is [M, K] fp32, rows contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel, "panel_linear: packed panels");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K && N > (P - 1) * kPanel && N <= P * kPanel, "panel_linear: shapes do not match");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "panel_linear: bias");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Panels split across threads (at least 4 per task, so a small layer is not over-split); each
  // panel is read once for every block of 16 rows, from cache after the first.
  at::parallel_for(0, P, 4, [&](int64_t b, int64_t e) {
#if defined(__AVX512F__)
    // 12 panels (a whole number of any tile) at a time, so that past 16 rows they are read
    // from cache for the row blocks after the first.
    for (int64_t p = b; p < e; p += 12)
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
        panel_rows(xp + m0 * ldx, ldx, std::min(kRowBlock, M - m0), wp, K, N, p, std::min(p + 12, e), op + m0 * N,
                   bp);
#else
#if defined(__AVX2__) && defined(__FMA__)
    if (M <= kSmallRowsAvx2) {  // a few rows: tiles over several panels (the same sums as one at a time)
      const int np = kSmallTilePanelsAvx2[M];
      int64_t p = b;
      for (; p + np <= e; p += np)
        kSmallTilesAvx2[M](xp, ldx, wp + p * K * kPanel, K, op + p * kPanel, N, p, bp ? bp + p * kPanel : nullptr);
      for (; p < e; ++p)
        kBlocksAvx2[M](xp, ldx, wp + p * K * kPanel, K, op + p * kPanel, N, p, bp ? bp + p * kPanel : nullptr);
      return;
    }
#endif
    for (int64_t p = b; p < e; ++p) {
      const float* panel = wp + p * K * kPanel;
      const float* bias_p = bp ? bp + p * kPanel : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - m0);
#if defined(__AVX2__) && defined(__FMA__)
        for (int64_t r0 = 0; r0 < rows; r0 += kRowBlockAvx2) {
          const int64_t n = std::min(kRowBlockAvx2, rows - r0);
          kBlocksAvx2[n](xp + (m0 + r0) * ldx, ldx, panel, K, op + (m0 + r0) * N + p * kPanel, N, p, bias_p);
        }
#else
        panel_block_portable(xp + m0 * ldx, ldx, rows, panel, K, op + m0 * N + p * kPanel, N,
                             std::min(kPanel, N - p * kPanel), bias_p);
#endif
      }
    }
#endif
  });
  return out;
}
