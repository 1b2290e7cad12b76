// Decode attention's head-size-64 path for AVX2 machines (no AVX-512), fp32 or bf16 K/V: the
// same one pass with an online softmax as paged_attention_cpu.cpp's AVX-512 path, on 8-lane
// vectors and 16 registers. Included by paged_attention_cpu.cpp only.
//
// A tile is 8 keys (a block of a multiple of 8 rows holds whole tiles); the 8 dot products of a
// tile are reduced together (hsum8) into one vector of scores. The softmax's maximum moves once
// per chunk of kChunk tiles (64 keys), as on AVX-512: its horizontal reductions and exp2 are a
// serial chain that per tile would cost more than the tile's loads. The weighted sum of V keeps
// GROUP x DV accumulators in registers (DV vectors of 8 head dims, so GROUP * DV <= 12 of the
// 16 registers) and walks the chunk's V rows 8 / DV times, the later walks from L1.
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <algorithm>
#include <cmath>
#include <type_traits>

#include <c10/util/BFloat16.h>

#include "avx2_math.h"

namespace kvmesh_avx2 {

template <typename T, int GROUP, int DV>
static void decode_task_d64(const T* __restrict__ q, const T* __restrict__ k_head, const T* __restrict__ v_head,
                            const int64_t* table, int64_t ctx, int64_t block_size, int64_t group_rt, float scale,
                            T* __restrict__ out) {
  constexpr int64_t D = 64, kTile = 8, kVecs = D / 8;
  constexpr int64_t kLineElems = 64 / sizeof(T), kRowLines = D / kLineElems;  // per 64-byte cache line
  constexpr int kChunk = 8, kMaxGroup = 16;
  static_assert(GROUP == 0 || GROUP * DV <= 12, "accumulators must leave registers for V and p");
  const int64_t group = GROUP > 0 ? GROUP : group_rt;
  alignas(32) float qs[kMaxGroup * D], acc[kMaxGroup * D];
  alignas(32) float p[kMaxGroup * kChunk * kTile];  // softmax weights: [head][key of the chunk]
  float m[kMaxGroup], l[kMaxGroup], alpha[kMaxGroup];
  const float scale_log2e = scale * 1.4426950408889634f;  // scores in log2 units: exp2 below
  for (int64_t i = 0; i < group * D; ++i) qs[i] = static_cast<float>(q[i]) * scale_log2e;
  std::fill(acc, acc + group * D, 0.f);
  std::fill(m, m + group, -1e30f);
  std::fill(l, l + group, 0.f);
  const int64_t ntiles = (ctx + kTile - 1) / kTile;
  const int64_t tiles_per_block = block_size / kTile;
  auto tile_row = [&](int64_t t) {  // first cache row of tile t
    return table[t / tiles_per_block] * block_size + t % tiles_per_block * kTile;
  };
  for (int64_t c0 = 0; c0 < ntiles; c0 += kChunk) {
    const int nt = static_cast<int>(std::min<int64_t>(kChunk, ntiles - c0));
    const T* kt[kChunk];
    const T* vt[kChunk];
    for (int t = 0; t < nt; ++t) {
      kt[t] = k_head + tile_row(c0 + t) * D;
      vt[t] = v_head + tile_row(c0 + t) * D;
    }
    // The next chunk's tiles, asked for row by row while this chunk's V rows are summed: a block
    // is a 4 KiB page, and the hardware prefetcher stops at a page. Scattered blocks (a pool that
    // has served a while) read 1.1-1.25x with it; blocks in order 0.9-0.95x (asking only for
    // blocks that do not follow on from the one before gave up about half of the first gain and
    // won back little of the second loss).
    const int nt_next = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kChunk, ntiles - c0 - kChunk)));
    const T* kn[kChunk];
    const T* vn[kChunk];
    for (int t = 0; t < nt_next; ++t) {
      kn[t] = k_head + tile_row(c0 + kChunk + t) * D;
      vn[t] = v_head + tile_row(c0 + kChunk + t) * D;
    }
    // Only the context's last tile can be partial; its rows past the end are never summed.
    const int64_t last_n = std::min<int64_t>(kTile, ctx - (c0 + nt - 1) * kTile);
    const __m256 last_valid = first_lanes(last_n);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs + g * D;
      __m256 s[kChunk];
      for (int t = 0; t < nt; ++t) {
        __m256 part[kTile];
#pragma GCC unroll 8
        for (int j = 0; j < kTile; ++j) {
          const T* k = kt[t] + j * D;
          __m256 a = _mm256_mul_ps(_mm256_load_ps(qg), load8(k));
          __m256 c = _mm256_mul_ps(_mm256_load_ps(qg + 8), load8(k + 8));
#pragma GCC unroll 8
          for (int64_t v = 2; v < kVecs; v += 2) {
            a = _mm256_fmadd_ps(_mm256_load_ps(qg + v * 8), load8(k + v * 8), a);
            c = _mm256_fmadd_ps(_mm256_load_ps(qg + v * 8 + 8), load8(k + v * 8 + 8), c);
          }
          part[j] = _mm256_add_ps(a, c);
        }
        s[t] = hsum8(part);
      }
      s[nt - 1] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[nt - 1], last_valid);
      __m256 mx = s[0];
      for (int t = 1; t < nt; ++t) mx = _mm256_max_ps(mx, s[t]);
      const float m_new = std::max(m[g], hmax(mx));
      alpha[g] = _mm256_cvtss_f32(exp2_ps(_mm256_set1_ps(m[g] - m_new)));
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int t = 0; t < nt; ++t) {
        __m256 pv = exp2_ps(_mm256_sub_ps(s[t], mv));
        if (t == nt - 1) pv = _mm256_and_ps(pv, last_valid);
        sum = _mm256_add_ps(sum, pv);
        _mm256_store_ps(p + (g * kChunk + t) * kTile, pv);
      }
      l[g] = l[g] * alpha[g] + hsum(sum);
      m[g] = m_new;
    }
    // Weighted sum of V: each head's accumulator rescaled, then the chunk's rows added.
    if constexpr (GROUP > 0) {
      for (int64_t d0 = 0; d0 < kVecs; d0 += DV) {
        __m256 r[GROUP][DV];
#pragma GCC unroll 16
        for (int g = 0; g < GROUP; ++g)
          for (int c = 0; c < DV; ++c)
            r[g][c] = _mm256_mul_ps(_mm256_load_ps(acc + g * D + (d0 + c) * 8), _mm256_set1_ps(alpha[g]));
        for (int t = 0; t < nt; ++t) {
          const int64_t n = t == nt - 1 ? last_n : kTile;
          for (int64_t j = 0; j < n; ++j) {
            if (d0 == 0 && t < nt_next)
              for (int c = 0; c < kRowLines; ++c) {
                _mm_prefetch(reinterpret_cast<const char*>(kn[t] + j * D + c * kLineElems), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(vn[t] + j * D + c * kLineElems), _MM_HINT_T0);
              }
            const T* v = vt[t] + j * D + d0 * 8;
            __m256 vv[DV];
#pragma GCC unroll 8
            for (int c = 0; c < DV; ++c) vv[c] = load8(v + c * 8);
#pragma GCC unroll 16
            for (int g = 0; g < GROUP; ++g) {
              const __m256 pj = _mm256_broadcast_ss(p + (g * kChunk + t) * kTile + j);
              for (int c = 0; c < DV; ++c) r[g][c] = _mm256_fmadd_ps(pj, vv[c], r[g][c]);
            }
          }
        }
#pragma GCC unroll 16
        for (int g = 0; g < GROUP; ++g)
          for (int c = 0; c < DV; ++c) _mm256_store_ps(acc + g * D + (d0 + c) * 8, r[g][c]);
      }
    } else {
      for (int64_t g = 0; g < group; ++g) {
        const __m256 al = _mm256_set1_ps(alpha[g]);
        float* ag = acc + g * D;
        __m256 r[kVecs];
        for (int c = 0; c < kVecs; ++c) r[c] = _mm256_mul_ps(_mm256_load_ps(ag + c * 8), al);
        for (int t = 0; t < nt; ++t) {
          const int64_t n = t == nt - 1 ? last_n : kTile;
          for (int64_t j = 0; j < n; ++j) {
            if (g == 0 && t < nt_next)
              for (int c = 0; c < kRowLines; ++c) {
                _mm_prefetch(reinterpret_cast<const char*>(kn[t] + j * D + c * kLineElems), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(vn[t] + j * D + c * kLineElems), _MM_HINT_T0);
              }
            const __m256 pj = _mm256_broadcast_ss(p + (g * kChunk + t) * kTile + j);
            const T* v = vt[t] + j * D;
            for (int c = 0; c < kVecs; ++c) r[c] = _mm256_fmadd_ps(pj, load8(v + c * 8), r[c]);
          }
        }
        for (int c = 0; c < kVecs; ++c) _mm256_store_ps(ag + c * 8, r[c]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / l[g]);
    for (int64_t c = 0; c < kVecs; ++c) {
      const __m256 o = _mm256_mul_ps(_mm256_load_ps(acc + g * D + c * 8), inv);
      store8(out + g * D + c * 8, o);
    }
  }
}

// The group sizes of common models get their accumulators in registers.
template <typename T>
static void decode_task_d64_any(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t ctx,
                                int64_t block_size, int64_t group, float scale, T* out) {
  switch (group) {
    case 1: return decode_task_d64<T, 1, 8>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    case 2: return decode_task_d64<T, 2, 4>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    case 3: return decode_task_d64<T, 3, 4>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    case 4: return decode_task_d64<T, 4, 2>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    default: return decode_task_d64<T, 0, 0>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
  }
}

}  // namespace kvmesh_avx2
#endif
