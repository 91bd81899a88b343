// CPU kernels of sharded embedding tables: the gradient of each distinct row (duplicate ids
// summed) and in-place updates of only those rows, float and half (float16, bfloat16) rows, half
// lookups, initial values, and the row-range split of ids. Each has a pure-torch twin giving the
// same bits (the GPU path, and the fallback without a compiler); they exist because on CPU the
// torch ops make several passes over randomly addressed rows (gather, update, scatter) where one
// suffices. Loaded by kernels/native.py; called from (manualpar/embeddings/):
//   segment_sum, group_rows, add_to_rows      kernels/bags.py (row_gradients, group_rows, ...)
//   add_to_rows_rounded                       kernels/rounding.py (half rows)
//   pooled_sum_half                           kernels/half_lookup.py
//   uniform_rows, uniform_rows_at             modules/table_init.py
//   split_by_rows                             step/exchange.py
//   rowwise_adagrad_update[_rounded]          optim/fused_rowwise.py
//   sum_squares_versions                      tests (the AVX and portable sums agree)
// and registers the functions of the other files of csrc/ (raw_ids.cpp, row_io.cpp,
// row_cache.cpp, table_batch.cpp).
// The float and half row-wise Adagrad updates (rowwise_adagrad_row and _rounded) repeat one
// body: a shared template measured 5-15% slower in the update (the kernel benchmark and a
// profiled step), so they stay apart until that is understood.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <tuple>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_rows.h"
#include "avx512_rows.h"
#include "prefetch.h"
#include "rowwise_row.h"

namespace {

// Digits of at most this many bits: keys of up to 26 bits (a table batch's row space of many
// tables, 67M rows) sort in two passes. Fixed 11-bit digits took three passes from 4M keys on:
// grouping 8 tables of 1M rows as one batch measured 2.5x their grouping one table at a time.
constexpr int64_t kMaxRadixBits = 13;

// Positions of `keys` (all in [0, max_key]) ordered by key into `order`, stable: LSD radix sort
// in as few passes as kMaxRadixBits allows, their digits as even as the key's bits split.
void order_by_key(const int64_t* keys, int64_t n, int64_t max_key, int64_t* order) {
  std::vector<int64_t> scratch(n);
  int64_t* current = order;
  int64_t* next = scratch.data();
  for (int64_t i = 0; i < n; ++i) current[i] = i;
  int64_t key_bits = 0;
  while ((max_key >> key_bits) > 0) ++key_bits;
  const int64_t passes = (key_bits + kMaxRadixBits - 1) / kMaxRadixBits;
  const int64_t digit = passes > 0 ? (key_bits + passes - 1) / passes : 1;
  const int64_t buckets = int64_t{1} << digit;
  std::vector<int64_t> counts(buckets);
  for (int64_t shift = 0; (max_key >> shift) > 0; shift += digit) {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++counts[(keys[i] >> shift) & (buckets - 1)];
    int64_t total = 0;
    for (auto& c : counts) {
      const int64_t here = c;
      c = total;
      total += here;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = current[i];
      next[counts[(keys[pos] >> shift) & (buckets - 1)]++] = pos;
    }
    std::swap(current, next);
  }
  if (current != order) std::copy(current, current + n, order);
}

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

torch::Tensor to_tensor(const std::vector<int64_t>& values, const torch::TensorOptions& options) {
  return torch::from_blob(const_cast<int64_t*>(values.data()),
                          {static_cast<int64_t>(values.size())}, options).clone();
}

Groups group_ids(const torch::Tensor& ids, const torch::Tensor& lengths, int64_t num_rows,
                 int64_t own_begin, int64_t own_end) {
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> bag_of(n);
  int64_t filled = 0;
  for (int64_t b = 0; b < lengths.numel(); ++b) {
    TORCH_CHECK(len[b] >= 0 && filled + len[b] <= n, "lengths disagree with ids");
    std::fill(bag_of.begin() + filled, bag_of.begin() + filled + len[b], b);
    filled += len[b];
  }
  TORCH_CHECK(filled == n, "lengths sum to ", filled, " but there are ", n, " ids");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, "id ", id[i], " outside [0, ", num_rows, ")");
  }
  Groups groups;
  groups.order = torch::empty({n}, ids.options());
  groups.bags = torch::empty({n}, ids.options());
  int64_t* order = groups.order.data_ptr<int64_t>();
  int64_t* bags = groups.bags.data_ptr<int64_t>();
  order_by_key(id, n, std::max<int64_t>(num_rows - 1, 0), order);
  std::vector<int64_t> starts, rows, own, rest;
  starts.reserve(n + 1);
  rows.reserve(n);
  own.reserve(n);
  bool only_own = true;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t row = id[order[k]];
    if (k == 0 || row != rows.back()) {
      if (k > 0) (only_own ? own : rest).push_back(static_cast<int64_t>(rows.size()) - 1);
      starts.push_back(k);
      rows.push_back(row);
      only_own = true;
    }
    bags[k] = bag_of[order[k]];
    only_own = only_own && bags[k] >= own_begin && bags[k] < own_end;
  }
  if (n > 0) (only_own ? own : rest).push_back(static_cast<int64_t>(rows.size()) - 1);
  starts.push_back(n);
  groups.num_own = static_cast<int64_t>(own.size());
  own.insert(own.end(), rest.begin(), rest.end());
  groups.starts = to_tensor(starts, ids.options());
  groups.rows = to_tensor(rows, ids.options());
  groups.runs = to_tensor(own, ids.options());
  return groups;
}

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

// For each distinct id of runs [run_begin, run_end): `visit(u, row, g, g_scale)`, where g * g_scale is the row's
// summed gradient. A row looked up once (the common case for large tables) is visited with its
// bag's gradient row itself, not a copy.
template <typename scalar_t, typename Visit, typename WrittenRows = Written<scalar_t>>
void for_each_row_gradient(const GroupsView& groups, int64_t run_begin, int64_t run_end,
                           const c10::optional<torch::Tensor>& weights,
                           const BagRows<scalar_t>& bags, Visit visit,
                           WrittenRows written = {}) {
  const int64_t cols = bags.cols;
  const scalar_t* weight = weights ? weights->data_ptr<scalar_t>() : nullptr;
  const int64_t* order = groups.order;
  const int64_t* starts = groups.starts;
  const int64_t* bag_of = groups.bags;
  const int64_t* rows = groups.rows;
  const int64_t* selected = groups.runs + run_begin;
  [[maybe_unused]] const bool wide = simd_level() == 2;
  at::parallel_for(0, run_end - run_begin, 256, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> buffer(cols);
    scalar_t* __restrict__ row_grad = buffer.data();
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
      if (starts[u + 1] - first == 1) {
        const int64_t bag = bag_of[first];
        visit(u, rows[u], bags.row_of(bag),
              weight ? weight[order[first]] * bags.scale_of(bag) : bags.scale_of(bag));
        continue;
      }
      std::fill(buffer.begin(), buffer.end(), scalar_t(0));
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
      visit(u, rows[u], row_grad, scalar_t(1));
    }
  });
}

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
void rowwise_adagrad_update_impl(torch::Tensor& weight, torch::Tensor& state,
                                 const c10::optional<torch::Tensor>& weights,
                                 const Groups& grouped, const std::vector<torch::Tensor>& blocks,
                                 const std::vector<double>& scales, int64_t run_begin,
                                 int64_t run_end, int64_t first_bag, int64_t end_bag,
                                 int64_t col_start, double lr, double eps) {
  const GroupsView groups(grouped);
  const auto bags = bag_rows<scalar_t>(blocks, scales, first_bag);
  TORCH_CHECK(static_cast<int64_t>(bags.row.size()) == end_bag - first_bag, "gradients given for ",
              bags.row.size(), " bags, but these rows occur in bags ", first_bag, "..",
              end_bag - 1);
  const int64_t full = bags.cols, cols = weight.size(1), stride = weight.stride(0);
  TORCH_CHECK(run_begin == run_end || col_start + cols <= full, "column block outside gradient");
  scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* sum = state.data_ptr<scalar_t>();
  const scalar_t lr_ = static_cast<scalar_t>(lr), eps_ = static_cast<scalar_t>(eps);
  for_each_row_gradient<scalar_t>(
      groups, run_begin, run_end, weights, bags,
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

// (order, starts, bags, rows, runs, num_own): the occurrences of each distinct id (Groups).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t>
group_rows(torch::Tensor ids, torch::Tensor lengths, int64_t num_rows, int64_t own_begin,
           int64_t own_end) {
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong,
              "ids and lengths must be int64");
  Groups g = group_ids(ids, lengths, num_rows, own_begin, own_end);
  return {g.order, g.starts, g.bags, g.rows, g.runs, g.num_own};
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
  for (const auto* t : {&order, &starts, &bags, &rows, &runs}) {
    check_cpu_contiguous(*t, "groups");
  }
  TORCH_CHECK(order.numel() == bags.numel() && starts.numel() == rows.numel() + 1 &&
                  runs.numel() == rows.numel(), "inconsistent groups");
  TORCH_CHECK(0 <= run_begin && run_begin <= run_end && run_end <= runs.numel(),
              "runs outside the groups");
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
    rowwise_adagrad_update_impl<scalar_t>(weight, state, weights, groups, blocks, scales,
                                          run_begin, run_end, first_bag, end_bag, col_start, lr,
                                          eps);
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
inline uint64_t splitmix(uint64_t key, uint64_t counter) {
  uint64_t z = key + counter * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

template <typename scalar_t>
void uniform_row(scalar_t* row, int64_t cols, uint64_t key, uint64_t base, float width,
                 float bound) {
  for (int64_t j = 0; j < cols; ++j) {
    const float u = static_cast<float>(splitmix(key, base + static_cast<uint64_t>(j)) >> 40) *
                    0x1.0p-24f;
    row[j] = static_cast<scalar_t>(u * width - bound);
  }
}

// At most `level` from now on (this process); returns the level in effect.
int64_t set_simd_level(int64_t level) {
  simd_limit = static_cast<int>(std::clamp<int64_t>(level, 0, 2));
  return simd_level();
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same values sixteen at a time where the CPU has AVX-512 (64-bit multiplies in vectors):
// integer steps are exact and the float steps are the same single operations, so the bits agree.
// Initializing a table is mostly this hash and the first touch of its memory.
__attribute__((target("avx512f,avx512dq"))) void uniform_row_avx512(float* row, int64_t cols,
                                                                    uint64_t key, uint64_t base,
                                                                    float width, float bound) {
  const __m512i keys = _mm512_set1_epi64(static_cast<int64_t>(key));
  const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 unit = _mm512_set1_ps(0x1.0p-24f), widths = _mm512_set1_ps(width),
               bounds = _mm512_set1_ps(bound);
  int64_t j = 0;
  for (; j + 16 <= cols; j += 16) {
    const __m512i first = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(base + j)),
                                           lanes);
    const __m512i second = _mm512_add_epi64(first, _mm512_set1_epi64(8));
    // top 24 bits: below 2^24, so exact through int32 and float
    const __m256i low = _mm512_cvtepi64_epi32(_mm512_srli_epi64(splitmix16(keys, first), 40));
    const __m256i high = _mm512_cvtepi64_epi32(_mm512_srli_epi64(splitmix16(keys, second), 40));
    const __m512 u = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1)), unit);
    _mm512_storeu_ps(row + j, _mm512_sub_ps(_mm512_mul_ps(u, widths), bounds));
  }
  uniform_row(row + j, cols - j, key, base + static_cast<uint64_t>(j), width, bound);
}
#endif

template <typename scalar_t>
void uniform_row_fastest(scalar_t* row, int64_t cols, uint64_t key, uint64_t base, float width,
                         float bound) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (simd_level() == 2) return uniform_row_avx512(row, cols, key, base, width, bound);
    if (simd_level() == 1) {
      const int64_t done = uniform_row_avx2(row, cols, key, base, width, bound);
      return uniform_row(row + done, cols - done, key, base + static_cast<uint64_t>(done), width,
                         bound);
    }
  }
#endif
  uniform_row(row, cols, key, base, width, bound);
}

void uniform_rows(torch::Tensor out, int64_t key, int64_t row0, int64_t col0, int64_t dim,
                  double bound) {
  check_cpu_contiguous(out, "out");
  const int64_t rows = out.size(0), cols = out.size(1);
  const float width = static_cast<float>(2 * bound), half = static_cast<float>(bound);
  // half rows: the float32 value rounded to nearest, as torch's copy_ does
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "uniform_rows", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    const uint64_t k = static_cast<uint64_t>(key);
    at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint64_t base = static_cast<uint64_t>((row0 + i) * dim + col0);
        uniform_row_fastest(data + i * cols, cols, k, base, width, half);
      }
    });
  });
}

// The same values for scattered table rows, written into rows `slots` of `out` (the disk
// tier's cache generating rows on first use).
void uniform_rows_at(torch::Tensor out, torch::Tensor slots, torch::Tensor rows, int64_t key,
                     int64_t col0, int64_t dim, double bound) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(slots, "slots");
  check_cpu_contiguous(rows, "rows");
  TORCH_CHECK(out.dim() == 2 && slots.scalar_type() == torch::kLong &&
                  rows.scalar_type() == torch::kLong && slots.numel() == rows.numel(),
              "uniform_rows_at: out (rows, cols), int64 slots and rows of one length");
  const int64_t n = rows.numel(), cols = out.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(slot[k] >= 0 && slot[k] < out.size(0), "uniform_rows_at: slot ", slot[k],
                " outside ", out.size(0), " rows");
  }
  const float width = static_cast<float>(2 * bound), half = static_cast<float>(bound);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "uniform_rows_at", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    const uint64_t k = static_cast<uint64_t>(key);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t base = static_cast<uint64_t>(row[i] * dim + col0);
      uniform_row_fastest(data + slot[i] * cols, cols, k, base, width, half);
    }
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

// Both versions of the row-wise sum of squares on a float row, for the test that they agree to
// the bit: (portable lanes, AVX lanes or the portable result again where AVX is missing).
std::vector<double> sum_squares_versions(torch::Tensor row) {
  check_cpu_contiguous(row, "row");
  TORCH_CHECK(row.scalar_type() == torch::kFloat, "row must be float32");
  const float* g = row.data_ptr<float>();
  const double portable = sum_squares_lanes(g, row.numel());
  return {portable, sum_squares(g, row.numel())};
}

// Half-precision rows (float16, bfloat16): lookups sum in float32 and updates compute in float32,
// then round back to the rows' dtype, to nearest or (bfloat16 by default) stochastically: 16
// random bits, from a splitmix64 hash of (key, global index / 4), the global index being
// row * dim + column, are added below the kept bits before truncation, as FBGEMM does. One hash
// serves 4 elements (a 16-bit word each): hashing was most of a bfloat16 update's extra cost. The bits do not depend on the plan, and the torch
// path (rounding.py) gives the same ones.
namespace {

struct Rounding {
  bool stochastic = false;
  uint64_t key = 0;
  int64_t row_start = 0, col_start = 0, dim = 0;
  // the block row each row of the tensor holds (a disk tier's cache slots), or none: the same
  const int64_t* row_of = nullptr;
  int64_t table_row(int64_t row) const { return row_start + (row_of ? row_of[row] : row); }
};

// A Rounding for a tensor whose rows hold the block rows `row_of` (if given, one per row).
Rounding make_rounding(bool stochastic, int64_t key, int64_t row_start, int64_t col_start,
                       int64_t dim, const c10::optional<torch::Tensor>& row_of,
                       int64_t tensor_rows) {
  Rounding r{stochastic, static_cast<uint64_t>(key), row_start, col_start, dim};
  if (row_of) {
    TORCH_CHECK(row_of->device().is_cpu() && row_of->is_contiguous() &&
                    row_of->scalar_type() == torch::kLong && row_of->numel() == tensor_rows,
                "row_of must be a contiguous CPU int64 tensor with one entry per row");
    r.row_of = row_of->data_ptr<int64_t>();
  }
  return r;
}

template <typename weight_t>
inline weight_t round_value(float x, const Rounding& r, int64_t row, int64_t col) {
  if constexpr (std::is_same_v<weight_t, at::BFloat16>) {
    if (r.stochastic) {
      // one hash per 4 elements: element i takes 16-bit word i % 4 of the hash of i / 4
      const uint64_t index = static_cast<uint64_t>(r.table_row(row) * r.dim + r.col_start + col);
      const uint32_t noise =
          static_cast<uint32_t>(splitmix(r.key, index >> 2) >> (16 * (index & 3))) & 0xFFFFu;
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      bits = (bits + noise) & 0xFFFF0000u;
      float kept;
      std::memcpy(&kept, &bits, sizeof kept);
      return weight_t(kept);  // exact: the low 16 bits are zero
    }
  }
  return static_cast<weight_t>(x);  // round to nearest even, as torch's .to()
}

#if defined(__x86_64__) && defined(__GNUC__)
// float16 <-> float32 eight at a time where the CPU has F16C (chosen at run time, as the AVX
// sums above): the portable conversion is a bit-by-bit routine, about 5x slower per step of a
// float16 table. Both are IEEE conversions (exact one way, to nearest even the other).
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const at::Half* src, float* dst,
                                                             int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
    _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(packed));
  }
  for (; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, at::Half* dst,
                                                             int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m128i packed =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c), packed);
  }
  for (; c < n; ++c) dst[c] = static_cast<at::Half>(src[c]);
}

inline bool has_f16c() {
  static const bool found = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return found;
}
#endif

// A half row widened to float32.
template <typename weight_t>
inline void load_row(const weight_t* __restrict__ src, float* __restrict__ dst, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<weight_t, at::Half>) {
    if (has_f16c()) return half_to_float_f16c(src, dst, n);
  }
#endif
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}

// float32 results rounded into a half row (`row`: the local row, for the stochastic bits).
template <typename weight_t>
inline void store_row(const float* __restrict__ src, weight_t* __restrict__ dst, int64_t n,
                      const Rounding& r, int64_t row) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<weight_t, at::Half>) {
    if (has_f16c()) return float_to_half_f16c(src, dst, n);
  }
#endif
  for (int64_t c = 0; c < n; ++c) dst[c] = round_value<weight_t>(src[c], r, row, c);
}

// A float32 scratch row per thread (the kernels' rows are at most a few thousand wide).
inline float* scratch_row(int64_t cols) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < cols) buffer.resize(cols);
  return buffer.data();
}

// acc += row (times scale if `scaled`), in float32.
template <typename weight_t>
inline void accumulate_row(const weight_t* __restrict__ row, float* __restrict__ acc, int64_t n,
                           float scale, bool scaled) {
  int64_t c = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (simd_level() == 2) c = accumulate_avx512(row, acc, n, scale, scaled);
  if (simd_level() == 1) c = accumulate_avx2(row, acc, n, scale, scaled);
#endif
  if (c == n) return;
  float* __restrict__ widened = scratch_row(n);
  load_row(row + c, widened, n - c);
  if (scaled) {
    for (int64_t k = 0; k < n - c; ++k) acc[c + k] += scale * widened[k];
  } else {
    for (int64_t k = 0; k < n - c; ++k) acc[c + k] += widened[k];
  }
}

// w = round(w + a * src) on one half row (local `row`, for the stochastic bits).
template <typename weight_t>
inline void axpy_round_row(weight_t* __restrict__ w, const float* __restrict__ src, float a,
                           int64_t n, const Rounding& r, int64_t row) {
  int64_t c = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  const bool draws = std::is_same_v<weight_t, at::BFloat16> && r.stochastic;
  if (simd_level() > 0 && (draws || std::is_same_v<weight_t, at::Half>)) {
    const uint64_t base = static_cast<uint64_t>(r.table_row(row) * r.dim + r.col_start);
    c = simd_level() == 2 ? axpy_round_avx512(w, src, a, n, r.key, base)
                          : axpy_round_avx2(w, src, a, n, r.key, base);
  }
#endif
  if (c == n) return;
  float* __restrict__ values = scratch_row(n);
  load_row(w + c, values, n - c);
  for (int64_t k = 0; k < n - c; ++k) values[k] = values[k] + a * src[c + k];
  // store_row counts columns from its first element: shift the block's start by c
  Rounding shifted = r;
  shifted.col_start += c;
  store_row(values, w + c, n - c, shifted, row);
}

// out[b] = sum over bag b's ids of weight[id] (times its per-id weight), in float32, in id order.
template <typename weight_t>
torch::Tensor pooled_sum_half_impl(const torch::Tensor& weight, const torch::Tensor& ids,
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

// rowwise_adagrad_row on half rows: the same float32 arithmetic, each result rounded back.
template <typename weight_t>
inline void rowwise_adagrad_row_rounded(weight_t* __restrict__ w, float* sum, const float* g,
                                        float g_scale, int64_t full, int64_t col_start,
                                        int64_t cols, float lr, float eps, const Rounding& r,
                                        int64_t row) {
  const double squares = sum_squares(g, full);
  const double scaled = static_cast<double>(g_scale);
  const float total =
      *sum + static_cast<float>(squares * scaled * scaled / static_cast<double>(full));
  *sum = total;
  const float step = lr * g_scale / (std::sqrt(total) + eps);
  // w - step * g, as w + (-step) * g: the same bits (negation is exact)
  axpy_round_row(w, g + col_start, -step, cols, r, row);
}

template <typename weight_t>
void rowwise_adagrad_rounded_impl(torch::Tensor& weight, torch::Tensor& state,
                                  const c10::optional<torch::Tensor>& weights,
                                  const Groups& grouped, const std::vector<torch::Tensor>& blocks,
                                  const std::vector<double>& scales, int64_t run_begin,
                                  int64_t run_end, int64_t first_bag, int64_t end_bag,
                                  int64_t col_start, double lr, double eps, const Rounding& r) {
  const GroupsView groups(grouped);
  const auto bags = bag_rows<float>(blocks, scales, first_bag);
  TORCH_CHECK(static_cast<int64_t>(bags.row.size()) == end_bag - first_bag, "gradients given for ",
              bags.row.size(), " bags, but these rows occur in bags ", first_bag, "..",
              end_bag - 1);
  const int64_t full = bags.cols, cols = weight.size(1), stride = weight.stride(0);
  TORCH_CHECK(run_begin == run_end || col_start + cols <= full, "column block outside gradient");
  weight_t* w = weight.data_ptr<weight_t>();
  float* sum = state.data_ptr<float>();
  const float lr_ = static_cast<float>(lr), eps_ = static_cast<float>(eps);
  for_each_row_gradient<float>(
      groups, run_begin, run_end, weights, bags,
      [&](int64_t, int64_t row, const float* g, float g_scale) {
        rowwise_adagrad_row_rounded<weight_t>(w + row * stride, sum + row, g, g_scale, full,
                                              col_start, cols, lr_, eps_, r, row);
      },
      Written<float, weight_t>{w, stride, cols, sum});
}

void check_half_rows(const torch::Tensor& weight) {
  check_cpu_contiguous(weight, "rows");
  TORCH_CHECK(weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16,
              "rows must be float16 or bfloat16");
}

void check_float(const torch::Tensor& t, const char* what) {
  check_cpu_contiguous(t, what);
  TORCH_CHECK(t.scalar_type() == torch::kFloat, what, " must be float32");
}

}  // namespace

// (bags, cols) float32 sums of half rows: see pooled_sum_half_impl.
torch::Tensor pooled_sum_half(torch::Tensor weight, torch::Tensor ids, torch::Tensor lengths,
                              c10::optional<torch::Tensor> weights) {
  check_half_rows(weight);
  check_cpu_contiguous(ids, "ids");
  check_cpu_contiguous(lengths, "lengths");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong,
              "ids and lengths must be int64");
  if (weights) {
    check_float(*weights, "weights");
    TORCH_CHECK(weights->numel() == ids.numel(), "one weight per id");
  }
  torch::Tensor out;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(weight.scalar_type(), "pooled_sum_half", [&] {
    out = pooled_sum_half_impl<scalar_t>(weight, ids, lengths, weights);
  });
  return out;
}

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
  for (const auto* t : {&order, &starts, &bags, &rows, &runs}) {
    check_cpu_contiguous(*t, "groups");
  }
  TORCH_CHECK(order.numel() == bags.numel() && starts.numel() == rows.numel() + 1 &&
                  runs.numel() == rows.numel(), "inconsistent groups");
  TORCH_CHECK(0 <= run_begin && run_begin <= run_end && run_end <= runs.numel(),
              "runs outside the groups");
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
    rowwise_adagrad_rounded_impl<scalar_t>(weight, state, weights, groups, blocks, scales,
                                           run_begin, run_end, first_bag, end_bag, col_start, lr,
                                           eps, r);
  });
}

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
  m.def("sum_squares_versions", &sum_squares_versions);
  m.def("set_simd_level", &set_simd_level);
  m.def("pooled_sum_half", &pooled_sum_half);
  m.def("add_to_rows_rounded", &add_to_rows_rounded);
  m.def("rowwise_adagrad_update_rounded", &rowwise_adagrad_update_rounded);
}
