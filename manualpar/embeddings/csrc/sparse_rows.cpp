// CPU kernels for the backward of sharded embedding tables: the gradient of each distinct row
// (duplicate ids summed), and in-place updates of only those rows. The pure-torch path in
// kernels.py / optimizers.py computes the same numbers; these exist because on CPU the torch ops
// make several passes over randomly addressed rows (gather, update, scatter) where one suffices.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRadixBits = 11;
// Rows to be written are prefetched in two stages: far ahead into the outer caches (many misses
// in flight), then a few rows ahead into L1 (within its few miss buffers). Measured on a random
// row update: about 1.3x faster than one stage 8 rows ahead.
constexpr int64_t kPrefetchNear = 4;
constexpr int64_t kPrefetchFar = 16;
constexpr int64_t kCacheLine = 64;

// Ask for every cache line of a row that will be written soon; Locality 3: into L1, 1: outer.
template <int Locality, typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t cols) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < cols * static_cast<int64_t>(sizeof(scalar_t));
       offset += kCacheLine) {
    __builtin_prefetch(bytes + offset, 1, Locality);
  }
}

// Positions of `keys` (all in [0, max_key]) ordered by key, stable: LSD radix sort.
std::vector<int64_t> order_by_key(const int64_t* keys, int64_t n, int64_t max_key) {
  std::vector<int64_t> order(n), scratch(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  const int64_t buckets = int64_t{1} << kRadixBits;
  std::vector<int64_t> counts(buckets);
  for (int64_t shift = 0; (max_key >> shift) > 0; shift += kRadixBits) {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++counts[(keys[i] >> shift) & (buckets - 1)];
    int64_t total = 0;
    for (auto& c : counts) {
      const int64_t here = c;
      c = total;
      total += here;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = order[i];
      scratch[counts[(keys[pos] >> shift) & (buckets - 1)]++] = pos;
    }
    order.swap(scratch);
  }
  return order;
}

// Occurrences of each distinct id: positions ordered by id, and where each id's run starts.
struct Groups {
  std::vector<int64_t> bag_of;  // position -> bag
  std::vector<int64_t> order;   // positions sorted by id
  std::vector<int64_t> starts;  // run u is order[starts[u] : starts[u + 1]]
  int64_t size() const { return static_cast<int64_t>(starts.size()) - 1; }
};

Groups group_ids(const torch::Tensor& ids, const torch::Tensor& lengths, int64_t num_rows) {
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  Groups groups;
  groups.bag_of.resize(n);
  int64_t filled = 0;
  for (int64_t b = 0; b < lengths.numel(); ++b) {
    TORCH_CHECK(len[b] >= 0 && filled + len[b] <= n, "lengths disagree with ids");
    std::fill(groups.bag_of.begin() + filled, groups.bag_of.begin() + filled + len[b], b);
    filled += len[b];
  }
  TORCH_CHECK(filled == n, "lengths sum to ", filled, " but there are ", n, " ids");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, "id ", id[i], " outside [0, ", num_rows, ")");
  }
  groups.order = order_by_key(id, n, std::max<int64_t>(num_rows - 1, 0));
  groups.starts.reserve(n + 1);
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || id[groups.order[i]] != id[groups.order[i - 1]]) groups.starts.push_back(i);
  }
  groups.starts.push_back(n);
  return groups;
}

// Rows a visit will write: prefetched a few groups ahead (none if `rows` is null).
template <typename scalar_t>
struct Written {
  scalar_t* rows = nullptr;
  int64_t stride = 0, cols = 0;
  scalar_t* per_row = nullptr;  // one value per row (row-wise optimizer state)
};

// For each distinct id in parallel: `visit(u, row, g, g_scale)`, where g * g_scale is the row's
// summed gradient times `scale`. A row looked up once (the common case for large tables) is
// visited with its bag's gradient row itself, not a copy.
template <typename scalar_t, typename Visit>
void for_each_row_gradient(const Groups& groups, const torch::Tensor& ids,
                           const c10::optional<torch::Tensor>& weights,
                           const torch::Tensor& bag_grads, double scale, Visit visit,
                           Written<scalar_t> written = {}) {
  const int64_t cols = bag_grads.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const scalar_t* grad = bag_grads.data_ptr<scalar_t>();
  const scalar_t* weight = weights ? weights->data_ptr<scalar_t>() : nullptr;
  const scalar_t factor = static_cast<scalar_t>(scale);
  const int64_t* order = groups.order.data();
  const int64_t* starts = groups.starts.data();
  const int64_t* bag_of = groups.bag_of.data();
  at::parallel_for(0, groups.size(), 256, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> buffer(cols);
    scalar_t* __restrict__ row_grad = buffer.data();
    for (int64_t u = begin; u < end; ++u) {
      if (written.rows != nullptr && u + kPrefetchFar < end) {
        const int64_t far = id[order[starts[u + kPrefetchFar]]];
        prefetch_row<1>(written.rows + far * written.stride, written.cols);
      }
      if (written.rows != nullptr && u + kPrefetchNear < end) {
        const int64_t near = id[order[starts[u + kPrefetchNear]]];
        prefetch_row<3>(written.rows + near * written.stride, written.cols);
        if (written.per_row != nullptr) __builtin_prefetch(written.per_row + near, 1, 3);
      }
      const int64_t first = order[starts[u]];
      if (starts[u + 1] - starts[u] == 1) {
        visit(u, id[first], grad + bag_of[first] * cols, weight ? weight[first] * factor : factor);
        continue;
      }
      std::fill(buffer.begin(), buffer.end(), scalar_t(0));
      for (int64_t k = starts[u]; k < starts[u + 1]; ++k) {
        const int64_t pos = order[k];
        const scalar_t w = weight ? weight[pos] * factor : factor;
        const scalar_t* __restrict__ src = grad + bag_of[pos] * cols;
        for (int64_t c = 0; c < cols; ++c) row_grad[c] += w * src[c];
      }
      visit(u, id[first], row_grad, scalar_t(1));
    }
  });
}

template <typename scalar_t>
std::vector<torch::Tensor> segment_sum_impl(const torch::Tensor& ids, const torch::Tensor& lengths,
                                            const c10::optional<torch::Tensor>& weights,
                                            const torch::Tensor& bag_grads, int64_t num_rows,
                                            double scale) {
  const Groups groups = group_ids(ids, lengths, num_rows);
  const int64_t cols = bag_grads.size(1);
  auto rows = torch::empty({groups.size()}, ids.options());
  auto summed = torch::empty({groups.size(), cols}, bag_grads.options());
  int64_t* row_out = rows.data_ptr<int64_t>();
  scalar_t* out = summed.data_ptr<scalar_t>();
  for_each_row_gradient<scalar_t>(
      groups, ids, weights, bag_grads, scale,
      [&](int64_t u, int64_t row, const scalar_t* g, scalar_t g_scale) {
        row_out[u] = row;
        scalar_t* __restrict__ dst = out + u * cols;
        for (int64_t c = 0; c < cols; ++c) dst[c] = g_scale * g[c];
      });
  return {rows, summed};
}

// Exact row-wise Adagrad on one distinct row whose gradient is g * g_scale (full width); the
// block holds columns [col_start, col_start + cols).
template <typename scalar_t>
inline void rowwise_adagrad_row(scalar_t* __restrict__ w, scalar_t* sum, const scalar_t* g,
                                scalar_t g_scale, int64_t full, int64_t col_start, int64_t cols,
                                scalar_t lr, scalar_t eps) {
  // In double (the state is a running sum: its rounding compounds), in independent lanes so the
  // compiler can vectorize the reduction without reassociating it.
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= full; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(g[c + l]) * g[c + l];
  }
  for (; c < full; ++c) lanes[0] += static_cast<double>(g[c]) * g[c];
  double squares = 0;
  for (const double lane : lanes) squares += lane;
  const double scaled = static_cast<double>(g_scale);
  const scalar_t total = *sum + static_cast<scalar_t>(squares * scaled * scaled /
                                                      static_cast<double>(full));
  *sum = total;
  const scalar_t step = lr * g_scale / (std::sqrt(total) + eps);
  const scalar_t* __restrict__ src = g + col_start;
  for (int64_t k = 0; k < cols; ++k) w[k] -= step * src[k];
}

template <typename scalar_t>
void rowwise_adagrad_backward_impl(torch::Tensor& weight, torch::Tensor& state,
                                   const torch::Tensor& ids, const torch::Tensor& lengths,
                                   const c10::optional<torch::Tensor>& weights,
                                   const torch::Tensor& bag_grads, double scale,
                                   int64_t col_start, double lr, double eps) {
  const Groups groups = group_ids(ids, lengths, weight.size(0));
  const int64_t full = bag_grads.size(1), cols = weight.size(1), stride = weight.stride(0);
  scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* sum = state.data_ptr<scalar_t>();
  const scalar_t lr_ = static_cast<scalar_t>(lr), eps_ = static_cast<scalar_t>(eps);
  for_each_row_gradient<scalar_t>(
      groups, ids, weights, bag_grads, scale,
      [&](int64_t, int64_t row, const scalar_t* g, scalar_t g_scale) {
        rowwise_adagrad_row<scalar_t>(w + row * stride, sum + row, g, g_scale, full, col_start,
                                      cols, lr_, eps_);
      },
      Written<scalar_t>{w, stride, cols, sum});
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

void check_cpu_contiguous(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
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

// Row-wise Adagrad straight from bag gradients: duplicate ids summed, each distinct row updated
// once; no (rows, cols) gradient is materialized.
void rowwise_adagrad_backward(torch::Tensor weight, torch::Tensor state, torch::Tensor ids,
                              torch::Tensor lengths, c10::optional<torch::Tensor> weights,
                              torch::Tensor bag_grads, double scale, int64_t col_start, double lr,
                              double eps) {
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(state, "state");
  check_inputs(ids, lengths, weights, bag_grads);
  TORCH_CHECK(col_start + weight.size(1) <= bag_grads.size(1), "column block outside gradient");
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "rowwise_adagrad_backward", [&] {
    rowwise_adagrad_backward_impl<scalar_t>(weight, state, ids, lengths, weights, bag_grads,
                                            scale, col_start, lr, eps);
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

// Initial table values (see table_init.py): out[i][j] = bound * (2u - 1), u the top 24 bits of
// splitmix64's finalizer over key + counter * golden, counter = (row0 + i) * dim + col0 + j.
void uniform_rows(torch::Tensor out, int64_t key, int64_t row0, int64_t col0, int64_t dim,
                  double bound) {
  check_cpu_contiguous(out, "out");
  const int64_t rows = out.size(0), cols = out.size(1);
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "uniform_rows", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    const uint64_t k = static_cast<uint64_t>(key);
    at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint64_t base = static_cast<uint64_t>((row0 + i) * dim + col0);
        scalar_t* row = data + i * cols;
        for (int64_t j = 0; j < cols; ++j) {
          uint64_t z = k + (base + static_cast<uint64_t>(j)) * 0x9E3779B97F4A7C15ULL;
          z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
          z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
          z ^= z >> 31;
          const float u = static_cast<float>(z >> 40) * 0x1.0p-24f;
          row[j] = static_cast<scalar_t>(u * static_cast<float>(2 * bound) -
                                         static_cast<float>(bound));
        }
      }
    });
  });
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("segment_sum", &segment_sum);
  m.def("rowwise_adagrad_backward", &rowwise_adagrad_backward);
  m.def("add_to_rows", &add_to_rows);
  m.def("uniform_rows", &uniform_rows);
  m.def("split_by_rows", &split_by_rows);
}
