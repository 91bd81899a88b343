// Raw ids to rows in one pass, the same bits as the torch path (the GPU's), which costs a dozen
// eager ops per table for a hash and about a hundred per table and step for managed collisions
// (unique, sorts of the held ids, per-bucket argsorts, scatters). Here:
//   hash_feature_ids  HashIds (ids/hashing.py): every hashed feature of a batch in one call;
//   managed_route  a rank's raw ids of one table: distinct ids with counts, grouped by the rank
//                  remapping their bucket (sharded/managed_collisions.py, before the exchange);
//   managed_remap  the ids a block received (repeats allowed): each touched bucket read once,
//                  its held ids found by a scan, its new ids placed by the policy's order.
// Loaded with sparse_rows.cpp by kernels/native.py.
#include <torch/extension.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <utility>
#include <vector>

#include <c10/util/Optional.h>

namespace {

constexpr int64_t kBelow62 = (int64_t{1} << 62) - 1;  // counts in the LFU key saturate here
constexpr int64_t kBelow32 = (int64_t{1} << 32) - 1;  // and in the new ids' order here
// A row's policy key packs its last step above its offset in the bucket (bucket_rows up to
// 2**kOffsetBits; ids/managed_collisions.py NATIVE_BUCKET_ROWS), steps below 2**52.
constexpr int64_t kOffsetBits = 11;
constexpr int64_t kOffsetMask = (int64_t{1} << kOffsetBits) - 1;
constexpr int64_t kMaxStep = int64_t{1} << 52;

// splitmix64's finalizer (kernels/splitmix.py), on the id's two's complement bits.
inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct Block {
  int64_t* held;   // the raw id each row holds
  int64_t* last;   // the step each row was last seen (0: free)
  int64_t* seen;   // how often
  int64_t rows;    // rows of this block
  int64_t bucket_rows;
};

// The row of [base, base + size) holding `id`, -1 if none (an id is held at most once).
inline int64_t held_row_portable(const Block& b, int64_t base, int64_t size, int64_t id) {
  for (int64_t r = base; r < base + size; ++r) {
    if (b.held[r] == id && b.last[r] != 0) return r;
  }
  return -1;
}

#if defined(__x86_64__)
// The same, four rows a compare: the scan is most of a lookup (64 rows by default), and the
// scalar loop measured about 40 ns of the 55 ns an id took in an eval step.
__attribute__((target("avx2"))) int64_t held_row_avx2(const Block& b, int64_t base,
                                                      int64_t size, int64_t id) {
  const __m256i wanted = _mm256_set1_epi64x(id);
  int64_t r = base;
  for (; r + 4 <= base + size; r += 4) {
    const __m256i held = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.held + r));
    int mask = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(held, wanted)));
    while (mask) {
      const int lane = __builtin_ctz(mask);
      if (b.last[r + lane] != 0) return r + lane;
      mask &= mask - 1;
    }
  }
  return held_row_portable(b, r, base + size - r, id);
}
#endif

inline int64_t held_row(const Block& b, int64_t base, int64_t size, int64_t id) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return held_row_avx2(b, base, size, id);
#endif
  return held_row_portable(b, base, size, id);
}

// Positions 0..n-1 ordered by bucket, stable: a counting sort where the buckets are few against
// the ids (a step's ids over a block's buckets, usually), a comparison sort otherwise.
std::vector<int64_t> order_by_bucket(const std::vector<int64_t>& bucket, int64_t buckets) {
  const int64_t n = static_cast<int64_t>(bucket.size());
  std::vector<int64_t> order(n);
  if (buckets > 4 * n + 1024) {
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return bucket[x] < bucket[y]; });
    return order;
  }
  std::vector<int64_t> start(buckets + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++start[bucket[i] + 1];
  for (int64_t k = 0; k < buckets; ++k) start[k + 1] += start[k];
  for (int64_t i = 0; i < n; ++i) order[start[bucket[i]]++] = i;
  return order;
}

// Stable, in place, without the buffer std::stable_sort allocates: a bucket's new ids are a few.
template <typename Less>
void insertion_sort(std::vector<int64_t>& v, Less less) {
  for (size_t i = 1; i < v.size(); ++i) {
    const int64_t x = v[i];
    size_t j = i;
    for (; j > 0 && less(x, v[j - 1]); --j) v[j] = v[j - 1];
    v[j] = x;
  }
}

void check_state(const torch::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == torch::kLong &&
                  t.dim() == 1 && t.size(0) == rows,
              "managed_remap: ", what, " must be a contiguous int64 CPU tensor of ", rows,
              " rows");
}


// A step's distinct id of one bucket: its summed count, its positions [begin, end) in the
// bucket-then-id order, and its hash.
struct Distinct {
  int64_t id;
  int64_t count;
  int64_t begin;
  int64_t end;
  uint64_t hash;
  int64_t row;
};

void check_ids(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == torch::kLong &&
                  t.dim() == 1,
              "managed collisions: ", what, " must be a contiguous 1-D int64 CPU tensor");
}

// The rows of `group`'s distinct ids (ascending) in bucket `bucket`: held ids keep theirs, new
// ids take usable rows by the policy (training), the rest share one by a second hash.
void remap_bucket(const Block& b, int64_t bucket, std::vector<Distinct>& group, int64_t step,
                  bool lfu, int64_t* stats, std::vector<int64_t>& newcomers,
                  std::vector<int64_t>& lru_keys,
                  std::vector<std::pair<int64_t, int64_t>>& lfu_keys) {
  const int64_t base = bucket * b.bucket_rows;
  const int64_t size = std::min(b.bucket_rows, b.rows - base);
  newcomers.clear();
  // held ids keep their rows (seen this step) before any new id is placed
  for (int64_t k = 0; k < static_cast<int64_t>(group.size()); ++k) {
    Distinct& d = group[k];
    d.row = held_row(b, base, size, d.id);
    if (d.row < 0) {
      newcomers.push_back(k);
    } else if (step > 0) {
      b.last[d.row] = step;
      b.seen[d.row] += d.count;
    }
  }
  if (step > 0 && !newcomers.empty()) {
    stats[1] += static_cast<int64_t>(newcomers.size());
    // usable rows (not seen this step) by the policy, free rows first (their step and count
    // are 0), ties by row: keys of a total order packed into integers (the step above the
    // row's offset in its bucket), so only the first `placed` need sorting, by value
    int64_t free = 0;
    lru_keys.clear();
    lfu_keys.clear();
    for (int64_t r = base; r < base + size; ++r) {
      free += b.last[r] == 0;
      if (b.last[r] == step) continue;
      const int64_t key = (b.last[r] << kOffsetBits) | (r - base);
      if (lfu) {
        lfu_keys.emplace_back(std::min(b.seen[r], kBelow62), key);
      } else {
        lru_keys.push_back(key);
      }
    }
    const int64_t usable = lfu ? lfu_keys.size() : lru_keys.size();
    const int64_t placed = std::min<int64_t>(newcomers.size(), usable);
    if (lfu) {
      std::partial_sort(lfu_keys.begin(), lfu_keys.begin() + placed, lfu_keys.end());
    } else {
      std::partial_sort(lru_keys.begin(), lru_keys.begin() + placed, lru_keys.end());
    }
    // new ids most frequent first, then by id (they are ascending already)
    insertion_sort(newcomers, [&](int64_t x, int64_t y) {
      return std::min(group[x].count, kBelow32) > std::min(group[y].count, kBelow32);
    });
    stats[2] += std::max<int64_t>(0, static_cast<int64_t>(newcomers.size()) - free);
    for (int64_t k = 0; k < placed; ++k) {
      Distinct& d = group[newcomers[k]];
      const int64_t key = lfu ? lfu_keys[k].second : lru_keys[k];
      const int64_t r = base + (key & kOffsetMask);
      stats[3] += b.last[r] != 0;
      b.held[r] = d.id;
      b.last[r] = step;
      b.seen[r] = d.count;
      d.row = r;
    }
  }
  // ids holding no row share one picked by a second hash
  for (Distinct& d : group) {
    if (d.row < 0) d.row = base + static_cast<int64_t>(mix(d.hash) % size);
  }
}

}  // namespace

// Rows (block-local) of raw `ids` (any order, repeats allowed: a repeat is the same id seen
// again), each position seen counts[i] times (1 without `counts`), and the stats [distinct ids,
// new, collisions, evictions]. `step` > 0 takes a training step (state updated in place); 0 maps
// without changing anything (eval). The ids must all hash into this block's buckets
// [first_bucket, first_bucket + ceil(rows / bucket_rows)) of the table's `num_buckets`.
std::vector<torch::Tensor> managed_remap(torch::Tensor ids, c10::optional<torch::Tensor> counts,
                                         torch::Tensor held, torch::Tensor last,
                                         torch::Tensor seen, int64_t salt_key,
                                         int64_t num_buckets, int64_t first_bucket,
                                         int64_t bucket_rows, int64_t step, bool lfu) {
  const int64_t n = ids.numel();
  const int64_t rows = held.numel();
  check_ids(ids, "ids");
  const int64_t* count = nullptr;
  if (counts) {
    check_state(*counts, n, "counts");
    count = counts->data_ptr<int64_t>();
  }
  check_state(held, rows, "held ids");
  check_state(last, rows, "last_seen");
  check_state(seen, rows, "counts state");
  TORCH_CHECK(bucket_rows > 0 && bucket_rows <= kOffsetMask + 1 && num_buckets > 0,
              "managed_remap: bucket_rows must be in [1, ", kOffsetMask + 1, "], got ", bucket_rows);
  TORCH_CHECK(step >= 0 && step < kMaxStep, "managed_remap: step ", step, " out of range");
  const Block b{held.data_ptr<int64_t>(), last.data_ptr<int64_t>(), seen.data_ptr<int64_t>(),
                rows, bucket_rows};
  const int64_t local_buckets = (rows + bucket_rows - 1) / bucket_rows;
  const int64_t* id = ids.data_ptr<int64_t>();

  std::vector<uint64_t> hash(n);
  std::vector<int64_t> bucket_of(n);
  for (int64_t i = 0; i < n; ++i) {
    hash[i] = mix(static_cast<uint64_t>(id[i]) ^ static_cast<uint64_t>(salt_key));
    const int64_t bucket =
        static_cast<int64_t>(hash[i] % static_cast<uint64_t>(num_buckets)) - first_bucket;
    TORCH_CHECK(bucket >= 0 && bucket < local_buckets, "managed_remap: id ", id[i],
                " hashes to bucket ", bucket + first_bucket, ", outside this block's buckets [",
                first_bucket, ", ", first_bucket + local_buckets, ")");
    bucket_of[i] = bucket;
  }
  std::vector<int64_t> order = order_by_bucket(bucket_of, local_buckets);
  auto out = torch::empty({n}, ids.options());
  int64_t* row_of = out.data_ptr<int64_t>();
  int64_t stats[4] = {0, 0, 0, 0};  // distinct, new, collisions, evictions
  std::vector<Distinct> group;
  std::vector<int64_t> newcomers, lru_keys;
  std::vector<std::pair<int64_t, int64_t>> lfu_keys;
  const auto by_id = [&](int64_t x, int64_t y) { return id[x] < id[y]; };
  for (int64_t g = 0; g < n;) {
    const int64_t bucket = bucket_of[order[g]];
    int64_t end = g;
    while (end < n && bucket_of[order[end]] == bucket) ++end;
    // the bucket's positions by id; equal ids are one distinct id, their counts summed
    if (end - g <= 32) {
      for (int64_t k = g + 1; k < end; ++k) {
        const int64_t x = order[k];
        int64_t j = k;
        for (; j > g && by_id(x, order[j - 1]); --j) order[j] = order[j - 1];
        order[j] = x;
      }
    } else {
      std::sort(order.begin() + g, order.begin() + end, by_id);
    }
    group.clear();
    for (int64_t k = g; k < end; ++k) {
      const int64_t i = order[k];
      const int64_t c = count ? count[i] : 1;
      if (!group.empty() && group.back().id == id[i]) {
        group.back().count += c;
        group.back().end = k + 1;
      } else {
        group.push_back({id[i], c, k, k + 1, hash[i], -1});
      }
    }
    stats[0] += static_cast<int64_t>(group.size());
    remap_bucket(b, bucket, group, step, lfu, stats, newcomers, lru_keys, lfu_keys);
    for (const Distinct& d : group) {
      for (int64_t k = d.begin; k < d.end; ++k) row_of[order[k]] = d.row;
    }
    g = end;
  }
  auto stat_tensor = torch::tensor({stats[0], stats[1], stats[2], stats[3]}, torch::kLong);
  return {out, stat_tensor};
}

// One table's raw ids of this rank's batch, routed to the ranks remapping their buckets:
// (distinct ids grouped by owner rank, in order of first appearance within each, their counts,
// each raw position's index into them, the count per owner). `owner_ends[r]` is the end of rank
// r's buckets (BucketLayout.owned). Open addressing on the ids' hash: one pass, no sort.
std::vector<torch::Tensor> managed_route(torch::Tensor raw, int64_t salt_key, int64_t num_buckets,
                                         torch::Tensor owner_ends) {
  check_ids(raw, "raw ids");
  check_ids(owner_ends, "owner_ends");
  TORCH_CHECK(num_buckets > 0, "managed_route: num_buckets");
  const int64_t n = raw.numel();
  const int64_t world = owner_ends.numel();
  const int64_t* id = raw.data_ptr<int64_t>();
  const int64_t* ends = owner_ends.data_ptr<int64_t>();
  int64_t capacity = 16;
  while (capacity < 2 * n) capacity <<= 1;
  std::vector<int64_t> slot_of(capacity, -1);  // distinct index, -1: empty
  std::vector<int64_t> distinct_id, distinct_count, distinct_owner;
  distinct_id.reserve(n);
  distinct_count.reserve(n);
  distinct_owner.reserve(n);
  std::vector<int64_t> first_index(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = mix(static_cast<uint64_t>(id[i]) ^ static_cast<uint64_t>(salt_key));
    int64_t s = static_cast<int64_t>(h & static_cast<uint64_t>(capacity - 1));
    while (slot_of[s] >= 0 && distinct_id[slot_of[s]] != id[i]) s = (s + 1) & (capacity - 1);
    if (slot_of[s] < 0) {
      const int64_t bucket = static_cast<int64_t>(h % static_cast<uint64_t>(num_buckets));
      slot_of[s] = static_cast<int64_t>(distinct_id.size());
      distinct_id.push_back(id[i]);
      distinct_count.push_back(0);
      distinct_owner.push_back(std::upper_bound(ends, ends + world, bucket) - ends);
    }
    ++distinct_count[slot_of[s]];
    first_index[i] = slot_of[s];
  }
  const int64_t m = static_cast<int64_t>(distinct_id.size());
  const std::vector<int64_t> order = order_by_bucket(distinct_owner, world);
  std::vector<int64_t> position(m);
  auto ids = torch::empty({m}, raw.options());
  auto counts = torch::empty({m}, raw.options());
  auto per_owner = torch::zeros({world}, raw.options());
  int64_t* ids_out = ids.data_ptr<int64_t>();
  int64_t* counts_out = counts.data_ptr<int64_t>();
  int64_t* per_owner_out = per_owner.data_ptr<int64_t>();
  for (int64_t k = 0; k < m; ++k) {
    const int64_t d = order[k];
    position[d] = k;
    ids_out[k] = distinct_id[d];
    counts_out[k] = distinct_count[d];
    ++per_owner_out[distinct_owner[d]];
  }
  auto inverse = torch::empty({n}, raw.options());
  int64_t* inverse_out = inverse.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) inverse_out[i] = position[first_index[i]];
  return {ids, counts, inverse, per_owner};
}

// `values` with the ids of each feature f whose rows[f] > 0 replaced by their rows in its table:
// H(id, salt) mod rows[f], H = mix(id XOR salt_keys[f]) (ids/hashing.py). `bounds`: each
// feature's first value and the end (features + 1 offsets).
torch::Tensor hash_feature_ids(torch::Tensor values, torch::Tensor bounds, torch::Tensor salt_keys,
                               torch::Tensor rows) {
  check_ids(values, "values");
  check_ids(bounds, "bounds");
  check_ids(salt_keys, "salt keys");
  check_ids(rows, "rows");
  const int64_t features = rows.numel();
  TORCH_CHECK(bounds.numel() == features + 1 && salt_keys.numel() == features,
              "hash_feature_ids: bounds, salt_keys and rows disagree on the features");
  const int64_t* bound = bounds.data_ptr<int64_t>();
  TORCH_CHECK(bound[0] >= 0 && bound[features] <= values.numel(), "hash_feature_ids: bounds");
  auto out = values.clone();
  const int64_t* in = values.data_ptr<int64_t>();
  int64_t* hashed = out.data_ptr<int64_t>();
  const int64_t* key = salt_keys.data_ptr<int64_t>();
  const int64_t* size = rows.data_ptr<int64_t>();
  for (int64_t f = 0; f < features; ++f) {
    if (size[f] <= 0) continue;
    const uint64_t salt = static_cast<uint64_t>(key[f]);
    const uint64_t modulus = static_cast<uint64_t>(size[f]);
    for (int64_t i = bound[f]; i < bound[f + 1]; ++i) {
      hashed[i] = static_cast<int64_t>(mix(static_cast<uint64_t>(in[i]) ^ salt) % modulus);
    }
  }
  return out;
}

void register_raw_ids(pybind11::module& m) {
  m.def("hash_feature_ids", &hash_feature_ids);
  m.def("managed_remap", &managed_remap);
  m.def("managed_route", &managed_route);
}
