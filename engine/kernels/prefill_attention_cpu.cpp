// Causal prefill attention straight from the paged KV cache, for the CPU backend.
//
// One call per layer covers every prefill (and prefill chunk) of the step: the
// step's new K/V rows are already in the cache, so a sequence's keys are simply
// its block table, cached prefix included. Flash-style: for a tile of 16 query
// rows of one head, walk the key tiles (16 keys, inside one block) with an online
// softmax, never materialising the score matrix.
//
// The tile is laid out transposed, 16 queries per AVX-512 vector: scores for key j
// are one vector S[j] = sum_d K[j,d] * Q^T[d], the row maxima of the softmax are
// element-wise maxima over S[0..15], and the output is kept as O^T[d] (16 lanes),
// updated by broadcasting V[j,d] against P[j]. Every inner step is a fused
// multiply-add with a broadcast memory operand, so the kernel runs near the FMA
// peak instead of the ~50-70 GFLOP/s of torch's CPU flash kernel at these sizes.
//
// A tile of more than 16 rows (up to 32) holds two query vectors per head, so each K and V
// element loaded feeds two FMAs (attend_tile32_group); the last 1-16 rows of a prefill go in a
// 16-row tile. Measured (Zen 5, 2 threads, SmolLM2's heads, 30 layers, against the 16-row
// tiles alone, bit-identical): 4 x 128 new tokens after 384 cached 1.04-1.12x, 512 fresh
// 1.06-1.08x, 2 x 256 after 1,024 1.10-1.17x, 512 after 2,048 1.10-1.15x.
//
// Work items are (sequence, KV head, query tile), longest first (work_queue.h), so
// causal imbalance does not leave a thread idle. An item takes every query head of its
// KV head (up to kMaxGroup), so each K/V tile is read into L1 once for all of them:
// 1.05-1.17x over one head per item (SmolLM2's 9 heads on 3 KV heads, Zen 5, 2 threads,
// 30 layers: 4 x 128 new tokens after 384 cached, 512 fresh, 2 x 256 after 1,024), with
// bit-identical results (the same operations, in the same order, per head).
//
// fp32 or bf16, with head size 64 or 128 and blocks of a multiple of 16 tokens; anything
// else uses the torch path (prefill_attention_supported says which). CPUs without
// AVX-512 take the 8-lane version in prefill_attention_avx2.h (blocks of a multiple of 8).
// bf16 runs the fp32 loops: the FMAs take their broadcast operands from memory, so each key
// tile's K and V rows are widened (exactly) into the thread's scratch once, for all the heads
// of the item, the query rows are widened as they are loaded, everything sums in fp32, and the
// output is rounded to bf16 once: the fp32 kernel's result on the widened inputs, rounded.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx512_math.h"
#include "prefill_attention_avx2.h"
#include "work_queue.h"

#if defined(__AVX512F__)
namespace {
using kvmesh_avx512::exp2_ps;

constexpr int kTile = 16;  // queries per vector, keys per key tile
// Query heads of one KV head taken together in a work item: each K/V tile, read once into L1,
// serves all of them (SmolLM2's 3, Llama 3's 4, up to 8; a larger group is split).
constexpr int kMaxGroup = 8;

using kvmesh_avx512::load16;
using kvmesh_avx512::store16;

// A key tile's first `rows` rows of K or V as fp32 rows for the FMA loops: fp32 is read in
// place; bf16 is widened into buf (64-byte aligned, rows * D floats) once per tile.
template <int D>
inline const float* tile_rows(const float* src, int64_t, float*) {
  return src;
}

template <int D>
inline const float* tile_rows(const c10::BFloat16* src, int64_t rows, float* buf) {
  for (int64_t i = 0; i < rows * D; i += kTile) _mm512_store_ps(buf + i, kvmesh_avx512::load_bf16(src + i));
  return buf;
}

// The online-softmax step of one key tile for one vector of 16 queries: s[j] (the scores of key
// j, in log2 units; valid[j * valid_stride] the lanes that see it) become the weights p[j],
// stored at pt + j * pt_stride; m and l advance; returns alpha, the factor for what was summed
// so far. Both tile kernels call this, so a query row gets the same operations in either. The
// maximum and the sum go as trees: as serial chains of 16 they are ~100 cycles of latency a
// tile.
inline __m512 softmax_tile(__m512* s, const __mmask16* valid, int valid_stride, __m512& m, __m512& l, float* pt,
                           int64_t pt_stride) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 t[kTile];
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) t[j] = s[j] = _mm512_mask_blend_ps(valid[j * valid_stride], neg_inf, s[j]);
  for (int w = kTile / 2; w > 0; w /= 2)
#pragma GCC unroll 8
    for (int j = 0; j < w; ++j) t[j] = _mm512_max_ps(t[j], t[j + w]);
  const __m512 m_new = _mm512_max_ps(m, t[0]);
  const __m512 alpha = exp2_ps(_mm512_sub_ps(m, m_new));
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) {
    t[j] = _mm512_maskz_mov_ps(valid[j * valid_stride], exp2_ps(_mm512_sub_ps(s[j], m_new)));
    _mm512_store_ps(pt + j * pt_stride, t[j]);
  }
  for (int w = kTile / 2; w > 0; w /= 2)
#pragma GCC unroll 8
    for (int j = 0; j < w; ++j) t[j] = _mm512_add_ps(t[j], t[j + w]);
  l = _mm512_fmadd_ps(l, alpha, t[0]);
  m = m_new;
  return alpha;
}

// The next key tile's K and V (16 rows of D floats each: D 64-byte lines each), asked for into
// L2 a line or two at a time through the first head's score loop. All at once at the tile's
// start, the 2D prefetches queue behind the core's few line-fill buffers and stall the loop for
// about a DRAM latency each handful: spread out, the prefill attention read 1.1-1.25x from DRAM
// (30 layers, 4 x 128 new tokens after 384 cached; Zen 5, 2 threads) and 1.0-1.08x in cache,
// bit-identical.
// A bf16 tile is half the lines (D / 2): the calls past them ask for nothing.
template <typename T, int D>
struct NextTile {
  static constexpr int64_t kLines = D * static_cast<int64_t>(sizeof(T)) / 4;  // 64-byte lines in K's tile
  const char* k = nullptr;  // null: no next tile
  const char* v = nullptr;
  inline void fetch_pair(int64_t i) const {  // line i of K and of V (i < D)
    if (k == nullptr) return;
    if constexpr (kLines < D) {
      if (i >= kLines) return;
    }
    _mm_prefetch(k + 64 * i, _MM_HINT_T1);
    _mm_prefetch(v + 64 * i, _MM_HINT_T1);
  }
  inline void fetch_one(int64_t i) const {  // line i of K's and V's 2D (i < 2D)
    if (k == nullptr) return;
    if constexpr (kLines < D) {
      if (i >= 2 * kLines) return;
    }
    _mm_prefetch(i < kLines ? k + 64 * i : v + 64 * (i - kLines), _MM_HINT_T1);
  }
};

template <typename T, int D>
inline NextTile<T, D> next_tile(const T* k_head, const T* v_head, const int64_t* table, int64_t block_size,
                                int64_t k0, int64_t num_keys) {
  if (k0 + kTile >= num_keys) return {};
  const int64_t row = table[(k0 + kTile) / block_size] * block_size + (k0 + kTile) % block_size;
  return {reinterpret_cast<const char*>(k_head + row * D), reinterpret_cast<const char*>(v_head + row * D)};
}

// One query tile of the heads of one KV head against its whole causal context.
//   q: the tile's first row, first head; q_stride: elements between rows (heads D apart)
//   pos0: absolute position of the tile's first row; nq: rows in the tile (<= 16)
//   k_head, v_head: this KV head's blocks in the cache; table: the sequence's block table
//   kv_buf: 2 * kTile * D floats, 64-byte aligned, for a bf16 tile's widened K and V
template <typename T, int D>
void attend_tile_group(const T* q, int64_t q_stride, int64_t heads, int64_t nq, int64_t pos0,
                       const T* k_head, const T* v_head, const int64_t* table, int64_t block_size,
                       float scale_log2e, T* out, int64_t out_stride, float* scratch, float* kv_buf) {
  // scratch (64-byte aligned, at least 2 * kMaxGroup * D * kTile floats; the thread's own, on the
  // heap: more than a small worker stack should hold), per head:
  float* qt[kMaxGroup];  // Q^T, pre-scaled so scores come out in log2 units
  float* ot[kMaxGroup];  // O^T, unnormalised
  for (int g = 0; g < kMaxGroup; ++g) {
    qt[g] = scratch + g * D * kTile;
    ot[g] = scratch + (kMaxGroup + g) * D * kTile;
  }
  alignas(64) float pt[kTile * kTile];         // P^T of the current key tile (the head at hand)
  __m512 m[kMaxGroup], l[kMaxGroup];
  const __m512 qscale = _mm512_set1_ps(scale_log2e);
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t d0 = 0; d0 < D; d0 += kTile) {  // 16x16 blocks of Q, transposed in registers
      __m512 r[kTile];
      for (int64_t i = 0; i < kTile; ++i)
        r[i] = i < nq ? _mm512_mul_ps(load16(q + i * q_stride + g * D + d0), qscale) : _mm512_setzero_ps();
      kvmesh_avx512::transpose16(r);
      for (int64_t dd = 0; dd < kTile; ++dd) _mm512_store_ps(qt[g] + (d0 + dd) * kTile, r[dd]);
    }
    std::fill(ot[g], ot[g] + D * kTile, 0.f);
    m[g] = _mm512_set1_ps(-1e30f);
    l[g] = _mm512_setzero_ps();
  }
  const int64_t num_keys = pos0 + nq;  // causal: the last row sees keys 0 .. pos0 + nq - 1

  for (int64_t k0 = 0; k0 < num_keys; k0 += kTile) {
    const int64_t row_in_cache = table[k0 / block_size] * block_size + k0 % block_size;
    const int64_t nk = std::min<int64_t>(kTile, num_keys - k0);
    // The whole tile of K (its rows past nk are masked) and V's rows up to nk, read by every head.
    const float* kt = tile_rows<D>(k_head + row_in_cache * D, kTile, kv_buf);
    const float* vt = tile_rows<D>(v_head + row_in_cache * D, nk, kv_buf + kTile * D);
    // The next key tile is another page: ask for it now, a line or two per step of the first
    // head's score loop (NextTile). Unlike decode (one streaming read, where the hardware
    // prefetcher wins), this measured +10% on a fragmented pool and -3% on a contiguous one;
    // with the heads grouped, +3-10% on Zen 5.
    const NextTile<T, D> next = next_tile<T, D>(k_head, v_head, table, block_size, k0, num_keys);
    // Causal mask, the same for every head: query lane i (position pos0 + i) sees key k0 + j
    // iff k0 + j <= pos0 + i.
    __mmask16 valid[kTile];
    const bool diagonal = k0 + kTile - 1 > pos0;
    for (int j = 0; j < kTile; ++j) {
      __mmask16 v = 0xFFFF;
      if (j >= nk) {
        v = 0;
      } else if (diagonal) {
        const int64_t first = k0 + j - pos0;  // first lane that sees this key
        v = first <= 0 ? 0xFFFF : first >= kTile ? 0 : static_cast<__mmask16>(0xFFFFu << first);
      }
      valid[j] = v;
    }
    for (int64_t g = 0; g < heads; ++g) {
      // S^T = K Q^T for the 16 keys of the tile (rows past nk hold garbage; masked below).
      __m512 s[kTile];
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) s[j] = _mm512_setzero_ps();
      const float* qg = qt[g];
      for (int64_t d = 0; d < D; ++d) {
        if (g == 0) next.fetch_pair(d);
        const __m512 qv = _mm512_load_ps(qg + d * kTile);
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) s[j] = _mm512_fmadd_ps(_mm512_set1_ps(kt[j * D + d]), qv, s[j]);
      }
      // Online softmax: rescale what was accumulated to the new running maximum.
      const __m512 alpha = softmax_tile(s, valid, 1, m[g], l[g], pt, kTile);
      // O^T = alpha * O^T + V^T P^T, 16 head dims at a time (16 accumulators + P[j]).
      float* og = ot[g];
      for (int64_t d0 = 0; d0 < D; d0 += kTile) {
        __m512 o[kTile];
#pragma GCC unroll 16
        for (int dd = 0; dd < kTile; ++dd) o[dd] = _mm512_mul_ps(_mm512_load_ps(og + (d0 + dd) * kTile), alpha);
        for (int64_t j = 0; j < nk; ++j) {
          const __m512 p = _mm512_load_ps(pt + j * kTile);
          const float* vrow = vt + j * D + d0;
#pragma GCC unroll 16
          for (int dd = 0; dd < kTile; ++dd) o[dd] = _mm512_fmadd_ps(_mm512_set1_ps(vrow[dd]), p, o[dd]);
        }
#pragma GCC unroll 16
        for (int dd = 0; dd < kTile; ++dd) _mm512_store_ps(og + (d0 + dd) * kTile, o[dd]);
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {  // O^T back to rows, 16x16 blocks at a time
    alignas(64) float inv[kTile];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[g]));
    for (int64_t d0 = 0; d0 < D; d0 += kTile) {
      __m512 r[kTile];
      for (int64_t dd = 0; dd < kTile; ++dd) r[dd] = _mm512_load_ps(ot[g] + (d0 + dd) * kTile);
      kvmesh_avx512::transpose16(r);
      for (int64_t i = 0; i < nq; ++i)
        store16(out + i * out_stride + g * D + d0, _mm512_mul_ps(r[i], _mm512_set1_ps(inv[i])));
    }
  }
}

// The same for a tile of 17-32 query rows: two query vectors per head, so each K and V element
// loaded (broadcast) feeds two FMAs instead of one. The 16-row kernel above issues a load per
// FMA and stays near 60% of the FMA peak; this one issues ~0.6. Every lane sees the same
// operations in the same order as in the 16-row kernel (a key tile that is wholly masked for the
// first vector leaves its state exactly as it was: alpha = exp2(0) = 1, p = 0), so its results
// are bit for bit those of two 16-row tiles.
template <typename T, int D>
void attend_tile32_group(const T* q, int64_t q_stride, int64_t heads, int64_t nq, int64_t pos0,
                         const T* k_head, const T* v_head, const int64_t* table, int64_t block_size,
                         float scale_log2e, T* out, int64_t out_stride, float* scratch, float* kv_buf) {
  constexpr int kRows = 2 * kTile;
  float* qt[kMaxGroup];  // Q^T [D][32], pre-scaled
  float* ot[kMaxGroup];  // O^T [D][32], unnormalised
  for (int g = 0; g < kMaxGroup; ++g) {
    qt[g] = scratch + g * D * kRows;
    ot[g] = scratch + (kMaxGroup + g) * D * kRows;
  }
  alignas(64) float pt[kTile * kRows];  // P^T of the current key tile: [key][32 queries]
  alignas(64) float st[kTile * kRows];  // S^T likewise
  __m512 m[kMaxGroup][2], l[kMaxGroup][2];
  const __m512 qscale = _mm512_set1_ps(scale_log2e);
  for (int64_t g = 0; g < heads; ++g) {
    for (int v = 0; v < 2; ++v)
      for (int64_t d0 = 0; d0 < D; d0 += kTile) {
        __m512 r[kTile];
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t row = v * kTile + i;
          r[i] = row < nq ? _mm512_mul_ps(load16(q + row * q_stride + g * D + d0), qscale)
                          : _mm512_setzero_ps();
        }
        kvmesh_avx512::transpose16(r);
        for (int64_t dd = 0; dd < kTile; ++dd) _mm512_store_ps(qt[g] + (d0 + dd) * kRows + v * kTile, r[dd]);
      }
    std::fill(ot[g], ot[g] + D * kRows, 0.f);
    for (int v = 0; v < 2; ++v) {
      m[g][v] = _mm512_set1_ps(-1e30f);
      l[g][v] = _mm512_setzero_ps();
    }
  }
  const int64_t num_keys = pos0 + nq;

  // The key-tile walk and the causal masks repeat the 16-row kernel's, for two vectors. Shared
  // helpers ran at 0.94-0.995x of this (two runs of 7 interleaved rounds), so each keeps its own.
  for (int64_t k0 = 0; k0 < num_keys; k0 += kTile) {
    const int64_t row_in_cache = table[k0 / block_size] * block_size + k0 % block_size;
    const int64_t nk = std::min<int64_t>(kTile, num_keys - k0);
    // The whole tile of K (its rows past nk are masked) and V's rows up to nk, read by every head.
    const float* kt = tile_rows<D>(k_head + row_in_cache * D, kTile, kv_buf);
    const float* vt = tile_rows<D>(v_head + row_in_cache * D, nk, kv_buf + kTile * D);
    const NextTile<T, D> next = next_tile<T, D>(k_head, v_head, table, block_size, k0, num_keys);
    __mmask16 valid[kTile][2];
    for (int v = 0; v < 2; ++v) {
      const int64_t p0 = pos0 + v * kTile;  // the vector's first query position
      const bool diagonal = k0 + kTile - 1 > p0;
      for (int j = 0; j < kTile; ++j) {
        __mmask16 bits = 0xFFFF;
        if (j >= nk) {
          bits = 0;
        } else if (diagonal) {
          const int64_t first = k0 + j - p0;
          bits = first <= 0 ? 0xFFFF : first >= kTile ? 0 : static_cast<__mmask16>(0xFFFFu << first);
        }
        valid[j][v] = bits;
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      const float* qg = qt[g];
      // S^T for the tile's keys, 8 at a time: 16 accumulators, each key element loaded once.
      for (int half = 0; half < 2; ++half) {
        const float* kh = kt + half * 8 * D;
        __m512 a0[8], a1[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          if (g == 0) next.fetch_one(half * D + d);
          const __m512 q0 = _mm512_load_ps(qg + d * kRows), q1 = _mm512_load_ps(qg + d * kRows + kTile);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            const __m512 kv = _mm512_set1_ps(kh[j * D + d]);
            a0[j] = _mm512_fmadd_ps(kv, q0, a0[j]);
            a1[j] = _mm512_fmadd_ps(kv, q1, a1[j]);
          }
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          _mm512_store_ps(st + (half * 8 + j) * kRows, a0[j]);
          _mm512_store_ps(st + (half * 8 + j) * kRows + kTile, a1[j]);
        }
      }
      __m512 alpha[2];
      for (int v = 0; v < 2; ++v) {
        __m512 s[kTile];
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) s[j] = _mm512_load_ps(st + j * kRows + v * kTile);
        alpha[v] = softmax_tile(s, &valid[0][v], 2, m[g][v], l[g][v], pt + v * kTile, kRows);
      }
      // O^T = alpha * O^T + V^T P^T, 8 head dims at a time (16 accumulators).
      float* og = ot[g];
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m512 o0[8], o1[8];
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd) {
          o0[dd] = _mm512_mul_ps(_mm512_load_ps(og + (d0 + dd) * kRows), alpha[0]);
          o1[dd] = _mm512_mul_ps(_mm512_load_ps(og + (d0 + dd) * kRows + kTile), alpha[1]);
        }
        for (int64_t j = 0; j < nk; ++j) {
          const __m512 p0 = _mm512_load_ps(pt + j * kRows), p1 = _mm512_load_ps(pt + j * kRows + kTile);
          const float* vrow = vt + j * D + d0;
#pragma GCC unroll 8
          for (int dd = 0; dd < 8; ++dd) {
            const __m512 vv = _mm512_set1_ps(vrow[dd]);
            o0[dd] = _mm512_fmadd_ps(vv, p0, o0[dd]);
            o1[dd] = _mm512_fmadd_ps(vv, p1, o1[dd]);
          }
        }
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd) {
          _mm512_store_ps(og + (d0 + dd) * kRows, o0[dd]);
          _mm512_store_ps(og + (d0 + dd) * kRows + kTile, o1[dd]);
        }
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    for (int v = 0; v < 2; ++v) {
      const int64_t rows = std::min<int64_t>(kTile, nq - v * kTile);
      if (rows <= 0) break;
      alignas(64) float inv[kTile];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[g][v]));
      for (int64_t d0 = 0; d0 < D; d0 += kTile) {
        __m512 r[kTile];
        for (int64_t dd = 0; dd < kTile; ++dd) r[dd] = _mm512_load_ps(ot[g] + (d0 + dd) * kRows + v * kTile);
        kvmesh_avx512::transpose16(r);
        for (int64_t i = 0; i < rows; ++i)
          store16(out + (v * kTile + i) * out_stride + g * D + d0, _mm512_mul_ps(r[i], _mm512_set1_ps(inv[i])));
      }
    }
  }
}

}  // namespace
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {
#if !defined(__AVX512F__)
// AVX2: tiles of 16 query rows (two 8-lane vectors), prefill_attention_avx2.h.
constexpr int kTile = kvmesh_avx2::kPrefillRows;
constexpr int kMaxGroup = kvmesh_avx2::kPrefillMaxGroup;
constexpr int kMaxTileRows = kTile;
#else
constexpr int kMaxTileRows = 2 * kTile;
#endif

struct WorkItem {
  int64_t seq, head0, heads, row0, rows;  // query heads head0 .. head0+heads-1; rows row0 .. row0+rows-1 (16 or 32) of the new tokens
  int64_t cost;  // key tiles to visit, times the heads and the query vectors (1 or 2)
};

template <typename T, int D>
void prefill_attention(T* out, const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache,
                       const int64_t* seqs, int64_t num_seqs, const int64_t* tables, int64_t max_blocks,
                       int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = seqs[s * 3 + 1], num_ctx = seqs[s * 3 + 2];
    for (int64_t r = 0; r < num_new;) {
      const int64_t rows = num_new - r > kTile ? kMaxTileRows : kTile;  // the largest tile while > 16 remain
      const int64_t tiles = (num_ctx + std::min(num_new, r + rows) + kTile - 1) / kTile;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
        for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
          const int64_t n = std::min<int64_t>(kMaxGroup, group - g0);
          items.push_back({s, kvh * group + g0, n, r, rows, tiles * n * rows / kTile});
        }
      r += rows;
    }
  }
  const int64_t head_elems = num_blocks * block_size * D;
  const float scale_log2e = scale * 1.4426950408889634f;
  // Longest first (work_queue.h): balances the causal triangle's uneven rows.
  kvmesh_cpu::parallel_longest_first(
      static_cast<int64_t>(items.size()), [&](int64_t i) { return items[i].cost; }, [&] {
        // Each thread's scratch for attend_tile_group / attend_tile32_group, 64-byte aligned, and
        // for bf16 the widened K and V of a key tile after it.
        constexpr int64_t kTileScratch = 2 * kMaxGroup * D * kMaxTileRows;
        constexpr int64_t kKvScratch = std::is_same_v<T, float> ? 0 : 2 * kTile * D;
        return [&, buf = std::vector<float>(kTileScratch + kKvScratch + 16)](int64_t i) mutable {
          float* scratch = buf.data() + (16 - reinterpret_cast<uintptr_t>(buf.data()) / sizeof(float) % 16) % 16;
          const WorkItem& w = items[i];
          const int64_t start = seqs[w.seq * 3], num_new = seqs[w.seq * 3 + 1], num_ctx = seqs[w.seq * 3 + 2];
          const int64_t kvh = w.head0 / group;
          const int64_t row = start + w.row0;
#if defined(__AVX512F__)
          auto attend = w.rows > kTile ? attend_tile32_group<T, D> : attend_tile_group<T, D>;
#else
          auto attend = kvmesh_avx2::attend_tile_group<T, D>;
#endif
          attend(q + row * q_row_stride + w.head0 * D, q_row_stride, w.heads, std::min(w.rows, num_new - w.row0),
                 num_ctx + w.row0, k_cache + kvh * head_elems, v_cache + kvh * head_elems, tables + w.seq * max_blocks,
                 block_size, scale_log2e, out + (row * num_heads + w.head0) * D, num_heads * D, scratch,
                 scratch + kTileScratch);
        };
      });
}
}  // namespace
#endif

bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim, int64_t block_size) {
#if defined(__AVX512F__)
  return (dtype == torch::kFloat || dtype == torch::kBFloat16) && (head_dim == 64 || head_dim == 128) &&
         block_size % 16 == 0;
#elif defined(__AVX2__) && defined(__FMA__)
  return (dtype == torch::kFloat || dtype == torch::kBFloat16) && (head_dim == 64 || head_dim == 128) &&
         block_size % kvmesh_avx2::kKeyTile == 0;
#else
  (void)dtype; (void)head_dim; (void)block_size;
  return false;
#endif
}

// out: [T, H, D] contiguous, written for the prefill rows only; q: [T, H, D] with unit
// stride inside a row (a view into the fused qkv projection is fine);
// k_cache, v_cache: [Hkv, NB, B, D] holding every key of these sequences, this step's included;
// seqs: [S, 3] int64 (first row in the batch, new tokens, tokens cached before this step);
// block_tables: [S, max_blocks] int64.
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor seqs, torch::Tensor block_tables, double scale) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), B = k_cache.size(2);
  TORCH_CHECK(prefill_attention_supported(q.scalar_type(), D, B), "paged_prefill_attention: unsupported dtype/shape");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q rows must hold heads back to back");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out: [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "cache");
  TORCH_CHECK(seqs.scalar_type() == torch::kLong && seqs.dim() == 2 && seqs.size(1) == 3, "seqs: [S, 3] int64");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.size(0) == seqs.size(0), "block_tables");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  auto s = seqs.contiguous();
  auto t = block_tables.contiguous();
  auto run = [&](auto d_const, auto* type_tag) {
    constexpr int Dc = decltype(d_const)::value;
    using T = std::remove_pointer_t<decltype(type_tag)>;
    prefill_attention<T, Dc>(out.data_ptr<T>(), q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<T>(),
                             v_cache.data_ptr<T>(), s.data_ptr<int64_t>(), s.size(0), t.data_ptr<int64_t>(), t.size(1),
                             H, Hkv, NB, B, static_cast<float>(scale));
  };
  auto by_dim = [&](auto* type_tag) {
    if (D == 64) run(std::integral_constant<int, 64>{}, type_tag);
    else run(std::integral_constant<int, 128>{}, type_tag);
  };
  if (q.scalar_type() == torch::kBFloat16) by_dim(static_cast<c10::BFloat16*>(nullptr));
  else by_dim(static_cast<float*>(nullptr));
#endif
}
