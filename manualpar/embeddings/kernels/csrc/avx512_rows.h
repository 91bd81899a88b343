// AVX-512 loops of the kernels (sparse_rows.cpp, rowwise_row.h, so table_batch.cpp too), and
// the vector level they run at. The library is built without -mavx512*: each loop carries its
// own target attribute and runs only where the CPU has the instructions (chosen at run time), so
// one build loads on every x86-64 CPU. Every loop does the portable loop's single operations in
// its order, a multiply then an add (no fused multiply-add, as -ffp-contract=off keeps the
// portable loops): the same bits at every level (tests/unit/test_emb_kernels_simd.py). Masked
// loads and stores take a row's last partial vector, so rows of any width stay in registers.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "prefetch.h"

// The widest vector loops this CPU runs: 2 AVX-512 (F, DQ, BW, VL), 1 AVX2 with F16C, 0 the
// portable loops. set_simd_level lowers it (simd_limit): the tests compare every level's bits,
// and a benchmark can time an AVX2-only host's path on an AVX-512 one.
inline int detected_simd_level() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    return 2;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return 1;
#endif
  return 0;
}

inline int simd_limit = 2;  // one variable for every file that includes this one
// read once, as the library loads: simd_level() is then two loads, inlined where it is asked
// (a function-local static cost a guarded call per row, 6% of a bfloat16 update)
inline const int simd_detected = detected_simd_level();

inline int simd_level() { return std::min(simd_detected, simd_limit); }

#if defined(__x86_64__) && defined(__GNUC__)
#define MANUALPAR_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

namespace {

// The lanes [0, n) of a 16-lane vector (n <= 16).
MANUALPAR_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;  // splitmix64's counter step

// splitmix64 (splitmix.h) in eight lanes after its first step, z = key + counter * kGolden
// (mod 2^64): where the counters are consecutive, z is a multiple of kGolden added to the last
// z, and one 64-bit vector multiply of three is saved, with the same bits.
MANUALPAR_AVX512 inline __m512i splitmix16_from(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ULL)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBULL)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// splitmix64 of (key, counter) in eight lanes: 64-bit multiplies in vectors.
MANUALPAR_AVX512 inline __m512i splitmix16(__m512i key, __m512i counter) {
  return splitmix16_from(_mm512_add_epi64(
      key, _mm512_mullo_epi64(counter, _mm512_set1_epi64(static_cast<int64_t>(kGolden)))));
}

// z = key + (counter + l) * kGolden in lane l (mod 2^64): splitmix16_from's input for eight
// consecutive counters, one scalar multiply.
MANUALPAR_AVX512 inline __m512i splitmix16_start(uint64_t key, uint64_t counter) {
  const __m512i lanes = _mm512_set_epi64(
      static_cast<int64_t>(7 * kGolden), static_cast<int64_t>(6 * kGolden),
      static_cast<int64_t>(5 * kGolden), static_cast<int64_t>(4 * kGolden),
      static_cast<int64_t>(3 * kGolden), static_cast<int64_t>(2 * kGolden),
      static_cast<int64_t>(kGolden), 0);
  return _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(key + counter * kGolden)),
                          lanes);
}

// The sum of g[0..n)^2 in double in sum_squares_lanes' 8 lanes (rowwise_row.h), all 8 in one
// vector: lane l takes elements l, l + 8, ..., a tail goes to lane 0, lanes added in order.
MANUALPAR_AVX512 inline double sum_squares_avx512(const float* g, int64_t n) {
  __m512d lanes = _mm512_setzero_pd();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(g + c));
    lanes = _mm512_add_pd(lanes, _mm512_mul_pd(x, x));
  }
  alignas(64) double out[8];
  _mm512_store_pd(out, lanes);
  for (; c < n; ++c) out[0] += static_cast<double>(g[c]) * g[c];
  double squares = 0;
  for (const double lane : out) squares += lane;
  return squares;
}

// w[c] = w[c] - a * src[c], the whole row (the float row update).
MANUALPAR_AVX512 inline void sub_scaled_avx512(float* w, const float* src, float a, int64_t n) {
  const __m512 alpha = _mm512_set1_ps(a);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = first_lanes(n - c);
    const __m512 x = _mm512_mul_ps(alpha, _mm512_maskz_loadu_ps(m, src + c));
    _mm512_mask_storeu_ps(w + c, m, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, w + c), x));
  }
}

// acc[c] = acc[c] + a * src[c], the whole row (a repeated row's gradient summed over its bags).
MANUALPAR_AVX512 inline void add_scaled_avx512(float* acc, const float* src, float a, int64_t n) {
  const __m512 alpha = _mm512_set1_ps(a);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = first_lanes(n - c);
    const __m512 x = _mm512_mul_ps(alpha, _mm512_maskz_loadu_ps(m, src + c));
    _mm512_mask_storeu_ps(acc + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + c), x));
  }
}

// Row-wise Adagrad on one float row (the same operations as rowwise_row.h's
// rowwise_adagrad_row_from).
MANUALPAR_AVX512 inline void rowwise_adagrad_row_avx512(float* w, float* sum, const float* g,
                                                        float g_scale, int64_t full,
                                                        int64_t col_start, int64_t cols, float lr,
                                                        float eps) {
  const double squares = sum_squares_avx512(g, full);
  const double scaled = static_cast<double>(g_scale);
  const float total =
      *sum + static_cast<float>(squares * scaled * scaled / static_cast<double>(full));
  *sum = total;
  const float step = lr * g_scale / (std::sqrt(total) + eps);
  sub_scaled_avx512(w, g + col_start, step, cols);
}

// rowwise_adagrad_row_avx512's state update and step for eight distinct float rows at once
// (n of them real; the other lanes repeat row 0 and are not stored), row r's arithmetic the
// same operations in the same order, so the same bits: the sums of squares of eight rows in
// eight independent chains, then their lanes added in order (as vectors across the rows), and
// the state and step of all eight in vector lanes. One row at a time, each row's chain of
// dependent adds, divides and square root left the core idle (an update a row took 27 ns in
// cache). `full`: a multiple of 8 (sum_squares_lanes' tail is not done here).
MANUALPAR_AVX512 inline void rowwise_steps8_avx512(const float* const* g, const float* g_scale,
                                                   const int64_t* row, int n, int64_t full,
                                                   float* sum, float lr, float eps,
                                                   float* step) {
  const float* src[8];
  __m512d acc[8];
  alignas(32) float scale[8], before[8];
  for (int r = 0; r < 8; ++r) {
    const int real = r < n ? r : 0;
    src[r] = g[real];
    scale[r] = g_scale[real];
    before[r] = sum[row[real]];
    acc[r] = _mm512_setzero_pd();
  }
  for (int64_t c = 0; c < full; c += 8) {
    for (int r = 0; r < 8; ++r) {
      const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(src[r] + c));
      acc[r] = _mm512_add_pd(acc[r], _mm512_mul_pd(x, x));
    }
  }
  alignas(64) double lanes[8][8];
  for (int r = 0; r < 8; ++r) _mm512_store_pd(lanes[r], acc[r]);
  // lane r of `squares`: row r's lanes 0 + 1 + ... + 7, from 0, in order
  const __m512i across = _mm512_set_epi64(56, 48, 40, 32, 24, 16, 8, 0);
  __m512d squares = _mm512_setzero_pd();
  for (int l = 0; l < 8; ++l) {
    squares = _mm512_add_pd(squares, _mm512_i64gather_pd(across, &lanes[0][l], 8));
  }
  const __m256 scales = _mm256_load_ps(scale);
  const __m512d scaled = _mm512_cvtps_pd(scales);
  const __m512d mean = _mm512_div_pd(_mm512_mul_pd(_mm512_mul_pd(squares, scaled), scaled),
                                     _mm512_set1_pd(static_cast<double>(full)));
  const __m256 total = _mm256_add_ps(_mm256_load_ps(before), _mm512_cvtpd_ps(mean));
  const __m256 steps = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(lr), scales),
                                     _mm256_add_ps(_mm256_sqrt_ps(total), _mm256_set1_ps(eps)));
  alignas(32) float totals[8];
  _mm256_store_ps(totals, total);
  _mm256_storeu_ps(step, steps);
  for (int r = 0; r < n; ++r) sum[row[r]] = totals[r];
}

// Sixteen half values widened to float32 (exact); `m`: the lanes to load (the others are 0).
MANUALPAR_AVX512 inline __m512 widen16(const at::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

MANUALPAR_AVX512 inline __m512 widen16(const at::Half* p, __mmask16 m = 0xFFFF) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

MANUALPAR_AVX512 inline __m512 widen16(const float* p, __mmask16 m = 0xFFFF) {
  return _mm512_maskz_loadu_ps(m, p);
}

// round_value's 16 random bits of elements index .. index + 15 (sparse_rows.cpp): the 16-bit
// words of the hashes of index / 4 .. index / 4 + 7 (8 lanes; 4 or 5 of them used), in order.
MANUALPAR_AVX512 inline __m512i noise16(uint64_t key, uint64_t index) {
  alignas(64) static constexpr uint16_t kWords[32] = {0,  1,  2,  3,  4,  5,  6,  7,
                                                      8,  9,  10, 11, 12, 13, 14, 15,
                                                      16, 17, 18, 19, 20, 21, 22, 23,
                                                      24, 25, 26, 27, 28, 29, 30, 31};
  const __m512i pick = _mm512_add_epi16(_mm512_load_si512(kWords),
                                        _mm512_set1_epi16(static_cast<int16_t>(index & 3)));
  const __m512i words =
      _mm512_permutexvar_epi16(pick, splitmix16_from(splitmix16_start(key, index >> 2)));
  return _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
}

// v (float32) rounded to bfloat16 with 16 random bits `noise` added below the kept bits: the
// high 16 bits of each sum.
MANUALPAR_AVX512 inline __m256i round_bf16(__m512 v, __m512i noise) {
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(v), noise);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// round_bf16 of 32 elements at once (`first`: 0..15, `second`: 16..31), the high 16 bits of
// each sum picked from both vectors by one word permute, in order: two shifts and two
// narrowing moves fewer per 32 elements.
MANUALPAR_AVX512 inline __m512i round_bf16x32(__m512 first, __m512i low, __m512 second,
                                              __m512i high) {
  alignas(64) static constexpr uint16_t kHighWords[32] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i a = _mm512_add_epi32(_mm512_castps_si512(first), low);
  const __m512i b = _mm512_add_epi32(_mm512_castps_si512(second), high);
  return _mm512_permutex2var_epi16(a, _mm512_load_si512(kHighWords), b);
}

// w[c] = round(w[c] + a * src[c]): float16 to nearest, bfloat16 stochastically (key, base as in
// round_value: the element's counter is base + c). Each returns how many leading elements it did
// (a multiple of 16); the caller's portable loop does the rest.
MANUALPAR_AVX512 inline int64_t axpy_round_avx512(at::Half* w, const float* src, float a,
                                                  int64_t n, uint64_t, uint64_t) {
  const __m512 alpha = _mm512_set1_ps(a);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 v =
        _mm512_add_ps(widen16(w + c), _mm512_mul_ps(alpha, _mm512_loadu_ps(src + c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + c),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return c;
}

// bfloat16: where the counters start at a multiple of 4 (a row of a table whose width is one),
// one vector of 8 hashes gives the bits of 32 elements in order; elsewhere 16 at a time.
// Hashing twice the groups needed was a third of the update's arithmetic.
MANUALPAR_AVX512 inline int64_t axpy_round_avx512(at::BFloat16* w, const float* src, float a,
                                                  int64_t n, uint64_t key, uint64_t base) {
  const __m512 alpha = _mm512_set1_ps(a);
  int64_t c = 0;
  if ((base & 3) == 0) {
    // the hashes of groups base / 4 + 8k .. + 8k + 7 for the k-th 32 elements
    __m512i z = splitmix16_start(key, base >> 2);
    const __m512i next = _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden));
    for (; c + 32 <= n; c += 32, z = _mm512_add_epi64(z, next)) {
      const __m512i hashes = splitmix16_from(z);
      const __m512i low = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(hashes));
      const __m512i high = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hashes, 1));
      const __m512 first =
          _mm512_add_ps(widen16(w + c), _mm512_mul_ps(alpha, _mm512_loadu_ps(src + c)));
      const __m512 second = _mm512_add_ps(widen16(w + c + 16),
                                          _mm512_mul_ps(alpha, _mm512_loadu_ps(src + c + 16)));
      _mm512_storeu_si512(w + c, round_bf16x32(first, low, second, high));
    }
  }
  for (; c + 16 <= n; c += 16) {
    const __m512 v =
        _mm512_add_ps(widen16(w + c), _mm512_mul_ps(alpha, _mm512_loadu_ps(src + c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + c),
                        round_bf16(v, noise16(key, base + static_cast<uint64_t>(c))));
  }
  return c;
}

// acc[c] += row[c] (or scale * row[c] when `scaled`), sixteen at a time; returns the elements
// done (a multiple of 16).
template <typename weight_t>
MANUALPAR_AVX512 inline int64_t accumulate_avx512(const weight_t* row, float* acc, int64_t n,
                                                  float scale, bool scaled) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m512 x = widen16(row + c);
    if (scaled) x = _mm512_mul_ps(s, x);
    _mm512_storeu_ps(acc + c, _mm512_add_ps(_mm512_loadu_ps(acc + c), x));
  }
  return c;
}

// One bag's sum over columns [c0, c0 + 16 * V) (the last vector `last` lanes wide), kept in V
// registers across the bag's ids and stored once: adding into the output row in memory made
// each id wait on the previous id's store. Starts from +0 and adds in id order, as the portable
// loop does into a zeroed row. Ids kPrefetchLookup ahead are prefetched (every line, first
// block).
template <int V, typename weight_t>
MANUALPAR_AVX512 inline void pool_block_avx512(const weight_t* w, int64_t cols, int64_t c0,
                                               __mmask16 last, const int64_t* id, int64_t first,
                                               int64_t end, int64_t n, const float* per_id,
                                               float* out) {
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(weight_t));
  __m512 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t k = first; k < end; ++k) {
    if (c0 == 0 && k + kPrefetchLookup < n) {
      const char* ahead = reinterpret_cast<const char*>(w + id[k + kPrefetchLookup] * cols);
      for (int64_t offset = 0; offset < row_bytes; offset += kCacheLine) {
        _mm_prefetch(ahead + offset, _MM_HINT_T0);
      }
    }
    const weight_t* row = w + id[k] * cols + c0;
    if (per_id != nullptr) {
      const __m512 s = _mm512_set1_ps(per_id[k]);
      for (int v = 0; v < V; ++v) {
        const __m512 x = widen16(row + 16 * v, v == V - 1 ? last : __mmask16(0xFFFF));
        acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(s, x));
      }
    } else {
      for (int v = 0; v < V; ++v) {
        const __m512 x = widen16(row + 16 * v, v == V - 1 ? last : __mmask16(0xFFFF));
        acc[v] = _mm512_add_ps(acc[v], x);
      }
    }
  }
  for (int v = 0; v < V - 1; ++v) _mm512_storeu_ps(out + c0 + 16 * v, acc[v]);
  _mm512_mask_storeu_ps(out + c0 + 16 * (V - 1), last, acc[V - 1]);
}

// Bags [begin, end) summed into out (bags x cols, every element written), 64 columns at a
// time in registers; `start[b]`: bag b's first id.
template <typename weight_t>
MANUALPAR_AVX512 void pool_bags_avx512(const weight_t* w, int64_t cols, const int64_t* id,
                                       const int64_t* start, int64_t n, const float* per_id,
                                       float* out, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    float* row_out = out + b * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      const int64_t width = std::min<int64_t>(64, cols - c0);
      const int64_t vectors = (width + 15) / 16;
      const __mmask16 last = first_lanes(width - 16 * (vectors - 1));
      const int64_t first = start[b], stop = start[b + 1];
      switch (vectors) {
        case 1:
          pool_block_avx512<1>(w, cols, c0, last, id, first, stop, n, per_id, row_out);
          break;
        case 2:
          pool_block_avx512<2>(w, cols, c0, last, id, first, stop, n, per_id, row_out);
          break;
        case 3:
          pool_block_avx512<3>(w, cols, c0, last, id, first, stop, n, per_id, row_out);
          break;
        default:
          pool_block_avx512<4>(w, cols, c0, last, id, first, stop, n, per_id, row_out);
      }
    }
  }
}

}  // namespace
#undef MANUALPAR_AVX512
#endif
