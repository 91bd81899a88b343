// Half-precision rows (float16, bfloat16): the conversions and the rounding of float32 results
// back into half rows that the half-row kernels share (half_rows.cpp's updates, pooled_rows.cpp's
// lookups).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "avx2_rows.h"
#include "avx512_rows.h"
#include "splitmix.h"

// Half-precision rows (float16, bfloat16): lookups sum in float32 and updates compute in float32,
// then round back to the rows' dtype, to nearest or (bfloat16 by default) stochastically: 16
// random bits, from a splitmix64 hash of (key, global index / 4), the global index being
// row * dim + column, are added below the kept bits before truncation, as FBGEMM does. One hash
// serves 4 elements (a 16-bit word each): hashing was most of a bfloat16 update's extra cost.
// The bits do not depend on the plan, and the torch path (rounding.py) gives the same ones.
namespace {

struct Rounding {
  bool stochastic = false;
  uint64_t key = 0;
  int64_t row_start = 0, col_start = 0, dim = 0;
  // the block row each row of the tensor holds (a disk tier's cache slots), or none: the same
  const int64_t* row_of = nullptr;
  int64_t table_row(int64_t row) const { return row_start + (row_of ? row_of[row] : row); }
};

// A Rounding for a tensor whose rows hold the block rows `row_of` (if given, one per row).
Rounding make_rounding(bool stochastic, int64_t key, int64_t row_start, int64_t col_start,
                       int64_t dim, const c10::optional<torch::Tensor>& row_of,
                       int64_t tensor_rows) {
  Rounding r{stochastic, static_cast<uint64_t>(key), row_start, col_start, dim};
  if (row_of) {
    TORCH_CHECK(row_of->device().is_cpu() && row_of->is_contiguous() &&
                    row_of->scalar_type() == torch::kLong && row_of->numel() == tensor_rows,
                "row_of must be a contiguous CPU int64 tensor with one entry per row");
    r.row_of = row_of->data_ptr<int64_t>();
  }
  return r;
}

template <typename weight_t>
inline weight_t round_value(float x, const Rounding& r, int64_t row, int64_t col) {
  if constexpr (std::is_same_v<weight_t, at::BFloat16>) {
    if (r.stochastic) {
      // one hash per 4 elements: element i takes 16-bit word i % 4 of the hash of i / 4
      const uint64_t index = static_cast<uint64_t>(r.table_row(row) * r.dim + r.col_start + col);
      const uint32_t noise =
          static_cast<uint32_t>(splitmix(r.key, index >> 2) >> (16 * (index & 3))) & 0xFFFFu;
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      bits = (bits + noise) & 0xFFFF0000u;
      float kept;
      std::memcpy(&kept, &bits, sizeof kept);
      return weight_t(kept);  // exact: the low 16 bits are zero
    }
  }
  return static_cast<weight_t>(x);  // round to nearest even, as torch's .to()
}

#if defined(__x86_64__) && defined(__GNUC__)
// float16 <-> float32 eight at a time where the CPU has F16C (chosen at run time, as the AVX
// sums above): the portable conversion is a bit-by-bit routine, about 5x slower per step of a
// float16 table. Both are IEEE conversions (exact one way, to nearest even the other).
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const at::Half* src, float* dst,
                                                             int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
    _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(packed));
  }
  for (; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, at::Half* dst,
                                                             int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m128i packed =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c), packed);
  }
  for (; c < n; ++c) dst[c] = static_cast<at::Half>(src[c]);
}

inline bool has_f16c() {
  static const bool found = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return found;
}
#endif

// A half row widened to float32.
template <typename weight_t>
inline void load_row(const weight_t* __restrict__ src, float* __restrict__ dst, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<weight_t, at::Half>) {
    if (has_f16c()) return half_to_float_f16c(src, dst, n);
  }
#endif
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}

// float32 results rounded into a half row (`row`: the local row, for the stochastic bits).
template <typename weight_t>
inline void store_row(const float* __restrict__ src, weight_t* __restrict__ dst, int64_t n,
                      const Rounding& r, int64_t row) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<weight_t, at::Half>) {
    if (has_f16c()) return float_to_half_f16c(src, dst, n);
  }
#endif
  for (int64_t c = 0; c < n; ++c) dst[c] = round_value<weight_t>(src[c], r, row, c);
}

// A float32 scratch row per thread (the kernels' rows are at most a few thousand wide).
inline float* scratch_row(int64_t cols) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < cols) buffer.resize(cols);
  return buffer.data();
}

// acc += row (times scale if `scaled`), in float32.
template <typename weight_t>
inline void accumulate_row(const weight_t* __restrict__ row, float* __restrict__ acc, int64_t n,
                           float scale, bool scaled) {
  int64_t c = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (simd_level() == 2) c = accumulate_avx512(row, acc, n, scale, scaled);
  if (simd_level() == 1) c = accumulate_avx2(row, acc, n, scale, scaled);
#endif
  if (c == n) return;
  float* __restrict__ widened = scratch_row(n);
  load_row(row + c, widened, n - c);
  if (scaled) {
    for (int64_t k = 0; k < n - c; ++k) acc[c + k] += scale * widened[k];
  } else {
    for (int64_t k = 0; k < n - c; ++k) acc[c + k] += widened[k];
  }
}

// w = round(w + a * src) on one half row (local `row`, for the stochastic bits).
template <typename weight_t>
inline void axpy_round_row(weight_t* __restrict__ w, const float* __restrict__ src, float a,
                           int64_t n, const Rounding& r, int64_t row) {
  int64_t c = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  const bool draws = std::is_same_v<weight_t, at::BFloat16> && r.stochastic;
  if (simd_level() > 0 && (draws || std::is_same_v<weight_t, at::Half>)) {
    const uint64_t base = static_cast<uint64_t>(r.table_row(row) * r.dim + r.col_start);
    c = simd_level() == 2 ? axpy_round_avx512(w, src, a, n, r.key, base)
                          : axpy_round_avx2(w, src, a, n, r.key, base);
  }
#endif
  if (c == n) return;
  float* __restrict__ values = scratch_row(n);
  load_row(w + c, values, n - c);
  for (int64_t k = 0; k < n - c; ++k) values[k] = values[k] + a * src[c + k];
  // store_row counts columns from its first element: shift the block's start by c
  Rounding shifted = r;
  shifted.col_start += c;
  store_row(values, w + c, n - c, shifted, row);
}

}  // namespace
