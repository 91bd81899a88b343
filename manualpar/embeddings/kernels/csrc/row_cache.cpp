// The disk tier's cache bookkeeping (storage/row_cache.py) for one call's ids in one pass: the
// distinct rows, their slots (hits pinned, misses given free slots), and the victims when the
// free slots run out. The torch path takes a unique with its inverse, a dozen index ops and a
// sort over every slot per eviction batch: 19 ms of a 122 ms disk step per rank in the
// documented workload. Same state, same slots and the same victims as that path (victims: the
// unpinned slots with the smallest (key, slot), taken in ascending slot order).
// Loaded with sparse_rows.cpp by kernels/native.py.
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int32_t kStored = -2;  // row_cache.STORED: in the file at the row's place
constexpr int64_t kLru = 0, kLfu = 1, kLrfu = 2;  // row_cache.POLICIES, in order
// values <= row_cache.LOGGED (-3): in the file's write log

void check(const torch::Tensor& t, c10::ScalarType type, int64_t size, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == type &&
                  t.dim() == 1 && t.size(0) == size,
              "row cache: ", what, " must be a contiguous 1-D CPU tensor of ", size, " ",
              c10::toString(type));
}

// The distinct rows of `ids` in first-seen order, and each id's index among them: open
// addressing on the row (a sort-based unique took 3-4 ms for 20,000 ids).
struct Distinct {
  std::vector<int64_t> rows;
  std::vector<int32_t> of_id;
};

Distinct distinct_rows(const int64_t* ids, int64_t n, int64_t num_rows, const int32_t* slot) {
  int shift = 60;
  uint64_t size = 16;
  while (size < static_cast<uint64_t>(2 * n)) {
    size <<= 1;
    --shift;
  }
  std::vector<int64_t> key(size, -1);
  std::vector<int32_t> at(size);
  Distinct d;
  d.of_id.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = ids[i];
    TORCH_CHECK(row >= 0 && row < num_rows, "cache_assign: row ", row, " at position ", i,
                " is outside the block's ", num_rows, " rows");
    uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ULL) >> shift;
    while (key[h] != -1 && key[h] != row) h = (h + 1) & (size - 1);
    if (key[h] == -1) {
      key[h] = row;
      at[h] = static_cast<int32_t>(d.rows.size());
      d.rows.push_back(row);
      __builtin_prefetch(slot + row);  // read next, at random over the block's rows
    }
    d.of_id[i] = at[h];
  }
  return d;
}

torch::Tensor long_tensor(const std::vector<int64_t>& values) {
  torch::Tensor out = torch::empty({static_cast<int64_t>(values.size())}, torch::kLong);
  std::copy(values.begin(), values.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

// One call's `ids` (block rows, repeats allowed) pinned into slots. Returns [id_slots (the slot
// of each id), pinned (distinct slots), fetch_rows, fetch_slots, origins (the fetched rows'
// slot_of values before: where to read them from), evict_rows (the dirty victims' rows,
// ascending), evict_slots (theirs), counts], counts = [free_count, hits, misses, evictions];
// or, when the pinned rows would not fit, counts = [-1, needed] and the state untouched
// (RowCache raises CacheFull).
std::vector<torch::Tensor> cache_assign(torch::Tensor ids, torch::Tensor slot_of,
                                        torch::Tensor row_of, torch::Tensor pins,
                                        torch::Tensor dirty, torch::Tensor last_used,
                                        torch::Tensor uses, torch::Tensor free_slots,
                                        int64_t free_count, int64_t step, int64_t policy,
                                        int64_t reach, int64_t most_uses,
                                        int64_t evict_batch) {
  TORCH_CHECK(ids.device().is_cpu() && ids.is_contiguous() && ids.scalar_type() == torch::kLong,
              "cache_assign: ids must be a contiguous int64 CPU tensor");
  const int64_t num_rows = slot_of.numel(), capacity = row_of.numel();
  check(slot_of, torch::kInt, num_rows, "slot_of");
  check(row_of, torch::kLong, capacity, "row_of");
  check(pins, torch::kInt, capacity, "pins");
  check(dirty, torch::kBool, capacity, "dirty");
  check(last_used, torch::kLong, capacity, "last_used");
  check(uses, torch::kLong, capacity, "uses");
  check(free_slots, torch::kLong, capacity, "free_slots");
  TORCH_CHECK(free_count >= 0 && free_count <= capacity, "cache_assign: bad free_count");
  int32_t* slot = slot_of.data_ptr<int32_t>();
  int64_t* row = row_of.data_ptr<int64_t>();
  int32_t* pin = pins.data_ptr<int32_t>();
  bool* dirt = dirty.data_ptr<bool>();
  int64_t* last = last_used.data_ptr<int64_t>();
  int64_t* use = uses.data_ptr<int64_t>();
  int64_t* free_stack = free_slots.data_ptr<int64_t>();

  const int64_t n = ids.numel();
  const Distinct d = distinct_rows(ids.data_ptr<int64_t>(), n, num_rows, slot);
  std::vector<int64_t> hits, misses;
  for (const int64_t r : d.rows) {
    const int32_t s = slot[r];
    if (s >= 0) {
      hits.push_back(s);
      __builtin_prefetch(last + s, 1);  // touched below, at random over the slots
      __builtin_prefetch(use + s, 1);
    } else {
      misses.push_back(r);
    }
  }
  std::sort(misses.begin(), misses.end());  // slots handed out in row order, as the torch path
  const int64_t missing = static_cast<int64_t>(misses.size());
  const int64_t shortfall = missing - free_count;

  TORCH_CHECK(policy >= kLru && policy <= kLrfu && reach >= 0 && most_uses >= 0,
              "cache_assign: bad policy ", policy);
  // row_cache.py's keys: LRU the last use; LFU the uses, ties by the last use; LRFU the last
  // use plus `reach` steps for each step that used the row while cached, up to `most_uses`
  const auto key_of = [&](int64_t s) {
    if (policy == kLfu) return use[s] * (int64_t{1} << 32) + last[s];
    if (policy == kLrfu) return last[s] + reach * std::min(use[s], most_uses);
    return last[s];
  };
  for (const int64_t s : hits) ++pin[s];

  std::vector<int64_t> evict_rows, evict_slots;
  int64_t evicted = 0;
  if (shortfall > 0) {
    // The slots that may go (unpinned, holding a row), in slot order, with their keys: one
    // pass over the slots (the hits are pinned already).
    std::vector<std::pair<int64_t, int64_t>> open;  // (slot, key)
    open.reserve(capacity);
    int64_t pinned_now = 0, low = INT64_MAX, high = INT64_MIN;
    for (int64_t s = 0; s < capacity; ++s) {
      if (pin[s] != 0) {
        ++pinned_now;
      } else if (row[s] >= 0) {
        const int64_t key = key_of(s);
        low = std::min(low, key);
        high = std::max(high, key);
        open.emplace_back(s, key);
      }
    }
    if (static_cast<int64_t>(open.size()) < shortfall) {
      // a cache too small leaves the state as it was
      for (const int64_t s : hits) --pin[s];
      torch::Tensor counts = torch::tensor({int64_t{-1}, pinned_now + missing});
      return {counts};
    }
    evicted = std::min<int64_t>(static_cast<int64_t>(open.size()),
                                std::max(shortfall, evict_batch));
    // The victims: every key below the threshold, then the lowest slots at it. LRU's keys are
    // steps, a few dozen apart: a count per key finds the threshold (a selection over the keys
    // took most of an eviction's 0.6 ms at 97,000 slots); other keys take the selection.
    int64_t threshold = 0, at_threshold = 0;  // victims with the threshold's key
    if (high - low < int64_t{1} << 20 && high - low < 8 * capacity) {
      std::vector<int32_t> count(high - low + 1, 0);
      for (const auto& entry : open) ++count[entry.second - low];
      int64_t below = 0, key = 0;
      while (below + count[key] < evicted) below += count[key++];
      threshold = low + key;
      at_threshold = evicted - below;
    } else {
      std::vector<int64_t> keys;
      keys.reserve(open.size());
      for (const auto& entry : open) keys.push_back(entry.second);
      std::nth_element(keys.begin(), keys.begin() + (evicted - 1), keys.end());
      threshold = keys[evicted - 1];
      at_threshold = evicted;
      for (int64_t k = 0; k < evicted - 1; ++k) at_threshold -= keys[k] < threshold;
    }
    std::vector<int64_t> victims;
    victims.reserve(evicted);
    for (const auto& entry : open) {
      if (static_cast<int64_t>(victims.size()) == evicted) break;
      if (entry.second < threshold || (entry.second == threshold && at_threshold-- > 0)) {
        victims.push_back(entry.first);
      }
    }
    std::vector<std::pair<int64_t, int64_t>> dirty_victims;  // (row, slot)
    for (const int64_t v : victims) {
      const int64_t r = row[v];
      slot[r] = kStored;  // dirty ones are written back (to their place or the log)
      row[v] = -1;
      if (dirt[v]) {
        dirty_victims.emplace_back(r, v);
        dirt[v] = false;
      }
    }
    // by ascending row, as the write log and the file take them (the caller sorted them)
    std::sort(dirty_victims.begin(), dirty_victims.end());
    for (const auto& [r, v] : dirty_victims) {
      evict_rows.push_back(r);
      evict_slots.push_back(v);
    }
    // the victims go under the free slots left, taken last and in ascending order
    std::memmove(free_stack + evicted, free_stack, free_count * sizeof(int64_t));
    for (int64_t k = 0; k < evicted; ++k) free_stack[k] = victims[evicted - 1 - k];
    free_count += evicted;
  }

  torch::Tensor origins = torch::empty({missing}, torch::kInt);
  int32_t* origin = origins.data_ptr<int32_t>();
  std::vector<int64_t> fetch_slots(missing);
  for (int64_t k = 0; k < missing; ++k) {
    const int64_t r = misses[k];
    const int64_t s = free_stack[--free_count];
    origin[k] = slot[r];
    slot[r] = static_cast<int32_t>(s);
    row[s] = r;
    // generated rows are not in the file yet; a logged row's log record is dropped once read
    dirt[s] = origin[k] != kStored;
    ++pin[s];
    use[s] = 0;
    fetch_slots[k] = s;
  }

  std::vector<int64_t> pinned;
  pinned.reserve(d.rows.size());
  torch::Tensor id_slots = torch::empty(ids.sizes(), torch::kLong);
  int64_t* out = id_slots.data_ptr<int64_t>();
  std::vector<int64_t> slot_of_distinct(d.rows.size());
  for (size_t k = 0; k < d.rows.size(); ++k) {
    const int64_t s = slot[d.rows[k]];
    slot_of_distinct[k] = s;
    pinned.push_back(s);
    if (last[s] != step) {
      ++use[s];
      last[s] = step;
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = slot_of_distinct[d.of_id[i]];
  torch::Tensor counts = torch::tensor(
      {free_count, static_cast<int64_t>(hits.size()), missing, evicted}, torch::kLong);
  return {id_slots,         long_tensor(pinned),     long_tensor(misses),
          long_tensor(fetch_slots), origins,     long_tensor(evict_rows),
          long_tensor(evict_slots), counts};
}

// A call's pinned `slots` unpinned; `updated`: their rows changed (written back on eviction).
// Two index ops on the torch path: 0.17 ms a call in the documented workload.
void cache_release(torch::Tensor slots, torch::Tensor pins, torch::Tensor dirty, bool updated) {
  TORCH_CHECK(slots.device().is_cpu() && slots.is_contiguous() &&
                  slots.scalar_type() == torch::kLong,
              "cache_release: slots must be a contiguous int64 CPU tensor");
  const int64_t capacity = pins.numel();
  check(pins, torch::kInt, capacity, "pins");
  check(dirty, torch::kBool, capacity, "dirty");
  int32_t* pin = pins.data_ptr<int32_t>();
  bool* dirt = dirty.data_ptr<bool>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t k = 0; k < slots.numel(); ++k) {
    TORCH_CHECK(slot[k] >= 0 && slot[k] < capacity && pin[slot[k]] > 0, "cache_release: slot ",
                slot[k], " is not pinned");
  }
  for (int64_t k = 0; k < slots.numel(); ++k) {
    --pin[slot[k]];
    if (updated) dirt[slot[k]] = true;
  }
}

void register_row_cache(pybind11::module& m) {
  m.def("cache_assign", &cache_assign);
  m.def("cache_release", &cache_release);
}
