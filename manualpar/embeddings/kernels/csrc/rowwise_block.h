// Row-wise Adagrad over one block's distinct rows (runs [run_begin, run_end) of the grouped ids)
// from their bags' gradients: the walk and state update that float rows (sparse_rows.cpp) and
// rounded half rows (half_rows.cpp) share; `write(row, gradient columns, step, cols, row index)`
// applies a row's step its own way.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "row_gradients.h"
#include "row_groups.h"
#include "rowwise_row.h"

template <typename scalar_t, typename weight_t, typename Write>
void rowwise_adagrad_block(torch::Tensor& weight, torch::Tensor& state,
                           const c10::optional<torch::Tensor>& weights, const Groups& grouped,
                           const std::vector<torch::Tensor>& blocks,
                           const std::vector<double>& scales, int64_t run_begin, int64_t run_end,
                           int64_t first_bag, int64_t end_bag, int64_t col_start, double lr,
                           double eps, Write write) {
  const GroupsView groups(grouped);
  const auto bags = bag_rows<scalar_t>(blocks, scales, first_bag);
  TORCH_CHECK(static_cast<int64_t>(bags.row.size()) == end_bag - first_bag, "gradients given for ",
              bags.row.size(), " bags, but these rows occur in bags ", first_bag, "..",
              end_bag - 1);
  const int64_t full = bags.cols, cols = weight.size(1), stride = weight.stride(0);
  TORCH_CHECK(run_begin == run_end || col_start + cols <= full, "column block outside gradient");
  weight_t* w = weight.data_ptr<weight_t>();
  scalar_t* sum = state.data_ptr<scalar_t>();
  const scalar_t lr_ = static_cast<scalar_t>(lr), eps_ = static_cast<scalar_t>(eps);
  for_each_row_batch<scalar_t, kUpdateRows>(
      groups, run_begin, run_end, weights, bags,
      [&](const RowBatch<scalar_t, kUpdateRows>& b) {
        rowwise_adagrad_rows<scalar_t>(
            b.n, b.row, b.g, b.scale, sum, full, lr_, eps_, [&](int i, scalar_t step) {
              write(w + b.row[i] * stride, b.g[i] + col_start, step, cols, b.row[i]);
            });
      },
      Written<scalar_t, weight_t>{w, stride, cols, sum});
}
