// Decode attention straight from the paged KV cache, for the CPU backend.
//
// The torch fallback gathers every decoding request's context out of the cache
// into a padded tensor before attending; at batch 64 that copy moves more bytes
// than the model weights. This kernel reads each K/V row in place from its block,
// parallel over (request, KV head), longest contexts first. The generic path
// makes two passes (scores + softmax, then the weighted sum of V) with the head
// size a compile-time constant for the common sizes; head size 64 in fp32 or bf16
// has an AVX-512 path that makes one pass with an online softmax, and an AVX2
// version of it for CPUs without AVX-512 (decode_attention_avx2.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx512_math.h"
#include "decode_attention_avx2.h"
#include "work_queue.h"

// Calls f(row, t) for the context's rows t = 0..ctx-1 of one head, block by block
// (no per-token division). No software prefetch: a request's blocks mostly sit back to back
// in the pool, where the hardware prefetcher does better on its own (measured: explicit
// prefetching slowed this generic path by ~20% there on an AMD Zen 4, and did not help on
// shuffled blocks; the head-size-64 path below does prefetch).
template <typename T, typename F>
static inline void for_each_row(const T* head, const int64_t* table, int64_t ctx, int64_t block_size,
                                int64_t head_dim, F&& f) {
  const int64_t block_elems = block_size * head_dim;
  const int64_t nblocks = (ctx + block_size - 1) / block_size;
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* blk = head + table[b] * block_elems;
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
  for_each_row(k_head, table, ctx, block_size, hd, [&](const T* krow, int64_t t) {
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
  for_each_row(v_head, table, ctx, block_size, hd, [&](const T* vrow, int64_t t) {
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
// Head size 64, blocks of a multiple of 16 rows: one pass over the context with an online
// softmax, in chunks of kChunk tiles of 16 keys. Each 16-row K/V tile is fetched once and serves
// every query head of the group from L1; the 16 dot products of a tile are reduced together
// (hsum16) into one vector of scores, so the softmax is vectorised. With the group size known at
// compile time (GROUP > 0) the heads' accumulators stay in registers and each V row is loaded
// once for all heads; GROUP == 0 handles any group size through memory.
//
// The softmax's running maximum moves once per chunk, not once per tile: its horizontal
// reductions and exp2 are a serial chain of ~150 cycles per head, which per 16-key tile made the
// kernel slower on data already in cache (~55 GB/s on two threads) than DRAM delivers, and with
// little overlap the two added up. Chunks of 4 tiles: 1.22x in cache, 1.13-1.21x from DRAM
// (SmolLM2's heads, 30 layers, scattered blocks, batch 8 x 512 and 16 x <=384; Zen 5, 2 threads);
// 8 tiles read 0.95-1.0x of 4.
//
// Prefetch: a tile's 128 lines are asked for one at a time while the V rows of the tile kChunk
// earlier are summed (the next chunk arrives during this one), and the first two lines of the
// tile twice as far ahead are touched, which starts the hardware prefetcher on that block's page
// early (blocks are 4 KiB pages, scattered, and the prefetcher stops at a page): 1.05-1.1x more
// from DRAM. Without the per-line prefetch the kernel reads at 0.7-0.8x.
//
// bf16 (T = c10::BFloat16) takes the same path: each 16-element row segment is widened to fp32
// as it is loaded (load_bf16), all arithmetic is fp32, and the output is rounded to bf16 once. A
// bf16 row is two cache lines rather than four, so the prefetches step by lines, not rows.
using kvmesh_avx512::load16;
using kvmesh_avx512::store16;

template <typename T, int GROUP>
static void decode_task_d64(const T* __restrict__ q, const T* __restrict__ k_head, const T* __restrict__ v_head,
                            const int64_t* table, int64_t ctx, int64_t block_size, int64_t group_rt, float scale,
                            T* __restrict__ out) {
  using namespace kvmesh_avx512;
  constexpr int64_t D = 64, kTile = 16;
  constexpr int64_t kLineElems = 64 / sizeof(T), kRowLines = D / kLineElems;  // per 64-byte cache line
  constexpr int kChunk = 4, kMaxGroup = 16, kTouchAhead = 2 * kChunk, kTouchLines = 2;
  const int64_t group = GROUP > 0 ? GROUP : group_rt;
  alignas(64) float qs[kMaxGroup * D], acc[kMaxGroup * D];
  alignas(64) float p[kMaxGroup * kChunk * kTile];  // softmax weights: [head][key of the chunk]
  float m[kMaxGroup], l[kMaxGroup], alpha[kMaxGroup];
  const float scale_log2e = scale * 1.4426950408889634f;  // scores in log2 units: exp2 below
  for (int64_t i = 0; i < group * D; ++i) qs[i] = static_cast<float>(q[i]) * scale_log2e;
  std::fill(acc, acc + group * D, 0.f);
  std::fill(m, m + group, -1e30f);
  std::fill(l, l + group, 0.f);
  __m512 reg_acc[GROUP > 0 ? GROUP : 1][4];  // GROUP > 0: the accumulators, in registers
  if constexpr (GROUP > 0)
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < 4; ++c) reg_acc[g][c] = _mm512_setzero_ps();
  const int64_t ntiles = (ctx + kTile - 1) / kTile;
  const int64_t tiles_per_block = block_size / kTile;
  auto tile_row = [&](int64_t t) {  // first cache row of tile t (no division for 16-row blocks)
    return tiles_per_block == 1 ? table[t] * kTile
                                : table[t / tiles_per_block] * block_size + t % tiles_per_block * kTile;
  };
  // The first chunk's tiles after the first (the loop asks for each later tile kChunk ahead).
  for (int64_t t = 1; t < std::min<int64_t>(kChunk, ntiles); ++t)
    for (int64_t off = 0; off < kTile * D; off += kLineElems) {
      _mm_prefetch(reinterpret_cast<const char*>(k_head + tile_row(t) * D + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v_head + tile_row(t) * D + off), _MM_HINT_T0);
    }
  for (int64_t c0 = 0; c0 < ntiles; c0 += kChunk) {
    const int nt = static_cast<int>(std::min<int64_t>(kChunk, ntiles - c0));
    const T* kt[kChunk];
    const T* vt[kChunk];
    for (int t = 0; t < nt; ++t) {
      kt[t] = k_head + tile_row(c0 + t) * D;
      vt[t] = v_head + tile_row(c0 + t) * D;
    }
    // Only the context's last tile can be partial; its rows past the end are never summed.
    const int64_t last_n = std::min<int64_t>(kTile, ctx - (c0 + nt - 1) * kTile);
    const __mmask16 last_valid = last_n == kTile ? 0xFFFF : static_cast<__mmask16>((1u << last_n) - 1);
    // Scores of the chunk's keys, head by head, and each head's softmax step.
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs + g * D;
      const __m512 q0 = _mm512_load_ps(qg), q1 = _mm512_load_ps(qg + 16);
      const __m512 q2 = _mm512_load_ps(qg + 32), q3 = _mm512_load_ps(qg + 48);
      __m512 s[kChunk];
      for (int t = 0; t < nt; ++t) {
        __m512 part[kTile];
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) {
          const T* k = kt[t] + j * D;
          __m512 a = _mm512_mul_ps(q0, load16(k));
          __m512 c = _mm512_mul_ps(q1, load16(k + 16));
          a = _mm512_fmadd_ps(q2, load16(k + 32), a);
          c = _mm512_fmadd_ps(q3, load16(k + 48), c);
          part[slot_of(j)] = _mm512_add_ps(a, c);
        }
        s[t] = hsum16(part);
      }
      s[nt - 1] = _mm512_mask_blend_ps(last_valid, _mm512_set1_ps(-INFINITY), s[nt - 1]);
      __m512 mx = s[0];
      for (int t = 1; t < nt; ++t) mx = _mm512_max_ps(mx, s[t]);
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(mx));
      // exp2 in a vector register: a scalar exp2f is a libm call, which costs ~10% here.
      alpha[g] = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m[g] - m_new)));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < nt; ++t) {
        __m512 pv = exp2_ps(_mm512_sub_ps(s[t], mv));
        if (t == nt - 1) pv = _mm512_maskz_mov_ps(last_valid, pv);
        sum = _mm512_add_ps(sum, pv);
        _mm512_store_ps(p + (g * kChunk + t) * kTile, pv);
      }
      l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(sum);
      m[g] = m_new;
    }
    // Weighted sum of V: rescale each head's accumulator, then add the chunk's rows.
    if constexpr (GROUP > 0) {
#pragma GCC unroll 8
      for (int g = 0; g < GROUP; ++g) {
        const __m512 al = _mm512_set1_ps(alpha[g]);
        for (int c = 0; c < 4; ++c) reg_acc[g][c] = _mm512_mul_ps(reg_acc[g][c], al);
      }
    } else {
      for (int64_t g = 0; g < group; ++g) {
        const __m512 al = _mm512_set1_ps(alpha[g]);
        for (int64_t c = 0; c < D; c += 16) _mm512_store_ps(acc + g * D + c, _mm512_mul_ps(_mm512_load_ps(acc + g * D + c), al));
      }
    }
    for (int t = 0; t < nt; ++t) {
      const int64_t n = t == nt - 1 ? last_n : kTile;
      const int64_t ahead = c0 + t + kChunk, touch = c0 + t + kTouchAhead;
      const T* k_next = ahead < ntiles ? k_head + tile_row(ahead) * D : nullptr;
      const T* v_next = ahead < ntiles ? v_head + tile_row(ahead) * D : nullptr;
      if (touch < ntiles)
        for (int c = 0; c < kTouchLines; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(k_head + tile_row(touch) * D + c * kLineElems), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_head + tile_row(touch) * D + c * kLineElems), _MM_HINT_T0);
        }
      for (int64_t j = 0; j < n; ++j) {
        if (k_next != nullptr)  // row j of the tile kChunk ahead
          for (int c = 0; c < kRowLines; ++c) {
            _mm_prefetch(reinterpret_cast<const char*>(k_next + j * D + c * kLineElems), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v_next + j * D + c * kLineElems), _MM_HINT_T0);
          }
        const T* v = vt[t] + j * D;
        const __m512 v0 = load16(v), v1 = load16(v + 16);
        const __m512 v2 = load16(v + 32), v3 = load16(v + 48);
        if constexpr (GROUP > 0) {
#pragma GCC unroll 8
          for (int g = 0; g < GROUP; ++g) {
            const __m512 pj = _mm512_set1_ps(p[(g * kChunk + t) * kTile + j]);
            reg_acc[g][0] = _mm512_fmadd_ps(pj, v0, reg_acc[g][0]);
            reg_acc[g][1] = _mm512_fmadd_ps(pj, v1, reg_acc[g][1]);
            reg_acc[g][2] = _mm512_fmadd_ps(pj, v2, reg_acc[g][2]);
            reg_acc[g][3] = _mm512_fmadd_ps(pj, v3, reg_acc[g][3]);
          }
        } else {
          for (int64_t g = 0; g < group; ++g) {
            const __m512 pj = _mm512_set1_ps(p[(g * kChunk + t) * kTile + j]);
            float* ag = acc + g * D;
            _mm512_store_ps(ag, _mm512_fmadd_ps(pj, v0, _mm512_load_ps(ag)));
            _mm512_store_ps(ag + 16, _mm512_fmadd_ps(pj, v1, _mm512_load_ps(ag + 16)));
            _mm512_store_ps(ag + 32, _mm512_fmadd_ps(pj, v2, _mm512_load_ps(ag + 32)));
            _mm512_store_ps(ag + 48, _mm512_fmadd_ps(pj, v3, _mm512_load_ps(ag + 48)));
          }
        }
      }
    }
  }
  if constexpr (GROUP > 0)
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + g * D + c * 16, reg_acc[g][c]);
  for (int64_t g = 0; g < group; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / l[g]);
    for (int64_t c = 0; c < D; c += 16)
      store16(out + g * D + c, _mm512_mul_ps(_mm512_load_ps(acc + g * D + c), inv));
  }
}

// The group sizes of common models (Llama 3: 4, SmolLM2: 3, ...) get the register path.
template <typename T>
static void decode_task_d64_any(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t ctx,
                                int64_t block_size, int64_t group, float scale, T* out) {
  switch (group) {
    case 1: return decode_task_d64<T, 1>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    case 2: return decode_task_d64<T, 2>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    case 3: return decode_task_d64<T, 3>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    case 4: return decode_task_d64<T, 4>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
    default: return decode_task_d64<T, 0>(q, k_head, v_head, table, ctx, block_size, group, scale, out);
  }
}
#endif

template <typename T, int D>
static void decode_kernel(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* ctx_lens, T* out, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                          int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  // Tasks are (request, KV head), longest context first (work_queue.h).
  kvmesh_cpu::parallel_longest_first(
      num_seqs * num_kv_heads, [&](int64_t task) { return ctx_lens[task / num_kv_heads]; }, [&] {
        return [&, qf = std::vector<float>(group * head_dim), acc = std::vector<float>(group * head_dim),
                scores = std::vector<float>()](int64_t task) mutable {
          const int64_t r = task / num_kv_heads, kvh = task % num_kv_heads;
          const int64_t head_base = kvh * num_blocks * block_size * head_dim;
          const int64_t qoff = r * q_stride + kvh * group * head_dim;
          const int64_t ooff = (r * num_heads + kvh * group) * head_dim;
#if defined(__AVX512F__)
          if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && D == 64) {
            if (block_size % 16 == 0 && group <= 16) {
              decode_task_d64_any(q + qoff, k_cache + head_base, v_cache + head_base, tables + r * max_blocks,
                                      ctx_lens[r], block_size, group, scale, out + ooff);
              return;
            }
          }
#elif defined(__AVX2__) && defined(__FMA__)
          if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && D == 64) {
            if (block_size % 8 == 0 && group <= 16) {
              kvmesh_avx2::decode_task_d64_any(q + qoff, k_cache + head_base, v_cache + head_base,
                                                   tables + r * max_blocks, ctx_lens[r], block_size, group, scale,
                                                   out + ooff);
              return;
            }
          }
#endif
          decode_task<T, D>(q + qoff, k_cache + head_base, v_cache + head_base, tables + r * max_blocks,
                            ctx_lens[r], block_size, group, head_dim, scale, out + ooff, qf, scores, acc);
        };
      });
}

// q: [R, H, D] with heads back to back in a row (a view into the fused qkv is fine);
// k_cache, v_cache: [Hkv, NB, B, D]; block_tables: [R, max_blocks] int64;
// ctx_lens: [R] int64 (every length >= 1). Returns [R, H, D], contiguous.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must hold heads back to back");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), B = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto d_const) {
      constexpr int Dc = decltype(d_const)::value;
      decode_kernel<scalar_t, Dc>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                  R, H, Hkv, NB, B, D, tables.size(1), static_cast<float>(scale));
    };
    if (D == 64) run(std::integral_constant<int, 64>{});
    else if (D == 128) run(std::integral_constant<int, 128>{});
    else run(std::integral_constant<int, 0>{});
  });
  return out;
}
