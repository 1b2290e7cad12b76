// Small AVX2 helpers shared by the attention kernels' and the fused ops' 8-lane paths (fp32, and
// bf16 loads and stores around fp32 arithmetic), for machines without AVX-512 (AMD Zen 2/3,
// Intel client parts): the counterparts of avx512_math.h.
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <type_traits>

namespace kvmesh_avx2 {

// 2^x, relative error ~1e-8, x clamped to [-127, 127] (never infinity, which -ffast-math code
// must not produce). The same polynomial as kvmesh_avx512::exp2_ps; 2^n is built in the
// exponent field (AVX2 has no scalef), so 2^-127 comes out as 0 rather than a denormal.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // in [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(1.5252734e-5f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530e-4f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 bf16 values (raw 16-bit lanes) widened to fp32: exact, a bf16 is the top half of an fp32.
inline __m256 load_bf16(const void* p) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 rounded to the nearest bf16 (ties to even, as c10::BFloat16 rounds finite values), still
// as fp32 lanes: the low 16 bits are zero.
inline __m256 round_bf16_ps(__m256 x) {
  const __m256i i = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(i, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 8 fp32 values stored as bf16, rounded as round_bf16_ps (the pack works per 128-bit half, so
// the halves' low quadwords are gathered into the first 128 bits).
inline void store_bf16(void* p, __m256 x) {
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps(x)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// 8 elements of an fp32 or bf16 row as fp32, and stored back (bf16 rounded once, as torch
// rounds): the kernels' arithmetic is fp32 whatever the tensors' dtype.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  else return load_bf16(p);
}

template <typename T>
inline void store8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) _mm256_storeu_ps(p, v);
  else store_bf16(p, v);
}

// Pins a value to a register from here on. GCC otherwise folds a vector used by several FMAs
// back into each of them as a memory operand (one load per FMA), and AVX2 cores load two
// 32-byte vectors a cycle: the prefill tiles' inner loops ran at ~30% of the FMA peak that way.
inline void keep_in_register(__m256& v) { asm("" : "+x"(v)); }

// The horizontal sums of 8 vectors as one vector: lane j holds the sum of v[j].
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [sums of 0-3 low | 0-3 high]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes [0, n) of all-ones, the rest zero: a blend/and mask for a partial tile (0 <= n <= 8).
inline __m256 first_lanes(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
}

// Transposes an 8x8 fp32 tile held as 8 row vectors, in place.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

}  // namespace kvmesh_avx2
#endif
