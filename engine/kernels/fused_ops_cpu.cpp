// Fused elementwise ops for the CPU backend: each replaces a chain of small torch
// ops (and their temporaries) by one pass over the rows, parallel over tokens.
// At decode batch sizes these chains cost more in dispatch than in arithmetic;
// at prefill sizes they cost memory traffic.
//
//   rms_norm(out, x, w, eps)                out = x * rsqrt(mean(x^2) + eps) * w
//   fused_add_rms_norm(x, residual, w, eps) residual += x; x = rms_norm(residual) * w
//   rotary_qk_store_kv_(qkv, positions, cos, sin, H, Hkv, D, k_cache, v_cache, slots)
//                                           rotate the q and k heads of the fused
//                                           qkv projection in place (rotate-half
//                                           convention, fp32 cos/sin tables) and
//                                           store each row's k and v heads in its
//                                           cache slot
//   silu_and_mul(gate_up) -> out            silu(gate) * up for [T, 2I] -> [T, I]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>

#include "avx2_math.h"
#include "avx512_math.h"

namespace {

template <typename T>
void rms_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  // Same rounding order as transformers: normalise in fp32, cast, then scale by the weight.
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * r)));
}

}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous(), "rms_norm: bad layout");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(op + r * os, xp + r * xs, wp, n, static_cast<float>(eps));
    });
  });
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "fused_add_rms_norm: contiguous");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.dim() == 2, "fused_add_rms_norm: shapes");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* xr = xp + r * n;
        scalar_t* rr = rp + r * n;
        for (int64_t i = 0; i < n; ++i) rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        rms_row(xr, rr, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// rotary_qk_store_kv_: rotates the q and k heads of each row of the fused qkv projection in
// place and stores the row's (rotated) k heads and v heads in its cache slot, so the step's
// K/V never take a second pass through memory.
void rotary_qk_store_kv_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary: qkv must be [T, width] with unit stride");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous(), "fp32 tables");
  TORCH_CHECK(positions.scalar_type() == torch::kLong, "int64 positions");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type(),
              "rotary: caches must be contiguous and of qkv's dtype");
  TORCH_CHECK(k_cache.size(0) == num_kv_heads && k_cache.size(3) == head_dim, "rotary: cache [Hkv, NB, B, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == qkv.size(0), "rotary: one int64 slot per row");
  auto pos = positions.contiguous();
  auto slot_idx = slots.contiguous();
  const int64_t rows = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2;
  const int64_t heads = num_heads + num_kv_heads;  // q heads then k heads; v is not rotated
  const int64_t head_stride = k_cache.size(1) * k_cache.size(2) * head_dim;  // between two KV heads
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float* ct = cos.data_ptr<float>();
    const float* st = sin.data_ptr<float>();
    const int64_t tw = cos.size(1);
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t* sp = slot_idx.data_ptr<int64_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* c = ct + pp[r] * tw;
        const float* s = st + pp[r] * tw;
        scalar_t* row = base + r * stride;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = row + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            x[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
            x[i + half] = static_cast<scalar_t>(x2 * c[i + half] + x1 * s[i + half]);
          }
        }
        const scalar_t* k = row + num_heads * head_dim;
        const scalar_t* v = k + num_kv_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          std::memcpy(kc + h * head_stride + sp[r] * head_dim, k + h * head_dim, head_dim * sizeof(scalar_t));
          std::memcpy(vc + h * head_stride + sp[r] * head_dim, v + h * head_dim, head_dim * sizeof(scalar_t));
        }
      }
    });
  });
}

template <typename T>
static void silu_and_mul_row(T* o, const T* g, const T* u, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gv = static_cast<float>(g[i]);
    // silu rounds to the storage type before the product, as torch's two ops do. exp's argument
    // is capped below fp32's overflow: under -ffast-math the vectorised expf (libmvec) returns
    // infinity past ~88, and the division by it gave NaN (silu(-100) must be -0).
    const float e = std::exp(std::min(-gv, 88.f));
    o[i] = static_cast<T>(static_cast<float>(static_cast<T>(gv / (1.f + e))) * static_cast<float>(u[i]));
  }
}

#if defined(__AVX512F__)
// fp32: 16 lanes at a time with the polynomial exp2 (libm's scalar expf made this op cost
// ~2 cycles per element, half a second of a prefill-heavy run).
static void silu_and_mul_row(float* o, const float* g, const float* u, int64_t n) {
  const __m512 minus_log2e = _mm512_set1_ps(-1.4426950408889634f), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 e = kvmesh_avx512::exp2_ps(_mm512_mul_ps(gv, minus_log2e));  // exp(-g)
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

// bf16: the fp32 path's arithmetic on widened lanes, silu rounded to bf16 before the product as
// in the generic path (which, on c10::BFloat16 elements, stays scalar with libm's expf: ~12x the
// fp32 op's time, a fifth of a bf16 decode step at batch 32). A partial last vector goes
// through a zero-padded buffer.
static void silu_and_mul_row(c10::BFloat16* o, const c10::BFloat16* g, const c10::BFloat16* u, int64_t n) {
  using namespace kvmesh_avx512;
  const __m512 minus_log2e = _mm512_set1_ps(-1.4426950408889634f), one = _mm512_set1_ps(1.f);
  auto step = [&](c10::BFloat16* op, const c10::BFloat16* gp, const c10::BFloat16* up) {
    const __m512 gv = load_bf16(gp);
    const __m512 e = exp2_ps(_mm512_mul_ps(gv, minus_log2e));  // exp(-g)
    const __m512 silu = round_bf16_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
    store_bf16(op, _mm512_mul_ps(silu, load_bf16(up)));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) step(o + i, g + i, u + i);
  if (i < n) {
    c10::BFloat16 gb[16] = {}, ub[16] = {}, ob[16];
    std::copy(g + i, g + n, gb);
    std::copy(u + i, u + n, ub);
    step(ob, gb, ub);
    std::copy(ob, ob + (n - i), o + i);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// bf16 on AVX2: the AVX-512 bf16 path above on 8 lanes (fp32 there is left to the generic loop,
// which vectorises with libmvec's expf).
static void silu_and_mul_row(c10::BFloat16* o, const c10::BFloat16* g, const c10::BFloat16* u, int64_t n) {
  using namespace kvmesh_avx2;
  const __m256 minus_log2e = _mm256_set1_ps(-1.4426950408889634f), one = _mm256_set1_ps(1.f);
  auto step = [&](c10::BFloat16* op, const c10::BFloat16* gp, const c10::BFloat16* up) {
    const __m256 gv = load_bf16(gp);
    const __m256 e = exp2_ps(_mm256_mul_ps(gv, minus_log2e));  // exp(-g)
    const __m256 silu = round_bf16_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)));
    store_bf16(op, _mm256_mul_ps(silu, load_bf16(up)));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) step(o + i, g + i, u + i);
  if (i < n) {
    c10::BFloat16 gb[8] = {}, ub[8] = {}, ob[8];
    std::copy(g + i, g + n, gb);
    std::copy(u + i, u + n, ub);
    step(ob, gb, ub);
    std::copy(ob, ob + (n - i), o + i);
  }
}
#endif

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_and_mul: [T, 2I]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_and_mul_row(op + r * n, gp + r * 2 * n, gp + r * 2 * n + n, n);
    });
  });
  return out;
}
