// Software prefetch of table rows, shared by the kernels of sparse_rows.cpp and avx2_rows.h.
#pragma once

#include <cstdint>

// Rows to be written are prefetched in two stages: far ahead into the outer caches (many misses
// in flight), then a few rows ahead into L1 (within its few miss buffers). Measured on a random
// row update: about 1.3x faster than one stage 8 rows ahead. Rows only read (lookups) are
// prefetched once, kPrefetchFar ids ahead, into L1, as FBGEMM's lookup does.
constexpr int64_t kPrefetchNear = 4;
constexpr int64_t kPrefetchFar = 16;
// The AVX-512 half-row lookup keeps more rows in flight: 48 ids ahead took a bfloat16 lookup of
// 40,960 ids over 1M rows from 0.52 to 0.31-0.39 ms (16: 0.52, 32: 0.36-0.43, 64 and 96 no
// better than 48); 32 or 48 ahead in the update measured no different from 16.
constexpr int64_t kPrefetchLookup = 48;
constexpr int64_t kCacheLine = 64;

// Ask for every cache line of a row that will be written soon; Locality 3: into L1, 1: outer.
template <int Locality, typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t cols) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < cols * static_cast<int64_t>(sizeof(scalar_t));
       offset += kCacheLine) {
    __builtin_prefetch(bytes + offset, 1, Locality);
  }
}

// Ask for every cache line of a row that will be read soon, into L1.
template <typename scalar_t>
inline void prefetch_row_to_read(const scalar_t* row, int64_t cols) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < cols * static_cast<int64_t>(sizeof(scalar_t));
       offset += kCacheLine) {
    __builtin_prefetch(bytes + offset, 0, 3);
  }
}
