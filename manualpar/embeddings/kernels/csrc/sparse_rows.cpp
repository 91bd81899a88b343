// CPU kernels of sharded embedding tables, float rows: the gradient of each distinct row
// (duplicate ids summed) and in-place updates of only those rows; and the extension's module,
// which registers the functions of every file of csrc/. Each kernel has a pure-torch twin giving
// the same bits (the GPU path, and the fallback without a compiler); they exist because on CPU
// the torch ops make several passes over randomly addressed rows (gather, update, scatter) where
// one suffices. Loaded by kernels/native.py; called from (manualpar/embeddings/):
//   segment_sum, add_to_rows                  kernels/bags.py (row_gradients, add_to_rows)
//   group_rows                 row_groups.cpp kernels/bags.py, kernels/table_batch.py
//   rowwise_adagrad_update[_rounded]          optim/fused_rowwise.py (rounded: half_rows.cpp)
//   add_to_rows_rounded         half_rows.cpp kernels/rounding.py (half rows)
//   pooled_sum_half           pooled_rows.cpp kernels/half_lookup.py
//   uniform_rows, uniform_rows_at  table_init.cpp  modules/table_init.py
//   split_by_rows, pack_split_rows  split_rows.cpp  step/sender_bags.py
//   sum_squares_versions, set_simd_level      tests (every vector level gives the same bits)
// and raw_ids.cpp, row_io.cpp, row_cache.cpp, table_batch.cpp register their own.
// The float and half row-wise Adagrad updates share rowwise_adagrad_rows (rowwise_row.h), eight
// distinct rows at a time; they differ only in how a row takes its step.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "avx512_rows.h"
#include "kernel_checks.h"
#include "prefetch.h"
#include "row_gradients.h"
#include "row_groups.h"
#include "rowwise_block.h"
#include "rowwise_row.h"

namespace {

template <typename scalar_t>
std::vector<torch::Tensor> segment_sum_impl(const torch::Tensor& ids, const torch::Tensor& lengths,
                                            const c10::optional<torch::Tensor>& weights,
                                            const torch::Tensor& bag_grads, int64_t num_rows,
                                            double scale) {
  TORCH_CHECK(bag_grads.size(0) == lengths.numel(), "one gradient row per bag");
  const Groups grouped = group_ids(ids, lengths, num_rows, 0, lengths.numel());
  const GroupsView groups(grouped);
  const auto bags = bag_rows<scalar_t>({bag_grads}, {scale}, 0);
  const int64_t count = grouped.runs.numel(), cols = bag_grads.size(1);
  auto rows = torch::empty({count}, ids.options());
  auto summed = torch::empty({count, cols}, bag_grads.options());
  int64_t* row_out = rows.data_ptr<int64_t>();
  scalar_t* out = summed.data_ptr<scalar_t>();
  for_each_row_gradient<scalar_t>(
      groups, 0, count, weights, bags,
      [&](int64_t u, int64_t row, const scalar_t* g, scalar_t g_scale) {
        row_out[u] = row;
        scalar_t* __restrict__ dst = out + u * cols;
        for (int64_t c = 0; c < cols; ++c) dst[c] = g_scale * g[c];
      });
  return {rows, summed};
}

template <typename scalar_t>
void add_to_rows_impl(torch::Tensor& tensor, const torch::Tensor& rows, const torch::Tensor& delta,
                      double alpha) {
  const int64_t unique = rows.numel();
  const int64_t cols = tensor.numel() / std::max<int64_t>(tensor.size(0), 1);
  const int64_t* row = rows.data_ptr<int64_t>();
  const scalar_t* src = delta.data_ptr<scalar_t>();
  scalar_t* dst = tensor.data_ptr<scalar_t>();
  const scalar_t a = static_cast<scalar_t>(alpha);
  at::parallel_for(0, unique, 256, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      if (u + kPrefetchFar < end) prefetch_row<1>(dst + row[u + kPrefetchFar] * cols, cols);
      if (u + kPrefetchNear < end) prefetch_row<3>(dst + row[u + kPrefetchNear] * cols, cols);
      scalar_t* d = dst + row[u] * cols;
      const scalar_t* s = src + u * cols;
      for (int64_t c = 0; c < cols; ++c) d[c] += a * s[c];
    }
  });
}

void check_inputs(const torch::Tensor& ids, const torch::Tensor& lengths,
                  const c10::optional<torch::Tensor>& weights, const torch::Tensor& bag_grads) {
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  check_cpu_contiguous(bag_grads, "bag_grads");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong,
              "ids and lengths must be int64");
  if (weights) {
    check_cpu_contiguous(*weights, "weights");
    TORCH_CHECK(weights->scalar_type() == bag_grads.scalar_type(), "weights dtype");
  }
}

}  // namespace

// (distinct rows sorted, (rows, cols) summed gradient of each) from ids, bag lengths, optional
// per-id weights and each bag's gradient, all times `scale`.
std::vector<torch::Tensor> segment_sum(torch::Tensor ids, torch::Tensor lengths,
                                       c10::optional<torch::Tensor> weights,
                                       torch::Tensor bag_grads, int64_t num_rows, double scale) {
  check_inputs(ids, lengths, weights, bag_grads);
  std::vector<torch::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(bag_grads.scalar_type(), "segment_sum", [&] {
    result = segment_sum_impl<scalar_t>(ids, lengths, weights, bag_grads, num_rows, scale);
  });
  return result;
}

// Row-wise Adagrad straight from bag gradients: duplicate ids summed, each distinct row of runs
// [run_begin, run_end) updated once, no (rows, cols) gradient materialized. `blocks` hold the
// gradients of consecutive bags [first_bag, end_bag), all the bags those runs occur in.
void rowwise_adagrad_update(torch::Tensor weight, torch::Tensor state,
                            c10::optional<torch::Tensor> weights, torch::Tensor order,
                            torch::Tensor starts, torch::Tensor bags, torch::Tensor rows,
                            torch::Tensor runs, int64_t run_begin, int64_t run_end,
                            std::vector<torch::Tensor> blocks, std::vector<double> scales,
                            int64_t first_bag, int64_t end_bag, int64_t col_start, double lr,
                            double eps) {
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(state, "state");
  check_groups(order, starts, bags, rows, runs, run_begin, run_end);
  if (weights) {
    check_cpu_contiguous(*weights, "weights");
    TORCH_CHECK(weights->scalar_type() == weight.scalar_type(), "weights dtype");
    TORCH_CHECK(weights->numel() == order.numel(), "one weight per id");
  }
  for (const auto& block : blocks) {
    TORCH_CHECK(block.scalar_type() == weight.scalar_type(), "gradient dtype");
  }
  Groups groups{order, starts, bags, rows, runs};
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "rowwise_adagrad_update", [&] {
    rowwise_adagrad_block<scalar_t, scalar_t>(
        weight, state, weights, groups, blocks, scales, run_begin, run_end, first_bag, end_bag,
        col_start, lr, eps,
        [](scalar_t* w, const scalar_t* g, scalar_t step, int64_t cols, int64_t) {
          subtract_step<scalar_t>(w, g, step, cols);
        });
  });
}

// tensor[rows] += alpha * delta for distinct rows, in place.
void add_to_rows(torch::Tensor tensor, torch::Tensor rows, torch::Tensor delta, double alpha) {
  check_cpu_contiguous(tensor, "tensor");
  check_cpu_contiguous(rows, "rows");
  check_cpu_contiguous(delta, "delta");
  AT_DISPATCH_FLOATING_TYPES(tensor.scalar_type(), "add_to_rows", [&] {
    add_to_rows_impl<scalar_t>(tensor, rows, delta, alpha);
  });
}

// At most `level` from now on (this process); returns the level in effect.
int64_t set_simd_level(int64_t level) {
  simd_limit = static_cast<int>(std::clamp<int64_t>(level, 0, 2));
  return simd_level();
}

// Both versions of the row-wise sum of squares on a float row, for the test that they agree to
// the bit: (portable lanes, AVX lanes or the portable result again where AVX is missing).
std::vector<double> sum_squares_versions(torch::Tensor row) {
  check_cpu_contiguous(row, "row");
  TORCH_CHECK(row.scalar_type() == torch::kFloat, "row must be float32");
  const float* g = row.data_ptr<float>();
  const double portable = sum_squares_lanes(g, row.numel());
  return {portable, sum_squares(g, row.numel())};
}

// the entry points of the other files of csrc/, bound below
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t>
group_rows(torch::Tensor ids, torch::Tensor lengths, int64_t num_rows, int64_t own_begin,
           int64_t own_end);  // row_groups.cpp
void uniform_rows(torch::Tensor out, int64_t key, int64_t row0, int64_t col0, int64_t dim,
                  double bound);  // table_init.cpp
void uniform_rows_at(torch::Tensor out, torch::Tensor slots, torch::Tensor rows, int64_t key,
                     int64_t col0, int64_t dim, double bound);  // table_init.cpp
std::vector<torch::Tensor> split_by_rows(torch::Tensor ids, torch::Tensor lengths,
                                         torch::Tensor row_starts);  // split_rows.cpp
std::vector<torch::Tensor> pack_split_rows(torch::Tensor ids, torch::Tensor lengths,
                                           torch::Tensor row_starts,
                                           torch::Tensor group_order);  // split_rows.cpp
torch::Tensor pooled_sum_half(torch::Tensor weight, torch::Tensor ids, torch::Tensor lengths,
                              c10::optional<torch::Tensor> weights);  // pooled_rows.cpp
void add_to_rows_rounded(torch::Tensor tensor, torch::Tensor rows, torch::Tensor delta,
                         double alpha, bool stochastic, int64_t key, int64_t row_start,
                         int64_t col_start, int64_t dim,
                         c10::optional<torch::Tensor> row_of);  // half_rows.cpp
void rowwise_adagrad_update_rounded(torch::Tensor weight, torch::Tensor state,
                                    c10::optional<torch::Tensor> weights, torch::Tensor order,
                                    torch::Tensor starts, torch::Tensor bags, torch::Tensor rows,
                                    torch::Tensor runs, int64_t run_begin, int64_t run_end,
                                    std::vector<torch::Tensor> blocks, std::vector<double> scales,
                                    int64_t first_bag, int64_t end_bag, int64_t col_start,
                                    double lr, double eps, bool stochastic, int64_t key,
                                    int64_t row_start, int64_t dim,
                                    c10::optional<torch::Tensor> row_of);  // half_rows.cpp
void register_raw_ids(pybind11::module& m);  // raw_ids.cpp
void register_row_io(pybind11::module& m);   // row_io.cpp
void register_row_cache(pybind11::module& m);  // row_cache.cpp
void register_table_batch(pybind11::module& m);  // table_batch.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_raw_ids(m);
  register_row_io(m);
  register_row_cache(m);
  register_table_batch(m);
  m.def("segment_sum", &segment_sum);
  m.def("group_rows", &group_rows);
  m.def("rowwise_adagrad_update", &rowwise_adagrad_update);
  m.def("add_to_rows", &add_to_rows);
  m.def("uniform_rows", &uniform_rows);
  m.def("uniform_rows_at", &uniform_rows_at);
  m.def("split_by_rows", &split_by_rows);
  m.def("pack_split_rows", &pack_split_rows);
  m.def("sum_squares_versions", &sum_squares_versions);
  m.def("set_simd_level", &set_simd_level);
  m.def("pooled_sum_half", &pooled_sum_half);
  m.def("add_to_rows_rounded", &add_to_rows_rounded);
  m.def("rowwise_adagrad_update_rounded", &rowwise_adagrad_update_rounded);
}
