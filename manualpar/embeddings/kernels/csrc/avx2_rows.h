// AVX2 versions of the AVX-512 loops (avx512_rows.h) (half-row lookups and updates, initial
// values), for the many CPUs that have AVX2 and F16C but not AVX-512: there the kernels took the
// portable loops (a bfloat16 step measured 0.90x TorchRec's fp32 step on such a host against
// 0.78x where AVX-512 ran). Eight floats at a time; the same single operations in the same order
// as the portable loops, so the same bits (tested at every level a CPU has, set_simd_level).
// AVX2 has no 64-bit multiply in vectors: splitmix64's are built from three 32-bit ones, exact
// modulo 2**64. Included by the half-row, lookup and init files, which fall back to their portable
// loops for what these leave (each returns how many leading elements it did).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "prefetch.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define MANUALPAR_AVX2 __attribute__((target("avx2,f16c")))

namespace {

// a * b modulo 2**64 in each of four lanes
MANUALPAR_AVX2 inline __m256i mullo64_avx2(__m256i a, __m256i b) {
  const __m256i low = _mm256_mul_epu32(a, b);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                         _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
  return _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}

// splitmix(key, counter) (splitmix.h) in four lanes after its first step,
// z = key + counter * golden (mod 2^64): consecutive counters' z differ by multiples of golden
MANUALPAR_AVX2 inline __m256i splitmix4_from(__m256i z) {
  z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)),
                   _mm256_set1_epi64x(static_cast<int64_t>(0xBF58476D1CE4E5B9ULL)));
  z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)),
                   _mm256_set1_epi64x(static_cast<int64_t>(0x94D049BB133111EBULL)));
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// splitmix(key, counter) in four lanes
MANUALPAR_AVX2 inline __m256i splitmix4(__m256i key, __m256i counter) {
  return splitmix4_from(_mm256_add_epi64(
      key, mullo64_avx2(counter, _mm256_set1_epi64x(static_cast<int64_t>(0x9E3779B97F4A7C15ULL)))));
}

// the low 32 bits of four 64-bit lanes
MANUALPAR_AVX2 inline __m128i low_words_avx2(__m256i x) {
  return _mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
}

// uniform_row (sparse_rows.cpp) for float rows, eight values a step; returns the values done
MANUALPAR_AVX2 int64_t uniform_row_avx2(float* row, int64_t cols, uint64_t key, uint64_t base,
                                        float width, float bound) {
  const __m256i keys = _mm256_set1_epi64x(static_cast<int64_t>(key));
  const __m256i lanes = _mm256_setr_epi64x(0, 1, 2, 3);
  const __m256 unit = _mm256_set1_ps(0x1.0p-24f), widths = _mm256_set1_ps(width),
               bounds = _mm256_set1_ps(bound);
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    const __m256i first =
        _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(base + j)), lanes);
    const __m256i second = _mm256_add_epi64(first, _mm256_set1_epi64x(4));
    // top 24 bits: below 2^24, so exact through int32 and float
    const __m128i low = low_words_avx2(_mm256_srli_epi64(splitmix4(keys, first), 40));
    const __m128i high = low_words_avx2(_mm256_srli_epi64(splitmix4(keys, second), 40));
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_set_m128i(high, low)), unit);
    _mm256_storeu_ps(row + j, _mm256_sub_ps(_mm256_mul_ps(u, widths), bounds));
  }
  return j;
}

MANUALPAR_AVX2 inline __m256 widen8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

MANUALPAR_AVX2 inline __m256 widen8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc[c] += row[c] (or scale * row[c] when `scaled`); returns the leading elements done
template <typename weight_t>
MANUALPAR_AVX2 int64_t accumulate_avx2(const weight_t* row, float* acc, int64_t n, float scale,
                                       bool scaled) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    __m256 x = widen8(row + c);
    if (scaled) x = _mm256_mul_ps(s, x);
    _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c), x));
  }
  return c;
}

// w[c] = round(w[c] + a * src[c]) to nearest (float16)
MANUALPAR_AVX2 int64_t axpy_round_avx2(at::Half* w, const float* src, float a, int64_t n,
                                       uint64_t, uint64_t) {
  const __m256 alpha = _mm256_set1_ps(a);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 v =
        _mm256_add_ps(widen8(w + c), _mm256_mul_ps(alpha, _mm256_loadu_ps(src + c)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w + c),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return c;
}

// ... stochastically (bfloat16): element base + c takes 16-bit word (base + c) % 4 of the hash of
// (base + c) / 4, as round_value; sixteen elements a step share the hashes of 8 groups
MANUALPAR_AVX2 int64_t axpy_round_avx2(at::BFloat16* w, const float* src, float a, int64_t n,
                                       uint64_t key, uint64_t base) {
  constexpr uint64_t golden = 0x9E3779B97F4A7C15ULL;
  const __m256 alpha = _mm256_set1_ps(a);
  const __m256i lanes = _mm256_setr_epi64x(0, static_cast<int64_t>(golden),
                                           static_cast<int64_t>(2 * golden),
                                           static_cast<int64_t>(3 * golden));
  const __m256i four = _mm256_set1_epi64x(static_cast<int64_t>(4 * golden));
  const __m256i kept = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  alignas(32) uint64_t hashes[8];
  const auto* words = reinterpret_cast<const uint16_t*>(hashes);  // little-endian: word k of 4
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const uint64_t index = base + static_cast<uint64_t>(c);
    // z of groups index / 4 .. + 7: one scalar multiply, not a vector one per hash
    const __m256i z = _mm256_add_epi64(
        _mm256_set1_epi64x(static_cast<int64_t>(key + (index >> 2) * golden)), lanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(hashes), splitmix4_from(z));
    _mm256_store_si256(reinterpret_cast<__m256i*>(hashes + 4),
                       splitmix4_from(_mm256_add_epi64(z, four)));
    const uint16_t* noise = words + (index & 3);
    for (int half = 0; half < 2; ++half) {
      const int64_t at = c + 8 * half;
      const __m256 v =
          _mm256_add_ps(widen8(w + at), _mm256_mul_ps(alpha, _mm256_loadu_ps(src + at)));
      const __m256i draws =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(noise + 8 * half)));
      const __m256i bits =
          _mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(v), draws), kept);
      // the high halves, packed to 16 bits (packus orders by 128-bit lane: fix with a permute)
      const __m256i shifted = _mm256_srli_epi32(bits, 16);
      const __m256i packed = _mm256_permute4x64_epi64(
          _mm256_packus_epi32(shifted, shifted), _MM_SHUFFLE(3, 1, 2, 0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + at), _mm256_castsi256_si128(packed));
    }
  }
  return c;
}

// pool_bags_avx512 eight columns at a time
template <typename weight_t>
MANUALPAR_AVX2 void pool_bags_avx2(const weight_t* w, int64_t cols, const int64_t* id,
                                   const int64_t* start, int64_t n, const float* per_id,
                                   float* out, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    float* acc = out + b * cols;
    for (int64_t k = start[b]; k < start[b + 1]; ++k) {
      if (k + kPrefetchFar < n) prefetch_row_to_read(w + id[k + kPrefetchFar] * cols, cols);
      const weight_t* row = w + id[k] * cols;
      const bool scaled = per_id != nullptr;
      const float scale = scaled ? per_id[k] : 1.0f;
      const int64_t c = accumulate_avx2(row, acc, cols, scale, scaled);
      for (int64_t r = c; r < cols; ++r) {
        const float x = static_cast<float>(row[r]);
        acc[r] += scaled ? scale * x : x;
      }
    }
  }
}
}  // namespace
#undef MANUALPAR_AVX2
#endif
