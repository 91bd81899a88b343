// Initial table values (modules/table_init.py), written in place: every row generated from its
// global index alone, so any block of a table, on any rank or from the disk tier's cache, holds
// the values the whole table would.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "avx2_rows.h"
#include "avx512_rows.h"
#include "kernel_checks.h"
#include "splitmix.h"

namespace {

// Initial table values (see table_init.py): out[i][j] = bound * (2u - 1), u the top 24 bits of
// splitmix64's finalizer over key + counter * golden, counter = (row0 + i) * dim + col0 + j.
template <typename scalar_t>
void uniform_row(scalar_t* row, int64_t cols, uint64_t key, uint64_t base, float width,
                 float bound) {
  for (int64_t j = 0; j < cols; ++j) {
    const float u = static_cast<float>(splitmix(key, base + static_cast<uint64_t>(j)) >> 40) *
                    0x1.0p-24f;
    row[j] = static_cast<scalar_t>(u * width - bound);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same values sixteen at a time where the CPU has AVX-512 (64-bit multiplies in vectors):
// integer steps are exact and the float steps are the same single operations, so the bits agree.
// Initializing a table is mostly this hash and the first touch of its memory.
__attribute__((target("avx512f,avx512dq"))) void uniform_row_avx512(float* row, int64_t cols,
                                                                    uint64_t key, uint64_t base,
                                                                    float width, float bound) {
  const __m512i keys = _mm512_set1_epi64(static_cast<int64_t>(key));
  const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 unit = _mm512_set1_ps(0x1.0p-24f), widths = _mm512_set1_ps(width),
               bounds = _mm512_set1_ps(bound);
  int64_t j = 0;
  for (; j + 16 <= cols; j += 16) {
    const __m512i first = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(base + j)),
                                           lanes);
    const __m512i second = _mm512_add_epi64(first, _mm512_set1_epi64(8));
    // top 24 bits: below 2^24, so exact through int32 and float
    const __m256i low = _mm512_cvtepi64_epi32(_mm512_srli_epi64(splitmix16(keys, first), 40));
    const __m256i high = _mm512_cvtepi64_epi32(_mm512_srli_epi64(splitmix16(keys, second), 40));
    const __m512 u = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1)), unit);
    _mm512_storeu_ps(row + j, _mm512_sub_ps(_mm512_mul_ps(u, widths), bounds));
  }
  uniform_row(row + j, cols - j, key, base + static_cast<uint64_t>(j), width, bound);
}
#endif

template <typename scalar_t>
void uniform_row_fastest(scalar_t* row, int64_t cols, uint64_t key, uint64_t base, float width,
                         float bound) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (simd_level() == 2) return uniform_row_avx512(row, cols, key, base, width, bound);
    if (simd_level() == 1) {
      const int64_t done = uniform_row_avx2(row, cols, key, base, width, bound);
      return uniform_row(row + done, cols - done, key, base + static_cast<uint64_t>(done), width,
                         bound);
    }
  }
#endif
  uniform_row(row, cols, key, base, width, bound);
}

}  // namespace

void uniform_rows(torch::Tensor out, int64_t key, int64_t row0, int64_t col0, int64_t dim,
                  double bound) {
  check_cpu_contiguous(out, "out");
  const int64_t rows = out.size(0), cols = out.size(1);
  const float width = static_cast<float>(2 * bound), half = static_cast<float>(bound);
  // half rows: the float32 value rounded to nearest, as torch's copy_ does
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "uniform_rows", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    const uint64_t k = static_cast<uint64_t>(key);
    at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint64_t base = static_cast<uint64_t>((row0 + i) * dim + col0);
        uniform_row_fastest(data + i * cols, cols, k, base, width, half);
      }
    });
  });
}

// The same values for scattered table rows, written into rows `slots` of `out` (the disk
// tier's cache generating rows on first use).
void uniform_rows_at(torch::Tensor out, torch::Tensor slots, torch::Tensor rows, int64_t key,
                     int64_t col0, int64_t dim, double bound) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(slots, "slots");
  check_cpu_contiguous(rows, "rows");
  TORCH_CHECK(out.dim() == 2 && slots.scalar_type() == torch::kLong &&
                  rows.scalar_type() == torch::kLong && slots.numel() == rows.numel(),
              "uniform_rows_at: out (rows, cols), int64 slots and rows of one length");
  const int64_t n = rows.numel(), cols = out.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(slot[k] >= 0 && slot[k] < out.size(0), "uniform_rows_at: slot ", slot[k],
                " outside ", out.size(0), " rows");
  }
  const float width = static_cast<float>(2 * bound), half = static_cast<float>(bound);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "uniform_rows_at", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    const uint64_t k = static_cast<uint64_t>(key);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t base = static_cast<uint64_t>(row[i] * dim + col0);
      uniform_row_fastest(data + slot[i] * cols, cols, k, base, width, half);
    }
  });
}
