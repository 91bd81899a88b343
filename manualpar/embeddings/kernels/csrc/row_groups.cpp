// Grouping a shard's ids by row (row_groups.h's Groups): a stable LSD radix sort of the ids, then
// one pass that lays out each distinct row's run. Called from kernels/bags.py (group_rows) and
// kernels/table_batch.py (over a batch's keys); segment_sum (sparse_rows.cpp) groups through it.
#include "row_groups.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "kernel_checks.h"

namespace {

// Digits of at most this many bits: keys of up to 26 bits (a table batch's row space of many
// tables, 67M rows) sort in two passes. Fixed 11-bit digits took three passes from 4M keys on:
// grouping 8 tables of 1M rows as one batch measured 2.5x their grouping one table at a time.
constexpr int64_t kMaxRadixBits = 13;

int64_t bits_of(int64_t value) {
  int64_t bits = 0;
  while ((value >> bits) > 0) ++bits;
  return bits;
}

// The digits of an LSD radix sort of keys of `key_bits` bits (in as few passes as
// kMaxRadixBits allows, their digits as even as the key's bits split), and each pass's count of
// every digit, taken as the values are made (`count`): a pass of its own over the values, with
// a loop over the passes per value, was a third of the grouping.
struct RadixDigits {
  int64_t passes = 0, digit = 0, buckets = 1, shift = 0;
  uint64_t mask = 0;
  std::vector<int64_t> counts;

  RadixDigits(int64_t key_bits, int64_t value_shift) : shift(value_shift) {
    passes = (key_bits + kMaxRadixBits - 1) / kMaxRadixBits;
    if (passes == 0) return;
    digit = (key_bits + passes - 1) / passes;
    buckets = int64_t{1} << digit;
    mask = static_cast<uint64_t>(buckets - 1);
    counts.assign(passes * buckets, 0);
  }

  // one value's digits counted (two passes, the usual case, unrolled)
  void count(uint64_t v) {
    int64_t* c = counts.data();
    if (passes == 2) {
      ++c[(v >> shift) & mask];
      ++c[buckets + ((v >> (shift + digit)) & mask)];
      return;
    }
    for (int64_t p = 0; p < passes; ++p, c += buckets) ++c[(v >> (shift + p * digit)) & mask];
  }
};

// values[0, n) (each key << shift | payload, keys in [0, 2^key_bits), their digits counted in
// `radix`) ordered by key, stable: LSD radix sort, each pass from one buffer into the other.
// The position travels in the value, so no pass reads the keys at random. Returns the buffer
// that holds the sorted values (`values` or `scratch`).
uint64_t* sort_by_key(uint64_t* values, uint64_t* scratch, int64_t n, RadixDigits& radix) {
  if (radix.passes == 0 || n < 2) return values;
  uint64_t* current = values;
  uint64_t* next = scratch;
  const uint64_t mask = radix.mask;
  for (int64_t p = 0; p < radix.passes; ++p) {
    int64_t* count = radix.counts.data() + p * radix.buckets;
    int64_t total = 0;
    for (int64_t b = 0; b < radix.buckets; ++b) {
      const int64_t here = count[b];
      count[b] = total;
      total += here;
    }
    const int64_t at = radix.shift + p * radix.digit;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t v = current[i];
      next[count[(v >> at) & mask]++] = v;
    }
    std::swap(current, next);
  }
  return current;
}

}  // namespace

Groups group_ids(const torch::Tensor& ids, const torch::Tensor& lengths, int64_t num_rows,
                 int64_t own_begin, int64_t own_end, const std::vector<KeyRange>* ranges) {
  const int64_t n = ids.numel(), num_bags = lengths.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  // each id as row << (bag_bits + pos_bits) | bag << pos_bits | position: the sort moves the
  // bag and the position with the row, so laying out the runs reads nothing at random (the bag
  // of each sorted position, read at random, was most of the grouping). Where the three do not
  // fit 64 bits, the bag is looked up by position instead.
  const int64_t key_bits = bits_of(std::max<int64_t>(num_rows - 1, 0));
  const int64_t pos_bits = bits_of(std::max<int64_t>(n - 1, 0));
  const int64_t packed_bag_bits = bits_of(std::max<int64_t>(num_bags - 1, 0));
  const bool packs_bag = key_bits + packed_bag_bits + pos_bits <= 64;
  const int64_t bag_bits = packs_bag ? packed_bag_bits : 0;
  const int64_t shift = bag_bits + pos_bits;
  TORCH_CHECK(key_bits + pos_bits <= 64, "group_rows: ", num_rows, " rows and ", n,
              " ids do not fit a 64-bit sort key; group fewer ids a call");
  // the values and the sort's scratch, not zeroed (each element is written before it is read)
  const int64_t room = std::max<int64_t>(n, 1);
  std::unique_ptr<uint64_t[]> buffers(new uint64_t[2 * room]);
  uint64_t* const values = buffers.get();
  RadixDigits radix(key_bits, shift);
  std::vector<int64_t> bag_of(packs_bag ? 0 : n);
  int64_t filled = 0;
  // one key range for plain ids; a table batch's ranges key each table's ids apart
  const KeyRange whole{num_bags, 0, num_rows};
  const KeyRange* range = ranges ? ranges->data() : &whole;
  const KeyRange* const ranges_end = ranges ? ranges->data() + ranges->size() : &whole + 1;
  for (int64_t b = 0; b < num_bags; ++b) {
    TORCH_CHECK(len[b] >= 0 && filled + len[b] <= n, "lengths disagree with ids");
    while (range != ranges_end && b >= range->bag_end) ++range;
    TORCH_CHECK(range != ranges_end, "bag ", b, " lies in no key range");
    const int64_t base = range->base, rows = range->rows;
    const uint64_t bag = packs_bag ? static_cast<uint64_t>(b) << pos_bits : 0;
    for (int64_t i = filled; i < filled + len[b]; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < rows, "id ", id[i], " outside [0, ", rows, ")");
      const uint64_t v =
          (static_cast<uint64_t>(base + id[i]) << shift) | bag | static_cast<uint64_t>(i);
      values[i] = v;
      radix.count(v);
      if (!packs_bag) bag_of[i] = b;
    }
    filled += len[b];
  }
  TORCH_CHECK(filled == n, "lengths sum to ", filled, " but there are ", n, " ids");
  const uint64_t* const sorted = sort_by_key(values, values + room, n, radix);
  Groups groups;
  groups.order = torch::empty({n}, ids.options());
  groups.bags = torch::empty({n}, ids.options());
  groups.starts = torch::empty({n + 1}, ids.options());
  groups.rows = torch::empty({n}, ids.options());
  groups.runs = torch::empty({n}, ids.options());
  int64_t* __restrict__ order = groups.order.data_ptr<int64_t>();
  int64_t* __restrict__ bags = groups.bags.data_ptr<int64_t>();
  int64_t* __restrict__ starts = groups.starts.data_ptr<int64_t>();
  int64_t* __restrict__ rows = groups.rows.data_ptr<int64_t>();
  int64_t* __restrict__ runs = groups.runs.data_ptr<int64_t>();
  const uint64_t position = (uint64_t{1} << pos_bits) - 1;
  const uint64_t bag_mask = (uint64_t{1} << bag_bits) - 1;
  // Without branches: whether a run is the rank's own is a coin toss per row (mispredicted
  // branches were most of the grouping's time), so each closed run is written to both lists
  // and kept in one, and a row's start is written at every id and kept at its first.
  // the runs not our own gather in the sort's other buffer, free now
  int64_t* const rest = reinterpret_cast<int64_t*>(sorted == values ? values + room : values);
  // bag in [own_begin, own_end) as one unsigned comparison
  const uint64_t own_width =
      own_end > own_begin ? static_cast<uint64_t>(own_end - own_begin) : uint64_t{0};
  int64_t count = 0, own = 0, others = 0, previous = -1;
  bool only_own = true;
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t v = sorted[k];
    const int64_t row = static_cast<int64_t>(v >> shift);
    const int64_t pos = static_cast<int64_t>(v & position);
    const int64_t bag = packs_bag ? static_cast<int64_t>((v >> pos_bits) & bag_mask) : bag_of[pos];
    const bool fresh = row != previous;  // ids are >= 0: the first one starts a run
    const bool closes = fresh && k > 0;  // run count - 1 ends before k
    runs[own] = count - 1;
    rest[others] = count - 1;
    own += closes && only_own;
    others += closes && !only_own;
    starts[count] = k;
    rows[count] = row;
    count += fresh;
    previous = row;
    order[k] = pos;
    bags[k] = bag;
    only_own = (only_own || fresh) && static_cast<uint64_t>(bag - own_begin) < own_width;
  }
  if (n > 0) {
    runs[own] = count - 1;
    rest[others] = count - 1;
    own += only_own;
    others += !only_own;
  }
  starts[count] = n;
  std::copy(rest, rest + others, runs + own);
  groups.num_own = own;
  groups.starts.resize_({count + 1});
  groups.rows.resize_({count});
  groups.runs.resize_({count});
  return groups;
}

// (order, starts, bags, rows, runs, num_own): the occurrences of each distinct id (Groups).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t>
group_rows(torch::Tensor ids, torch::Tensor lengths, int64_t num_rows, int64_t own_begin,
           int64_t own_end) {
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong,
              "ids and lengths must be int64");
  Groups g = group_ids(ids, lengths, num_rows, own_begin, own_end);
  return {g.order, g.starts, g.bags, g.rows, g.runs, g.num_own};
}
