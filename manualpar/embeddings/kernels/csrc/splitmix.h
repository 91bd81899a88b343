// splitmix64's finalizer over key + counter * golden: the hash behind initial table values
// (table_init.cpp) and bfloat16's stochastic rounding (half_rows.h), and the vector versions'
// reference (avx512_rows.h's splitmix16, avx2_rows.h's splitmix4).
#pragma once

#include <cstdint>

inline uint64_t splitmix(uint64_t key, uint64_t counter) {
  uint64_t z = key + counter * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
