// Pooled lookups of half-precision rows (kernels/half_lookup.py): a bag's rows widened to float32
// as they are read and summed in float32, in id order, from +0. (Float rows keep embedding_bag:
// this loop over float rows, each bag's sum in registers and its output row written once, gave
// embedding_bag's bits but measured 1.2-1.25x its time on 1M x 64 rows, AVX-512.)
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "avx2_rows.h"
#include "avx512_rows.h"
#include "half_rows.h"
#include "kernel_checks.h"
#include "prefetch.h"

namespace {

// out[b] = sum over bag b's ids of weight[id] (times its per-id weight), in float32, in id order.
template <typename weight_t>
torch::Tensor pooled_sum_impl(const torch::Tensor& weight, const torch::Tensor& ids,
                              const torch::Tensor& lengths,
                              const c10::optional<torch::Tensor>& weights) {
  const int64_t bags = lengths.numel(), cols = weight.size(1), num_rows = weight.size(0);
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> start(bags + 1, 0);
  for (int64_t b = 0; b < bags; ++b) {
    TORCH_CHECK(len[b] >= 0, "negative bag length");
    start[b + 1] = start[b] + len[b];
  }
  TORCH_CHECK(start[bags] == n, "lengths sum to ", start[bags], " but there are ", n, " ids");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, "id ", id[i], " outside [0, ", num_rows, ")");
  }
  // the AVX-512 loop writes every element (empty bags too); the others add into zeros
  const auto options = weight.options().dtype(torch::kFloat);
  auto out = simd_level() == 2 ? torch::empty({bags, cols}, options)
                               : torch::zeros({bags, cols}, options);
  const weight_t* w = weight.data_ptr<weight_t>();
  const float* per_id = weights ? weights->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, bags, 64, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd_level() == 2) {
      return pool_bags_avx512(w, cols, id, start.data(), n, per_id, o, begin, end);
    }
    if (simd_level() == 1) {
      return pool_bags_avx2(w, cols, id, start.data(), n, per_id, o, begin, end);
    }
#endif
    for (int64_t b = begin; b < end; ++b) {
      float* __restrict__ acc = o + b * cols;
      for (int64_t k = start[b]; k < start[b + 1]; ++k) {
        if (k + kPrefetchFar < n) prefetch_row<3>(w + id[k + kPrefetchFar] * cols, cols);
        accumulate_row(w + id[k] * cols, acc, cols, per_id ? per_id[k] : 1.0f, per_id != nullptr);
      }
    }
  });
  return out;
}

void check_ids(const torch::Tensor& ids, const torch::Tensor& lengths) {
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong,
              "ids and lengths must be int64");
}

}  // namespace

// (bags, cols) float32 sums of half rows: see pooled_sum_impl.
torch::Tensor pooled_sum_half(torch::Tensor weight, torch::Tensor ids, torch::Tensor lengths,
                              c10::optional<torch::Tensor> weights) {
  check_half_rows(weight);
  check_ids(ids, lengths);
  if (weights) {
    check_float(*weights, "weights");
    TORCH_CHECK(weights->numel() == ids.numel(), "one weight per id");
  }
  torch::Tensor out;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(weight.scalar_type(), "pooled_sum_half", [&] {
    out = pooled_sum_impl<scalar_t>(weight, ids, lengths, weights);
  });
  return out;
}
