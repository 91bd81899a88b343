// The table-batched row-wise Adagrad update (table_batch.cpp's rowwise_adagrad_update_tables):
// the gradient blocks found by bag, one table's runs of rows, and the walk over every table's
// runs. Each row is summed and updated with the operations, in the order, of the one-table
// kernel (sparse_rows.cpp, rowwise_row.h), so a batched step gives the same bits. Included by
// table_batch.cpp only.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "rowwise_row.h"

namespace table_batch_update {

inline void check_rows(const torch::Tensor& t, torch::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1 && t.scalar_type() == dtype,
              what, " must be 2-D CPU tensors of one floating dtype with contiguous rows");
}

// Gradient rows are prefetched this many distinct rows ahead: they lie at random in the step's
// output gradient (megabytes, in the outer caches), and the first read of each measured about a
// third of the update's time before.
constexpr int64_t kPrefetchGrad = 8;

// The lookup keeps about this many cache lines of rows in flight (64 ids ahead at 64-byte
// rows): 26 tables of 200k x 16 took 0.57-0.59x the time of 16 ids ahead (48: 0.63, 96: 0.57).
constexpr int64_t kPoolLinesAhead = 64;

// The gradient blocks of a pass, each over consecutive bags [begin, end) (their widths may
// differ: one table's bags each), found by bag. Each update loop keeps the last two blocks it
// found: a table's rows take their bags from one block per sender, so nearly every lookup is
// a hit. Per-bag tables of pointers, widths and scales (1 MB for 53k bags) measured slower:
// building them cost a pass over every bag, and each row read them at random.
template <typename scalar_t>
struct GradBlock {
  int64_t begin, end;
  const scalar_t* data;
  int64_t stride, width;
  scalar_t scale;
};

template <typename scalar_t>
struct GradBlocks {
  std::vector<GradBlock<scalar_t>> blocks;
  int64_t first = 0, end = 0;

  // The block of bag b (a batch index), or nullptr.
  const GradBlock<scalar_t>* search(int64_t b) const {
    auto it = std::upper_bound(blocks.begin(), blocks.end(), b,
                               [](int64_t v, const GradBlock<scalar_t>& g) { return v < g.begin; });
    if (it == blocks.begin()) return nullptr;
    --it;
    return b < it->end ? &*it : nullptr;
  }
};

template <typename scalar_t>
GradBlocks<scalar_t> grad_blocks(const std::vector<torch::Tensor>& blocks,
                                 const std::vector<double>& scales, int64_t first_bag,
                                 torch::ScalarType dtype) {
  TORCH_CHECK(blocks.size() == scales.size(), "one scale per gradient block");
  GradBlocks<scalar_t> out;
  out.first = out.end = first_bag;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const torch::Tensor& block = blocks[i];
    check_rows(block, dtype, "gradient blocks");
    const int64_t rows = block.size(0);
    if (rows) {
      out.blocks.push_back({out.end, out.end + rows, block.data_ptr<scalar_t>(), block.stride(0),
                            block.size(1), static_cast<scalar_t>(scales[i])});
    }
    out.end += rows;
  }
  return out;
}

// The two blocks an update loop found last.
template <typename scalar_t>
struct BlockCache {
  const GradBlocks<scalar_t>& all;
  const GradBlock<scalar_t>* last[2] = {nullptr, nullptr};

  const GradBlock<scalar_t>* find(int64_t b) {
    for (const auto* g : last) {
      if (g && g->begin <= b && b < g->end) return g;
    }
    const GradBlock<scalar_t>* g = all.search(b);
    if (g) {
      last[1] = last[0];
      last[0] = g;
    }
    return g;
  }
};

// One table's tensors as the update loop reads them.
template <typename scalar_t>
struct TableRows {
  scalar_t* weight;
  scalar_t* state;
  int64_t stride, cols, full, col_start, row_offset;
};

// What an update loop over one table's runs reads besides the table.
template <typename scalar_t>
struct RunInputs {
  const int64_t *selected, *ord, *start, *bag_of, *key;
  const scalar_t* weight;  // per-id weights or nullptr
  const GradBlocks<scalar_t>* grads;
  scalar_t lr, eps;
};

// The vector level a loop below is compiled for: 0 portable, 1 AVX, 2 AVX-512 (simd_level).
template <typename scalar_t, int kLevel>
inline double row_squares(const scalar_t* g, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kLevel == 1 && std::is_same_v<scalar_t, float>) return sum_squares_avx(g, n);
#endif
  return sum_squares(g, n);
}

// The row update from its gradient g * g_scale: at level 2 the one-table kernel's own AVX-512
// row (rowwise_row.h dispatches there), else rowwise_adagrad_row_from with the level's sum.
template <typename scalar_t, int kLevel>
__attribute__((always_inline)) inline void update_row(scalar_t* __restrict__ w, scalar_t* sum,
                                                      const scalar_t* __restrict__ g,
                                                      scalar_t g_scale, int64_t full,
                                                      int64_t col_start, int64_t cols,
                                                      scalar_t lr, scalar_t eps) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kLevel == 2 && std::is_same_v<scalar_t, float>) {
    return rowwise_adagrad_row_avx512(w, sum, g, g_scale, full, col_start, cols, lr, eps);
  }
#endif
  rowwise_adagrad_row_from<scalar_t>(w, sum, g, row_squares<scalar_t, kLevel>(g, full), g_scale,
                                     full, col_start, cols, lr, eps);
}

// acc += s * src over a repeated row's bags, as for_each_row_gradient (row_gradients.h) adds.
template <typename scalar_t, int kLevel>
__attribute__((always_inline)) inline void add_scaled(scalar_t* __restrict__ acc,
                                                      const scalar_t* __restrict__ src,
                                                      scalar_t s, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kLevel == 2 && std::is_same_v<scalar_t, float>) {
    return add_scaled_avx512(acc, src, s, n);
  }
#endif
  for (int64_t c = 0; c < n; ++c) acc[c] += s * src[c];
}

// Rows of the gradient buffer of an update loop (a group's repeated rows each sum into one).
constexpr int64_t kRowGradRows = 8;

// A run's gradient: g * scale, g one bag's gradient row or the sum over the run's bags.
template <typename scalar_t>
struct RunGradient {
  const scalar_t* g;
  scalar_t scale;
  int64_t row;  // within the table
};

#if defined(__x86_64__) && defined(__GNUC__)
// At level 2, where the gradient width is a multiple of 8, rows are updated kRowGradRows at a
// time: the group's states and steps by the one-table kernel's rowwise_steps8_avx512
// (avx512_rows.h: eight rows' sums of squares side by side, then their states and steps as
// vectors; the same bits as one row at a time), then each row written. One row's update is a
// chain of dependent operations (its gradient's load, the sum, a division, a square root,
// another division) that kept the loop waiting one row at a time.
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) inline void update_group_avx512(
    float* __restrict__ w, float* __restrict__ sum, int64_t stride, const RunGradient<float>* rg,
    int64_t full, int64_t col_start, int64_t cols, float lr, float eps) {
  const float* g[kRowGradRows];
  float scale[kRowGradRows], step[kRowGradRows];
  int64_t row[kRowGradRows];
  for (int64_t r = 0; r < kRowGradRows; ++r) {
    g[r] = rg[r].g;
    scale[r] = rg[r].scale;
    row[r] = rg[r].row;
  }
  rowwise_steps8_avx512(g, scale, row, kRowGradRows, full, sum, lr, eps, step);
  for (int64_t r = 0; r < kRowGradRows; ++r) {
    sub_scaled_avx512(w + row[r] * stride, g[r] + col_start, step[r], cols);
  }
}
#endif

// The runs [first, last) of one table's rows: each distinct row's gradient summed from its
// bags as the one-table kernel sums it (sparse_rows.cpp, for_each_row_gradient, same
// prefetches), then the row-wise Adagrad row (at level 2 kRowGradRows rows at a time). The
// table's fields are locals here: read from memory per row, the update measured about 1.5x
// slower. `row_grad`: kRowGradRows rows of `full` values.
template <typename scalar_t, int kLevel>
__attribute__((always_inline)) inline void table_runs_body(const TableRows<scalar_t>& tr,
                                                           const RunInputs<scalar_t>& in,
                                                           int64_t first, int64_t last,
                                                           scalar_t* __restrict__ row_grad) {
  scalar_t* const w = tr.weight;
  scalar_t* const sum = tr.state;
  const int64_t stride = tr.stride, cols = tr.cols, full = tr.full, col_start = tr.col_start;
  const int64_t offset = tr.row_offset;
  const int64_t *selected = in.selected, *start = in.start, *bag_of = in.bag_of, *key = in.key;
  BlockCache<scalar_t> blocks{*in.grads}, ahead{*in.grads};
  auto block_of = [&](int64_t bag) {
    const GradBlock<scalar_t>* g = blocks.find(bag);
    TORCH_CHECK(g && g->width == full, "the gradient of bag ", bag, " is missing or not ", full,
                " wide");
    return g;
  };
  // run i's prefetches ahead, then its gradient (summed into `buf` if it has several bags)
  auto gradient = [&](int64_t i, scalar_t* __restrict__ buf) -> RunGradient<scalar_t> {
    if (i + kPrefetchFar < last) {  // the row and its state: both read at random
      const int64_t far = key[selected[i + kPrefetchFar]] - offset;
      prefetch_row<1>(w + far * stride, cols);
      __builtin_prefetch(sum + far, 1, 1);
    }
    if (i + kPrefetchNear < last) {
      const int64_t near = key[selected[i + kPrefetchNear]] - offset;
      prefetch_row<3>(w + near * stride, cols);
      __builtin_prefetch(sum + near, 1, 3);
    }
    if (i + kPrefetchGrad < last) {  // its (first) bag's gradient row, read at random
      const int64_t bag = bag_of[start[selected[i + kPrefetchGrad]]];
      if (const GradBlock<scalar_t>* g = ahead.find(bag)) {
        prefetch_row_to_read(g->data + (bag - g->begin) * g->stride, g->width);
      }
    }
    const int64_t u = selected[i];
    const int64_t row = key[u] - offset;
    if (start[u + 1] - start[u] == 1) {  // looked up once: its bag's gradient row itself
      const int64_t k = start[u], bag = bag_of[k];
      const GradBlock<scalar_t>* g = block_of(bag);
      const scalar_t g_scale = in.weight ? in.weight[in.ord[k]] * g->scale : g->scale;
      return {g->data + (bag - g->begin) * g->stride, g_scale, row};
    }
    std::fill(buf, buf + full, scalar_t(0));
    for (int64_t k = start[u]; k < start[u + 1]; ++k) {
      const int64_t bag = bag_of[k];
      const GradBlock<scalar_t>* g = block_of(bag);
      const scalar_t s = in.weight ? in.weight[in.ord[k]] * g->scale : g->scale;
      const scalar_t* __restrict__ src = g->data + (bag - g->begin) * g->stride;
      add_scaled<scalar_t, kLevel>(buf, src, s, full);
    }
    return {buf, scalar_t(1), row};
  };
  // the first runs' rows and states are asked for at once: without this, the first
  // kPrefetchFar runs of every table's stretch waited for memory one by one. With the state
  // prefetched far ahead too (its line was read at random only kPrefetchNear runs ahead, most
  // of the loop's stalls), the update of 26 tables of 200k x 16 took 0.73-0.78x the time.
  for (int64_t k = first; k < std::min(last, first + kPrefetchFar); ++k) {
    const int64_t row = key[selected[k]] - offset;
    prefetch_row<1>(w + row * stride, cols);
    __builtin_prefetch(sum + row, 1, 1);
  }
  int64_t i = first;
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kLevel == 2 && std::is_same_v<scalar_t, float>) {
    RunGradient<float> group[kRowGradRows];
    for (; full % 8 == 0 && i + kRowGradRows <= last; i += kRowGradRows) {
      for (int64_t r = 0; r < kRowGradRows; ++r) group[r] = gradient(i + r, row_grad + r * full);
      update_group_avx512(w, sum, stride, group, full, col_start, cols, in.lr, in.eps);
    }
  }
#endif
  for (; i < last; ++i) {
    const RunGradient<scalar_t> g = gradient(i, row_grad);
    update_row<scalar_t, kLevel>(w + g.row * stride, sum + g.row, g.g, g.scale, full, col_start,
                                 cols, in.lr, in.eps);
  }
}

template <typename scalar_t>
void table_runs_plain(const TableRows<scalar_t>& tr, const RunInputs<scalar_t>& in,
                      int64_t first, int64_t last, scalar_t* row_grad) {
  table_runs_body<scalar_t, 0>(tr, in, first, last, row_grad);
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same loop compiled for AVX (chosen at run time, as sum_squares is): no FMA (the library
// builds with -ffp-contract=off, and AVX has none), so the same bits.
__attribute__((target("avx"))) inline void table_runs_avx(const TableRows<float>& tr,
                                                   const RunInputs<float>& in, int64_t first,
                                                   int64_t last, float* row_grad) {
  table_runs_body<float, 1>(tr, in, first, last, row_grad);
}

// And for AVX-512, with the one-table kernel's AVX-512 row update and sums (avx512_rows.h).
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) inline void table_runs_avx512(
    const TableRows<float>& tr, const RunInputs<float>& in, int64_t first, int64_t last,
    float* row_grad) {
  table_runs_body<float, 2>(tr, in, first, last, row_grad);
}
#endif

template <typename scalar_t>
void rowwise_adagrad_table_runs(const TableRows<scalar_t>& tr, const RunInputs<scalar_t>& in,
                                int64_t begin, int64_t end) {
  at::parallel_for(begin, end, 256, [&](int64_t first, int64_t last) {
    std::vector<scalar_t> buffer(kRowGradRows * tr.full);
#if defined(__x86_64__) && defined(__GNUC__)
    if constexpr (std::is_same_v<scalar_t, float>) {
      static const bool avx = __builtin_cpu_supports("avx");
      if (simd_level() == 2) return table_runs_avx512(tr, in, first, last, buffer.data());
      if (avx && simd_limit > 0) return table_runs_avx(tr, in, first, last, buffer.data());
    }
#endif
    table_runs_plain<scalar_t>(tr, in, first, last, buffer.data());
  });
}

// Row-wise Adagrad over the runs [run_begin, run_end) of groups made over keys (row_offsets[t]
// + the row of table t). Runs ascend by key within each pass, so one table's runs are
// consecutive: each such stretch goes to rowwise_adagrad_table_runs.
template <typename scalar_t>
void rowwise_adagrad_tables_impl(const std::vector<TableRows<scalar_t>>& tables,
                                 const std::vector<int64_t>& offsets,
                                 const RunInputs<scalar_t>& in, int64_t run_begin,
                                 int64_t run_end) {
  const int64_t *key = in.key, *selected = in.selected;
  const int64_t last_table = static_cast<int64_t>(offsets.size()) - 2;
  int64_t i = run_begin;
  while (i < run_end) {
    const int64_t first_key = key[selected[i]];
    const int64_t t =
        std::min<int64_t>(std::upper_bound(offsets.begin(), offsets.end(), first_key) -
                              offsets.begin() - 1,
                          last_table);
    int64_t j = i + 1;
    while (j < run_end && key[selected[j]] < offsets[t + 1] && key[selected[j]] >= offsets[t]) {
      ++j;
    }
    rowwise_adagrad_table_runs<scalar_t>(tables[t], in, i, j);
    i = j;
  }
}

}  // namespace table_batch_update
