// Argument checks shared by the kernels' entry points (sparse_rows.cpp, row_groups.cpp,
// half_rows.cpp, pooled_rows.cpp, table_init.cpp, split_rows.cpp).
#pragma once

#include <torch/extension.h>

inline void check_cpu_contiguous(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
}

inline void check_float(const torch::Tensor& t, const char* what) {
  check_cpu_contiguous(t, what);
  TORCH_CHECK(t.scalar_type() == torch::kFloat, what, " must be float32");
}

inline void check_half_rows(const torch::Tensor& weight) {
  check_cpu_contiguous(weight, "rows");
  TORCH_CHECK(weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16,
              "rows must be float16 or bfloat16");
}

// The groups' five tensors (row_groups.h) as an update kernel takes them, and its run range.
inline void check_groups(const torch::Tensor& order, const torch::Tensor& starts,
                         const torch::Tensor& bags, const torch::Tensor& rows,
                         const torch::Tensor& runs, int64_t run_begin, int64_t run_end) {
  for (const auto* t : {&order, &starts, &bags, &rows, &runs}) {
    check_cpu_contiguous(*t, "groups");
  }
  TORCH_CHECK(order.numel() == bags.numel() && starts.numel() == rows.numel() + 1 &&
                  runs.numel() == rows.numel(), "inconsistent groups");
  TORCH_CHECK(0 <= run_begin && run_begin <= run_end && run_end <= runs.numel(),
              "runs outside the groups");
}
