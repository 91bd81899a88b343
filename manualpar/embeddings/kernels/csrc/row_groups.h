// The ids of a shard grouped by row (row_groups.cpp): what the update kernels walk
// (sparse_rows.cpp, half_rows.cpp, table_batch.cpp through group_rows' tensors).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// Occurrences of each distinct id, kept as tensors so a caller can group in one phase (forward,
// while an exchange is in flight) and update in another. Positions are ordered by id: `order`
// maps back to the original position (for per-id weights), `bags` holds each one's bag, run u
// is positions [starts[u], starts[u + 1]) of row rows[u]. `runs` is the visit order: first the
// `num_own` runs whose bags all lie in [own_begin, own_end), then the others, each by ascending
// row. A row's gradient is complete once all its bags have theirs, so the own runs (rows only
// this rank's bags touch) can be updated while the other ranks' gradients are on their way.
// Everything the update reads per id is laid out in visit order: no random reads but the rows.
struct Groups {
  torch::Tensor order, starts, bags, rows, runs;
  int64_t num_own = 0;
};

struct GroupsView {
  const int64_t* order;
  const int64_t* starts;
  const int64_t* bags;
  const int64_t* rows;
  const int64_t* runs;
  explicit GroupsView(const Groups& g)
      : order(g.order.data_ptr<int64_t>()), starts(g.starts.data_ptr<int64_t>()),
        bags(g.bags.data_ptr<int64_t>()), rows(g.rows.data_ptr<int64_t>()),
        runs(g.runs.data_ptr<int64_t>()) {}
};

// Keys of many tables' ids in one row space (a table batch): the bags before `bag_end` (and
// after the previous range's) hold ids of a table of `rows` rows, keyed `base` + id.
struct KeyRange {
  int64_t bag_end, base, rows;
};

// The groups of `ids` (bags of `lengths`, every id in [0, num_rows)), the runs of rows only bags
// [own_begin, own_end) touch first. With `ranges` (in bag order, the last ending at the last
// bag), each id is grouped by its key base + id instead, checked against its range's rows.
Groups group_ids(const torch::Tensor& ids, const torch::Tensor& lengths, int64_t num_rows,
                 int64_t own_begin, int64_t own_end,
                 const std::vector<KeyRange>* ranges = nullptr);
