// Each distinct row's summed gradient, visited in the groups' run order (row_groups.h): the walk
// the one-table update kernels share (sparse_rows.cpp's float update, half_rows.cpp's rounded
// one), with the prefetching of the rows they write.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx512_rows.h"
#include "prefetch.h"
#include "row_groups.h"

namespace {

// Each bag's gradient row and weight, from blocks that cover consecutive bags (one block per
// sender or per feature; a block's rows may be strided, e.g. a column slice of the output).
template <typename scalar_t>
struct BagRows {
  std::vector<const scalar_t*> row;  // indexed by bag - first
  std::vector<scalar_t> scale;
  int64_t cols = 0, first = 0;
  const scalar_t* row_of(int64_t bag) const { return row[bag - first]; }
  scalar_t scale_of(int64_t bag) const { return scale[bag - first]; }
};

template <typename scalar_t>
BagRows<scalar_t> bag_rows(const std::vector<torch::Tensor>& blocks,
                           const std::vector<double>& scales, int64_t first_bag) {
  TORCH_CHECK(blocks.size() == scales.size(), "one scale per gradient block");
  BagRows<scalar_t> bags;
  bags.first = first_bag;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const torch::Tensor& block = blocks[i];
    TORCH_CHECK(block.device().is_cpu() && block.dim() == 2 && block.stride(1) == 1,
                "gradient blocks must be 2-D CPU tensors with contiguous rows");
    TORCH_CHECK(i == 0 || block.size(1) == bags.cols, "gradient blocks differ in width");
    bags.cols = block.size(1);
    const scalar_t* data = block.data_ptr<scalar_t>();
    for (int64_t r = 0; r < block.size(0); ++r) {
      bags.row.push_back(data + r * block.stride(0));
      bags.scale.push_back(static_cast<scalar_t>(scales[i]));
    }
  }
  return bags;
}

// Rows to be written are prefetched ahead of their visit (none if `rows` is null).
template <typename scalar_t, typename row_t = scalar_t>
struct Written {
  row_t* rows = nullptr;
  int64_t stride = 0, cols = 0;
  scalar_t* per_row = nullptr;  // one value per row (row-wise optimizer state)
};

// Distinct rows the row-wise updates take at a time (rowwise_row.h's rowwise_adagrad_rows).
constexpr int kUpdateRows = 8;

// Up to kRows distinct rows with their summed gradients (g[i] * scale[i]), handed over together
// so that an update can interleave their arithmetic (rowwise_row.h's rowwise_adagrad_rows).
template <typename scalar_t, int kRows>
struct RowBatch {
  int n = 0;
  int64_t u[kRows];    // the run (distinct id) index
  int64_t row[kRows];  // its row
  const scalar_t* g[kRows];
  scalar_t scale[kRows];
};

// For each distinct id of runs [run_begin, run_end), in order, in batches of up to kRows:
// `visit(batch)`. A row looked up once (the common case for large tables) comes with its bag's
// gradient row itself, not a copy; a repeated row's gradient is summed into a buffer of its own.
template <typename scalar_t, int kRows, typename Visit, typename WrittenRows = Written<scalar_t>>
void for_each_row_batch(const GroupsView& groups, int64_t run_begin, int64_t run_end,
                        const c10::optional<torch::Tensor>& weights,
                        const BagRows<scalar_t>& bags, Visit visit, WrittenRows written = {}) {
  const int64_t cols = bags.cols;
  const scalar_t* weight = weights ? weights->data_ptr<scalar_t>() : nullptr;
  const int64_t* order = groups.order;
  const int64_t* starts = groups.starts;
  const int64_t* bag_of = groups.bags;
  const int64_t* rows = groups.rows;
  const int64_t* selected = groups.runs + run_begin;
  [[maybe_unused]] const bool wide = simd_level() == 2;
  at::parallel_for(0, run_end - run_begin, 256, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> buffer(kRows * cols);
    RowBatch<scalar_t, kRows> batch;
    for (int64_t i = begin; i < end; ++i) {
      if (written.rows != nullptr && i + kPrefetchFar < end) {
        const int64_t far = rows[selected[i + kPrefetchFar]];
        prefetch_row<1>(written.rows + far * written.stride, written.cols);
        if (written.per_row != nullptr) __builtin_prefetch(written.per_row + far, 1, 1);
      }
      if (written.rows != nullptr && i + kPrefetchNear < end) {
        const int64_t near = rows[selected[i + kPrefetchNear]];
        prefetch_row<3>(written.rows + near * written.stride, written.cols);
        if (written.per_row != nullptr) __builtin_prefetch(written.per_row + near, 1, 3);
        // its (first) bag's gradient row, read at random among the bags: 8-10% of the update
        prefetch_row_to_read(bags.row_of(bag_of[starts[selected[i + kPrefetchNear]]]), cols);
      }
      const int64_t u = selected[i];
      const int64_t first = starts[u];
      const int slot = batch.n++;
      batch.u[slot] = u;
      batch.row[slot] = rows[u];
      if (starts[u + 1] - first == 1) {
        const int64_t bag = bag_of[first];
        batch.g[slot] = bags.row_of(bag);
        batch.scale[slot] = weight ? weight[order[first]] * bags.scale_of(bag) : bags.scale_of(bag);
      } else {
        scalar_t* __restrict__ row_grad = buffer.data() + slot * cols;
        std::fill(row_grad, row_grad + cols, scalar_t(0));
        for (int64_t k = first; k < starts[u + 1]; ++k) {
          const int64_t bag = bag_of[k];
          const scalar_t w = weight ? weight[order[k]] * bags.scale_of(bag) : bags.scale_of(bag);
          const scalar_t* __restrict__ src = bags.row_of(bag);
#if defined(__x86_64__) && defined(__GNUC__)
          if constexpr (std::is_same_v<scalar_t, float>) {
            if (wide) {
              add_scaled_avx512(row_grad, src, w, cols);
              continue;
            }
          }
#endif
          for (int64_t c = 0; c < cols; ++c) row_grad[c] += w * src[c];
        }
        batch.g[slot] = row_grad;
        batch.scale[slot] = scalar_t(1);
      }
      if (batch.n == kRows || i + 1 == end) {
        visit(static_cast<const RowBatch<scalar_t, kRows>&>(batch));
        batch.n = 0;
      }
    }
  });
}

// For each distinct id of runs [run_begin, run_end), one at a time: `visit(u, row, g, g_scale)`,
// where g * g_scale is the row's summed gradient.
template <typename scalar_t, typename Visit, typename WrittenRows = Written<scalar_t>>
void for_each_row_gradient(const GroupsView& groups, int64_t run_begin, int64_t run_end,
                           const c10::optional<torch::Tensor>& weights,
                           const BagRows<scalar_t>& bags, Visit visit,
                           WrittenRows written = {}) {
  for_each_row_batch<scalar_t, 1>(
      groups, run_begin, run_end, weights, bags,
      [&](const RowBatch<scalar_t, 1>& b) { visit(b.u[0], b.row[0], b.g[0], b.scale[0]); },
      written);
}

}  // namespace
