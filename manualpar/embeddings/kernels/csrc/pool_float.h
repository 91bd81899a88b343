// Pooled lookups of float rows in AVX-512 registers (table_batch.cpp's pool_tables): each bag's
// sum kept in registers across its ids, 64 columns at a time, from +0 in id order (the portable
// loop's bits), and written or added once. The portable loop sums into a buffer in memory (SSE
// at best): a rank's lookup of 4 tables of 1M x 64 rows (2 x 1024 bags of 20 ids each) took
// 0.71-0.77x its time.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "avx512_rows.h"
#include "prefetch.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define MANUALPAR_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

namespace pool_float {

// Bag [first, stop)'s sum over columns [c0, c0 + 16 V) into `d` (the last vector `last` lanes
// wide): assigned, or added to what `d` holds. Rows `ahead` ids on (below `limit`) are asked
// for as each id is read (all their lines, in the first column block only).
template <int V>
MANUALPAR_AVX512 inline void bag_block(const float* w, int64_t stride, int64_t row_bytes,
                                       int64_t c0, __mmask16 last, const int64_t* id,
                                       int64_t first, int64_t stop, int64_t ahead, int64_t limit,
                                       float* d, bool assign) {
  __m512 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t k = first; k < stop; ++k) {
    if (c0 == 0 && k + ahead < limit) {
      const char* far = reinterpret_cast<const char*>(w + id[k + ahead] * stride);
      for (int64_t offset = 0; offset < row_bytes; offset += kCacheLine) {
        _mm_prefetch(far + offset, _MM_HINT_T0);
      }
    }
    const float* row = w + id[k] * stride + c0;
    for (int v = 0; v < V; ++v) {
      const __mmask16 m = v == V - 1 ? last : __mmask16(0xFFFF);
      acc[v] = _mm512_add_ps(acc[v], _mm512_maskz_loadu_ps(m, row + 16 * v));
    }
  }
  float* out = d + c0;
  for (int v = 0; v < V; ++v) {
    const __mmask16 m = v == V - 1 ? last : __mmask16(0xFFFF);
    // acc is never -0 (it starts at +0), so assigning it is assigning 0 + the sum
    const __m512 x = assign ? acc[v] : _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + 16 * v), acc[v]);
    _mm512_mask_storeu_ps(out + 16 * v, m, x);
  }
}

// Bags [begin, end) (bag b: ids [start[b], start[b + 1])) of rows `cols` wide, bag b's sum to
// dst + (b - begin) * dst_stride. `limit`: the end of the ids prefetched ahead.
MANUALPAR_AVX512 inline void bags(const float* w, int64_t stride, int64_t cols, const int64_t* id,
                                  const int64_t* start, int64_t begin, int64_t end,
                                  int64_t ahead, int64_t limit, float* dst, int64_t dst_stride,
                                  bool assign) {
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(float));
  for (int64_t k = start[begin]; k < std::min(limit, start[begin] + ahead); ++k) {
    prefetch_row_to_read(w + id[k] * stride, cols);
  }
  for (int64_t b = begin; b < end; ++b) {
    float* d = dst + (b - begin) * dst_stride;
    const int64_t first = start[b], stop = start[b + 1];
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      const int64_t width = std::min<int64_t>(64, cols - c0);
      const int64_t vectors = (width + 15) / 16;
      const __mmask16 last = first_lanes(width - 16 * (vectors - 1));
      switch (vectors) {
        case 1:
          bag_block<1>(w, stride, row_bytes, c0, last, id, first, stop, ahead, limit, d, assign);
          break;
        case 2:
          bag_block<2>(w, stride, row_bytes, c0, last, id, first, stop, ahead, limit, d, assign);
          break;
        case 3:
          bag_block<3>(w, stride, row_bytes, c0, last, id, first, stop, ahead, limit, d, assign);
          break;
        default:
          bag_block<4>(w, stride, row_bytes, c0, last, id, first, stop, ahead, limit, d, assign);
      }
    }
  }
}

}  // namespace pool_float

#undef MANUALPAR_AVX512
#endif
