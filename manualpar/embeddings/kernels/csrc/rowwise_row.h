// The row-wise Adagrad update of one row and the sum of squares it takes, shared by the
// one-table kernels (sparse_rows.cpp) and the table-batched ones (table_batch.cpp): both must
// give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "avx512_rows.h"

namespace {

// The sum of g[0..n)^2 in double (the row-wise state is a running sum: its rounding compounds),
// in 8 independent lanes (lane l takes elements l, l + 8, ...; a tail goes to lane 0), added up
// in lane order at the end. Every version below adds in exactly this order, so they agree to the
// bit (squares of floats are exact in double).
template <typename scalar_t>
double sum_squares_lanes(const scalar_t* g, int64_t n) {
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(g[c + l]) * g[c + l];
  }
  for (; c < n; ++c) lanes[0] += static_cast<double>(g[c]) * g[c];
  double squares = 0;
  for (const double lane : lanes) squares += lane;
  return squares;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same lanes four doubles at a time, for CPUs with AVX (chosen at run time: the library is
// built without -mavx so it loads everywhere). About a third of the fused update's time on a
// 1M-row table went to this reduction done two doubles at a time.
__attribute__((target("avx"))) double sum_squares_avx(const float* g, int64_t n) {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(g + c));
    const __m256d b = _mm256_cvtps_pd(_mm_loadu_ps(g + c + 4));
    low = _mm256_add_pd(low, _mm256_mul_pd(a, a));
    high = _mm256_add_pd(high, _mm256_mul_pd(b, b));
  }
  double lanes[8];
  _mm256_storeu_pd(lanes, low);
  _mm256_storeu_pd(lanes + 4, high);
  for (; c < n; ++c) lanes[0] += static_cast<double>(g[c]) * g[c];
  double squares = 0;
  for (const double lane : lanes) squares += lane;
  return squares;
}
#endif

template <typename scalar_t>
inline double sum_squares(const scalar_t* g, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    static const bool avx = __builtin_cpu_supports("avx");
    if (simd_level() == 2) return sum_squares_avx512(g, n);
    if (avx && simd_limit > 0) return sum_squares_avx(g, n);
  }
#endif
  return sum_squares_lanes(g, n);
}

// Row-wise Adagrad on one row from its gradient's sum of squares: split out so that the table
// batch's loop (table_batch_update.h) can take the sum from its inlined AVX version (a call per
// row to a dispatching one-row function cost about 5% of the update).
template <typename scalar_t>
inline void rowwise_adagrad_row_from(scalar_t* __restrict__ w, scalar_t* sum,
                                     const scalar_t* __restrict__ g, double squares,
                                     scalar_t g_scale, int64_t full, int64_t col_start,
                                     int64_t cols, scalar_t lr, scalar_t eps) {
  const double scaled = static_cast<double>(g_scale);
  const scalar_t total = *sum + static_cast<scalar_t>(squares * scaled * scaled /
                                                      static_cast<double>(full));
  *sum = total;
  const scalar_t step = lr * g_scale / (std::sqrt(total) + eps);
  const scalar_t* __restrict__ src = g + col_start;
  for (int64_t k = 0; k < cols; ++k) w[k] -= step * src[k];
}

// Row-wise Adagrad on n distinct rows at once (n <= 8; row i's gradient g[i] * g_scale[i], full
// width): each row's state updated in `sum` and `write(i, step)` called with its step, for the
// caller to apply w -= step * g[i][col_start..] its own way (float rows, rounded half rows).
// The same bits as rowwise_adagrad_row_from on each row in turn; at the AVX-512 level eight rows'
// arithmetic is interleaved (rowwise_steps8_avx512).
template <typename scalar_t, typename Write>
inline void rowwise_adagrad_rows(int n, const int64_t* row, const scalar_t* const* g,
                                 const scalar_t* g_scale, scalar_t* sum, int64_t full,
                                 scalar_t lr, scalar_t eps, Write write) {
  scalar_t steps[8];
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (simd_level() == 2 && full % 8 == 0 && n > 1) {
      rowwise_steps8_avx512(g, g_scale, row, n, full, sum, lr, eps, steps);
      for (int i = 0; i < n; ++i) write(i, steps[i]);
      return;
    }
  }
#endif
  for (int i = 0; i < n; ++i) {
    const double squares = sum_squares(g[i], full);
    const double scaled = static_cast<double>(g_scale[i]);
    const scalar_t total = sum[row[i]] + static_cast<scalar_t>(squares * scaled * scaled /
                                                               static_cast<double>(full));
    sum[row[i]] = total;
    write(i, lr * g_scale[i] / (std::sqrt(total) + eps));
  }
}

// w[k] -= step * src[k] for k < cols: rowwise_adagrad_row_from's write of a float row.
template <typename scalar_t>
inline void subtract_step(scalar_t* __restrict__ w, const scalar_t* __restrict__ src,
                          scalar_t step, int64_t cols) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (simd_level() == 2) return sub_scaled_avx512(w, src, step, cols);
  }
#endif
  for (int64_t k = 0; k < cols; ++k) w[k] -= step * src[k];
}

}  // namespace
