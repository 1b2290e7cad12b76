// Prefill attention's fp32 path for AVX2 machines (no AVX-512): the flash-style tiles of
// prefill_attention_cpu.cpp on 8-lane vectors and 16 registers. Included by
// prefill_attention_cpu.cpp only, which shares its work items and scheduling.
//
// A query tile is 16 rows held transposed as two vectors per head dimension (Q^T[d] = rows 0-7
// and 8-15), a key tile 8 keys (a block of a multiple of 8 rows holds whole tiles). Scores go 4
// keys at a time (8 accumulators: each K element broadcast once feeds both query vectors), the
// weighted sum 4 head dimensions at a time (8 accumulators: each V element likewise). Every
// inner step is an FMA with a broadcast operand, as on AVX-512. bf16 likewise: a key tile's K
// and V rows widened once into scratch, the query rows as they are loaded, the output rounded once.
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <algorithm>
#include <cmath>
#include <type_traits>

#include <c10/util/BFloat16.h>

#include "avx2_math.h"

namespace kvmesh_avx2 {

constexpr int kPrefillRows = 16;  // query rows per tile: two 8-lane vectors
constexpr int kKeyTile = 8;
constexpr int kPrefillMaxGroup = 8;  // query heads per work item, as on AVX-512

// A key tile's first `rows` rows of K or V as fp32 rows for the FMA loops: fp32 is read in
// place; bf16 is widened into buf (32-byte aligned, rows * D floats) once per tile.
template <int D>
inline const float* key_tile_rows(const float* src, int64_t, float*) {
  return src;
}

template <int D>
inline const float* key_tile_rows(const c10::BFloat16* src, int64_t rows, float* buf) {
  for (int64_t i = 0; i < rows * D; i += 8) _mm256_store_ps(buf + i, load_bf16(src + i));
  return buf;
}

// The online-softmax step of one key tile for one vector of 8 query rows: s[j] (key j's scores,
// log2 units) masked by valid[j], become the weights stored at pt + j * pt_stride; m and l
// advance; returns alpha, the factor for what was summed so far.
inline __m256 softmax_tile8(__m256* s, const __m256* valid, __m256& m, __m256& l, float* pt, int64_t pt_stride) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 t[kKeyTile];
#pragma GCC unroll 8
  for (int j = 0; j < kKeyTile; ++j) t[j] = s[j] = _mm256_blendv_ps(neg_inf, s[j], valid[j]);
  for (int w = kKeyTile / 2; w > 0; w /= 2)
#pragma GCC unroll 4
    for (int j = 0; j < w; ++j) t[j] = _mm256_max_ps(t[j], t[j + w]);
  const __m256 m_new = _mm256_max_ps(m, t[0]);
  const __m256 alpha = exp2_ps(_mm256_sub_ps(m, m_new));
#pragma GCC unroll 8
  for (int j = 0; j < kKeyTile; ++j) {
    t[j] = _mm256_and_ps(valid[j], exp2_ps(_mm256_sub_ps(s[j], m_new)));
    _mm256_store_ps(pt + j * pt_stride, t[j]);
  }
  for (int w = kKeyTile / 2; w > 0; w /= 2)
#pragma GCC unroll 4
    for (int j = 0; j < w; ++j) t[j] = _mm256_add_ps(t[j], t[j + w]);
  l = _mm256_fmadd_ps(l, alpha, t[0]);
  m = m_new;
  return alpha;
}

// One query tile (up to 16 rows) of `heads` query heads of one KV head against its whole causal
// context. Arguments as attend_tile_group's in prefill_attention_cpu.cpp; scratch holds
// 2 * kPrefillMaxGroup * D * 16 floats, kv_buf 2 * kKeyTile * D (for bf16), both 32-byte aligned.
template <typename T, int D>
void attend_tile_group(const T* q, int64_t q_stride, int64_t heads, int64_t nq, int64_t pos0,
                       const T* k_head, const T* v_head, const int64_t* table, int64_t block_size,
                       float scale_log2e, T* out, int64_t out_stride, float* scratch, float* kv_buf) {
  constexpr int R = kPrefillRows;
  constexpr int64_t kLines = D * static_cast<int64_t>(sizeof(T)) / 8;  // 64-byte lines in a key tile's K (and V)
  alignas(32) float pt[kKeyTile * R];  // P^T of the current key tile: [key][16 rows]
  alignas(32) float st[kKeyTile * R];  // S^T likewise
  const __m256 qscale = _mm256_set1_ps(scale_log2e);
  __m256 m[kPrefillMaxGroup][2], l[kPrefillMaxGroup][2];
  for (int64_t g = 0; g < heads; ++g) {
    float* qt = scratch + g * D * R;
    for (int v = 0; v < 2; ++v)
      for (int64_t d0 = 0; d0 < D; d0 += 8) {  // 8x8 blocks of Q, transposed in registers
        __m256 r[8];
        for (int64_t i = 0; i < 8; ++i) {
          const int64_t row = v * 8 + i;
          r[i] = row < nq ? _mm256_mul_ps(load8(q + row * q_stride + g * D + d0), qscale)
                          : _mm256_setzero_ps();
        }
        transpose8(r);
        for (int64_t dd = 0; dd < 8; ++dd) _mm256_store_ps(qt + (d0 + dd) * R + v * 8, r[dd]);
      }
    float* ot = scratch + (kPrefillMaxGroup + g) * D * R;
    std::fill(ot, ot + D * R, 0.f);
    for (int v = 0; v < 2; ++v) {
      m[g][v] = _mm256_set1_ps(-1e30f);
      l[g][v] = _mm256_setzero_ps();
    }
  }
  const int64_t num_keys = pos0 + nq;  // causal: the last row sees keys 0 .. pos0 + nq - 1
  // Each vector's row positions + 1: lane i sees key k iff k < pos + 1.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i pos_end[2] = {_mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(pos0 + 1))),
                              _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(pos0 + 9)))};
  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeyTile) {
    const int64_t row_in_cache = table[k0 / block_size] * block_size + k0 % block_size;
    const int64_t nk = std::min<int64_t>(kKeyTile, num_keys - k0);
    // The whole tile of K (its rows past nk are masked) and V's rows up to nk, read by every head.
    const float* kt = key_tile_rows<D>(k_head + row_in_cache * D, kKeyTile, kv_buf);
    const float* vt = key_tile_rows<D>(v_head + row_in_cache * D, nk, kv_buf + kKeyTile * D);
    // The next key tile (likely another page), asked for a line per step of the first head's
    // score loop rather than all at once (see NextTile in prefill_attention_cpu.cpp).
    const char* next_k = nullptr;
    const char* next_v = nullptr;
    if (k0 + kKeyTile < num_keys) {
      const int64_t nrow = table[(k0 + kKeyTile) / block_size] * block_size + (k0 + kKeyTile) % block_size;
      next_k = reinterpret_cast<const char*>(k_head + nrow * D);
      next_v = reinterpret_cast<const char*>(v_head + nrow * D);
    }
    __m256 valid[kKeyTile][2];
    for (int j = 0; j < kKeyTile; ++j)
      for (int v = 0; v < 2; ++v)
        valid[j][v] = j < nk ? _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos_end[v], _mm256_set1_epi32(static_cast<int>(k0 + j))))
                             : _mm256_setzero_ps();
    for (int64_t g = 0; g < heads; ++g) {
      const float* qt = scratch + g * D * R;
      // S^T for the tile's keys, 4 at a time: 8 accumulators, each key element loaded once.
      for (int quarter = 0; quarter < 2; ++quarter) {
        const float* kq = kt + quarter * 4 * D;
        __m256 a0[4], a1[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const int64_t line = quarter * D + d;  // D steps per quarter, D lines in all
          // (A bf16 tile's 2 * kLines lines are asked for in the first quarter's steps.)
          if (g == 0 && next_k != nullptr && (std::is_same_v<T, float> || line < 2 * kLines))
            _mm_prefetch(line < kLines ? next_k + 64 * line : next_v + 64 * (line - kLines), _MM_HINT_T1);
          __m256 q0 = _mm256_load_ps(qt + d * R), q1 = _mm256_load_ps(qt + d * R + 8);
          keep_in_register(q0);
          keep_in_register(q1);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m256 kv = _mm256_broadcast_ss(kq + j * D + d);
            a0[j] = _mm256_fmadd_ps(kv, q0, a0[j]);
            a1[j] = _mm256_fmadd_ps(kv, q1, a1[j]);
          }
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          _mm256_store_ps(st + (quarter * 4 + j) * R, a0[j]);
          _mm256_store_ps(st + (quarter * 4 + j) * R + 8, a1[j]);
        }
      }
      __m256 alpha[2];
      for (int v = 0; v < 2; ++v) {
        __m256 s[kKeyTile], vmask[kKeyTile];
#pragma GCC unroll 8
        for (int j = 0; j < kKeyTile; ++j) {
          s[j] = _mm256_load_ps(st + j * R + v * 8);
          vmask[j] = valid[j][v];
        }
        alpha[v] = softmax_tile8(s, vmask, m[g][v], l[g][v], pt + v * 8, R);
      }
      // O^T = alpha * O^T + V^T P^T, 4 head dims at a time (8 accumulators).
      float* og = scratch + (kPrefillMaxGroup + g) * D * R;
      for (int64_t d0 = 0; d0 < D; d0 += 4) {
        __m256 o0[4], o1[4];
#pragma GCC unroll 4
        for (int dd = 0; dd < 4; ++dd) {
          o0[dd] = _mm256_mul_ps(_mm256_load_ps(og + (d0 + dd) * R), alpha[0]);
          o1[dd] = _mm256_mul_ps(_mm256_load_ps(og + (d0 + dd) * R + 8), alpha[1]);
        }
        for (int64_t j = 0; j < nk; ++j) {
          __m256 p0 = _mm256_load_ps(pt + j * R), p1 = _mm256_load_ps(pt + j * R + 8);
          keep_in_register(p0);
          keep_in_register(p1);
          const float* vrow = vt + j * D + d0;
#pragma GCC unroll 4
          for (int dd = 0; dd < 4; ++dd) {
            const __m256 vv = _mm256_broadcast_ss(vrow + dd);
            o0[dd] = _mm256_fmadd_ps(vv, p0, o0[dd]);
            o1[dd] = _mm256_fmadd_ps(vv, p1, o1[dd]);
          }
        }
#pragma GCC unroll 4
        for (int dd = 0; dd < 4; ++dd) {
          _mm256_store_ps(og + (d0 + dd) * R, o0[dd]);
          _mm256_store_ps(og + (d0 + dd) * R + 8, o1[dd]);
        }
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {  // O^T back to rows, 8x8 blocks at a time
    const float* og = scratch + (kPrefillMaxGroup + g) * D * R;
    for (int v = 0; v < 2; ++v) {
      const int64_t rows = std::min<int64_t>(8, nq - v * 8);
      if (rows <= 0) break;
      alignas(32) float inv[8];
      _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.f), l[g][v]));
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int64_t dd = 0; dd < 8; ++dd) r[dd] = _mm256_load_ps(og + (d0 + dd) * R + v * 8);
        transpose8(r);
        for (int64_t i = 0; i < rows; ++i)
          store8(out + (v * 8 + i) * out_stride + g * D + d0, _mm256_mul_ps(r[i], _mm256_set1_ps(inv[i])));
      }
    }
  }
}

}  // namespace kvmesh_avx2
#endif
