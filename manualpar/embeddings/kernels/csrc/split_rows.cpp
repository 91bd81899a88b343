// The row-wise plan's routing of ids (step/exchange.py): each feature's ids split by the row
// range of the shard that holds them.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernel_checks.h"

// Row-wise routing: a feature's ids split by the row range of the shard that holds them, bag
// order kept within each range (a stable counting sort), ids made shard-local.
std::vector<torch::Tensor> split_by_rows(torch::Tensor ids, torch::Tensor lengths,
                                         torch::Tensor row_starts) {
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  check_cpu_contiguous(row_starts, "row_starts");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong &&
                  row_starts.scalar_type() == torch::kLong,
              "ids, lengths and row_starts must be int64");
  const int64_t n = ids.numel(), batch = lengths.numel(), groups = row_starts.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* starts = row_starts.data_ptr<int64_t>();
  auto counts = torch::zeros({groups, batch}, lengths.options());
  auto order = torch::empty({n}, ids.options());
  auto local = torch::empty({n}, ids.options());
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> group_of(n);
  int64_t pos = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t k = 0; k < len[b]; ++k, ++pos) {
      const int64_t g = std::upper_bound(starts, starts + groups, id[pos]) - starts - 1;
      group_of[pos] = g;
      ++count[g * batch + b];
    }
  }
  TORCH_CHECK(pos == n, "lengths sum to ", pos, " but there are ", n, " ids");
  std::vector<int64_t> next(groups, 0);
  for (int64_t g = 1; g < groups; ++g) {
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) total += count[(g - 1) * batch + b];
    next[g] = next[g - 1] + total;
  }
  int64_t* out_order = order.data_ptr<int64_t>();
  int64_t* out_local = local.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = next[group_of[i]]++;
    out_order[slot] = i;
    out_local[slot] = id[i] - starts[group_of[i]];
  }
  return {counts, local, order};
}

namespace {

// The row range (group) of `id` among `groups` sorted range starts: the number of starts after
// the first that are <= id, without a branch per start (a coin toss per id under row-wise
// plans: the branches of a binary search mispredicted half the time).
inline int64_t group_of_id(int64_t id, const int64_t* starts, int64_t groups) {
  int64_t g = 0;
  for (int64_t j = 1; j < groups; ++j) g += id >= starts[j];
  return g;
}

}  // namespace

// A plain batch's ids payloads when every feature's table is split by rows into the same
// number of groups: each group's payload laid out as its owner reads it (step/exchange.py),
// written in one pass per id with no per-feature tensors. `lengths`: (features x batch) bag
// lengths, feature-major; `row_starts`: (features, groups) each feature's table's range
// starts; `group_order`: the groups in the order their payloads are laid out. Each payload is
// the group's (features x batch) bag lengths, then its ids made local to their range, features
// in order, bag order kept: the same values split_by_rows gives per feature, in one buffer.
// Returns (buffer, each payload's length in `group_order`).
std::vector<torch::Tensor> pack_split_rows(torch::Tensor ids, torch::Tensor lengths,
                                           torch::Tensor row_starts, torch::Tensor group_order) {
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  check_cpu_contiguous(row_starts, "row_starts");
  check_cpu_contiguous(group_order, "group_order");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong &&
                  row_starts.scalar_type() == torch::kLong &&
                  group_order.scalar_type() == torch::kLong,
              "ids, lengths, row_starts and group_order must be int64");
  TORCH_CHECK(row_starts.dim() == 2 && row_starts.size(1) >= 1, "row_starts: (features, groups)");
  const int64_t features = row_starts.size(0), groups = row_starts.size(1);
  TORCH_CHECK(features > 0 && lengths.numel() % features == 0, lengths.numel(),
              " bag lengths do not split into ", features, " features");
  TORCH_CHECK(group_order.numel() == groups, "group_order must name every group once");
  const int64_t batch = lengths.numel() / features, grid = features * batch, n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* starts = row_starts.data_ptr<int64_t>();
  // pass 1: each id's group, each (group, feature, bag)'s count, each (group, feature)'s ids
  std::vector<uint16_t> group_at(n);
  std::vector<int64_t> counts(groups * grid, 0), totals(groups * features, 0);
  TORCH_CHECK(groups <= 65536, "at most 65536 row groups");
  int64_t pos = 0;
  for (int64_t f = 0; f < features; ++f) {
    const int64_t* s = starts + f * groups;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t end = pos + len[f * batch + b];
      TORCH_CHECK(len[f * batch + b] >= 0 && end <= n, "bag lengths sum past the ", n, " ids");
      if (groups == 2) {  // the common case: counted in a register
        int64_t high = 0;
        for (; pos < end; ++pos) {
          const int64_t g = id[pos] >= s[1];
          group_at[pos] = static_cast<uint16_t>(g);
          high += g;
        }
        counts[grid + f * batch + b] = high;
        counts[f * batch + b] = len[f * batch + b] - high;
        continue;
      }
      for (; pos < end; ++pos) {
        const int64_t g = group_of_id(id[pos], s, groups);
        group_at[pos] = static_cast<uint16_t>(g);
        ++counts[g * grid + f * batch + b];
      }
    }
  }
  TORCH_CHECK(pos == n, "lengths sum to ", pos, " but there are ", n, " ids");
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t f = 0; f < features; ++f) {
      const int64_t* c = counts.data() + g * grid + f * batch;
      int64_t total = 0;
      for (int64_t b = 0; b < batch; ++b) total += c[b];
      totals[g * features + f] = total;
    }
  }
  // each group's payload: where it starts and its length, in `group_order`
  const int64_t* order = group_order.data_ptr<int64_t>();
  std::vector<int64_t> begin(groups, -1);
  auto sizes = torch::empty({groups}, ids.options());
  int64_t* size = sizes.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t i = 0; i < groups; ++i) {
    const int64_t g = order[i];
    TORCH_CHECK(0 <= g && g < groups && begin[g] < 0, "group_order must name every group once");
    begin[g] = offset;
    int64_t total = 0;
    for (int64_t f = 0; f < features; ++f) total += totals[g * features + f];
    size[i] = grid + total;
    offset += grid + total;
  }
  // one slot of slack: a write for another group lands at most one past its next id (pass 2)
  auto buffer = torch::empty({offset + 1}, ids.options());
  int64_t* out = buffer.data_ptr<int64_t>();
  // pass 2: the ids, local to their range. Two groups: both next slots written, one advanced
  // (no branch); the other slot is written again later (its next id, the next feature's
  // first, or a bag length copied in below), or is the slack.
  std::vector<int64_t*> next(groups);
  for (int64_t g = 0; g < groups; ++g) next[g] = out + begin[g] + grid;
  pos = 0;
  for (int64_t f = 0; f < features; ++f) {
    const int64_t* s = starts + f * groups;
    const int64_t end = pos + [&] {
      int64_t total = 0;
      for (int64_t g = 0; g < groups; ++g) total += totals[g * features + f];
      return total;
    }();
    if (groups == 2) {
      int64_t* low = next[0];
      int64_t* high = next[1];
      const int64_t s0 = s[0], s1 = s[1];
      for (; pos < end; ++pos) {
        const int64_t v = id[pos];
        const int64_t g = group_at[pos];
        *low = v - s0;
        *high = v - s1;
        low += 1 - g;
        high += g;
      }
      next[0] = low;
      next[1] = high;
      continue;
    }
    for (; pos < end; ++pos) {
      const int64_t g = group_at[pos];
      *next[g]++ = id[pos] - s[g];
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    std::copy(counts.data() + g * grid, counts.data() + (g + 1) * grid, out + begin[g]);
  }
  return {buffer.narrow(0, 0, offset), sizes};
}
