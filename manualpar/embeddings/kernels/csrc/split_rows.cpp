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
