// Small AVX-512 helpers shared by the attention kernels and the fused ops (fp32, and bf16 loads
// and stores around fp32 arithmetic).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <type_traits>

namespace kvmesh_avx512 {

// 2^x, relative error ~1e-8, with x clamped to [-127, 127]: never infinity, which code
// built with -ffast-math must not produce (its divisions become reciprocals: inf -> NaN).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
  // 2^f = e^(f ln 2), Taylor series to degree 7.
  __m512 p = _mm512_set1_ps(1.5252734e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values (raw 16-bit lanes) widened to fp32: exact, a bf16 is the top half of an fp32.
inline __m512 load_bf16(const void* p) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 rounded to the nearest bf16 (ties to even, as c10::BFloat16 rounds finite values), still
// as fp32 lanes: the low 16 bits are zero.
inline __m512 round_bf16_ps(__m512 x) {
  const __m512i i = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(i, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 fp32 values stored as bf16, rounded as round_bf16_ps.
inline void store_bf16(void* p, __m512 x) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(x)), 16));
  _mm256_storeu_si256(static_cast<__m256i*>(p), h);
}

// 16 elements of an fp32 or bf16 row as fp32, and stored back (bf16 rounded once, as torch
// rounds): the kernels' arithmetic is fp32 whatever the tensors' dtype.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else return load_bf16(p);
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(p, v);
  else store_bf16(p, v);
}

// The horizontal sums of 16 vectors as one vector. Input slot (j % 4) * 4 + j / 4 must
// hold vector j for lane j of the result to be its sum (the shuffle network transposes
// 4x4 groups); slot_of(j) gives that index.
constexpr int slot_of(int j) { return (j % 4) * 4 + j / 4; }

inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // 128-bit halves: [a0+a2, a1+a3 | b0+b2, b1+b3]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

// Transposes a 16x16 fp32 tile held as 16 row vectors, in place.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

}  // namespace kvmesh_avx512
#endif
