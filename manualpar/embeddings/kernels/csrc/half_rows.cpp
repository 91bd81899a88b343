// Updates of half-precision rows (float16, bfloat16): computed in float32 as the float kernels
// compute (sparse_rows.cpp, rowwise_row.h), each result rounded back as half_rows.h says.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "half_rows.h"
#include "kernel_checks.h"
#include "prefetch.h"
#include "row_gradients.h"
#include "row_groups.h"
#include "rowwise_block.h"
#include "rowwise_row.h"

namespace {

template <typename weight_t>
void add_to_rows_rounded_impl(torch::Tensor& tensor, const torch::Tensor& rows,
                              const torch::Tensor& delta, double alpha, const Rounding& r) {
  const int64_t unique = rows.numel();
  const int64_t cols = tensor.numel() / std::max<int64_t>(tensor.size(0), 1);
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* src = delta.data_ptr<float>();
  weight_t* dst = tensor.data_ptr<weight_t>();
  const float a = static_cast<float>(alpha);
  at::parallel_for(0, unique, 256, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      if (u + kPrefetchFar < end) prefetch_row<1>(dst + row[u + kPrefetchFar] * cols, cols);
      if (u + kPrefetchNear < end) prefetch_row<3>(dst + row[u + kPrefetchNear] * cols, cols);
      axpy_round_row(dst + row[u] * cols, src + u * cols, a, cols, r, row[u]);
    }
  });
}

}  // namespace

// tensor[rows] = round(tensor[rows] + alpha * delta) for distinct rows of half `tensor`, float32
// `delta`; `row_start`, `col_start` place the block in its table of width `dim`.
void add_to_rows_rounded(torch::Tensor tensor, torch::Tensor rows, torch::Tensor delta,
                         double alpha, bool stochastic, int64_t key, int64_t row_start,
                         int64_t col_start, int64_t dim, c10::optional<torch::Tensor> row_of) {
  check_half_rows(tensor);
  check_cpu_contiguous(rows, "rows");
  check_float(delta, "delta");
  TORCH_CHECK(delta.numel() == rows.numel() * tensor.size(1), "one delta row per row");
  const Rounding r = make_rounding(stochastic, key, row_start, col_start, dim, row_of,
                                   tensor.size(0));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(tensor.scalar_type(), "add_to_rows_rounded", [&] {
    add_to_rows_rounded_impl<scalar_t>(tensor, rows, delta, alpha, r);
  });
}

// rowwise_adagrad_update on half rows (float32 state and gradients), rounded as above.
void rowwise_adagrad_update_rounded(torch::Tensor weight, torch::Tensor state,
                                    c10::optional<torch::Tensor> weights, torch::Tensor order,
                                    torch::Tensor starts, torch::Tensor bags, torch::Tensor rows,
                                    torch::Tensor runs, int64_t run_begin, int64_t run_end,
                                    std::vector<torch::Tensor> blocks, std::vector<double> scales,
                                    int64_t first_bag, int64_t end_bag, int64_t col_start,
                                    double lr, double eps, bool stochastic, int64_t key,
                                    int64_t row_start, int64_t dim,
                                    c10::optional<torch::Tensor> row_of) {
  check_half_rows(weight);
  check_float(state, "state");
  check_groups(order, starts, bags, rows, runs, run_begin, run_end);
  if (weights) {
    check_float(*weights, "weights");
    TORCH_CHECK(weights->numel() == order.numel(), "one weight per id");
  }
  for (const auto& block : blocks) {
    TORCH_CHECK(block.scalar_type() == torch::kFloat, "gradients must be float32");
  }
  Groups groups{order, starts, bags, rows, runs};
  const Rounding r = make_rounding(stochastic, key, row_start, col_start, dim, row_of,
                                   weight.size(0));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(weight.scalar_type(), "rowwise_adagrad_update_rounded", [&] {
    // the float update's arithmetic, each result rounded back: w - step * g as
    // w + (-step) * g, the same bits (negation is exact)
    rowwise_adagrad_block<float, scalar_t>(
        weight, state, weights, groups, blocks, scales, run_begin, run_end, first_bag, end_bag,
        col_start, lr, eps,
        [&](scalar_t* w, const float* g, float step, int64_t cols, int64_t row) {
          axpy_round_row(w, g, -step, cols, r, row);
        });
  });
}
