// Fused elementwise ops for the CPU backend: each replaces a chain of small torch
// ops (and their temporaries) by one pass over the rows, parallel over tokens.
// At decode batch sizes these chains cost more in dispatch than in arithmetic;
// at prefill sizes they cost memory traffic.
//
//   rms_norm(out, x, w, eps)                out = x * rsqrt(mean(x^2) + eps) * w
//   fused_add_rms_norm(x, residual, w, eps) residual += x; x = rms_norm(residual) * w
//   rotary_qk_(qkv, positions, cos, sin, H, Hkv, D)
//                                           rotate the q and k heads of the fused
//                                           qkv projection in place (rotate-half
//                                           convention, fp32 cos/sin tables)
//   silu_and_mul(gate_up) -> out            silu(gate) * up for [T, 2I] -> [T, I]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

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

void rotary_qk_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_qk_: qkv must be [T, width] with unit stride");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous(), "fp32 tables");
  TORCH_CHECK(positions.scalar_type() == torch::kLong, "int64 positions");
  auto pos = positions.contiguous();
  const int64_t rows = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2;
  const int64_t heads = num_heads + num_kv_heads;  // q heads then k heads, v untouched
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qk_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float* ct = cos.data_ptr<float>();
    const float* st = sin.data_ptr<float>();
    const int64_t tw = cos.size(1);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* c = ct + pp[r] * tw;
        const float* s = st + pp[r] * tw;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = base + r * stride + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            x[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
            x[i + half] = static_cast<scalar_t>(x2 * c[i + half] + x1 * s[i + half]);
          }
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
    // silu rounds to the storage type before the product, as torch's two ops do.
    o[i] = static_cast<T>(static_cast<float>(static_cast<T>(gv / (1.f + std::exp(-gv)))) * static_cast<float>(u[i]));
  }
}

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
