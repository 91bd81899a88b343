// Table-batched kernels: one call looks up, or updates, the blocks of every table of a step (a
// rank may hold dozens of small tables; one call each costs more than their rows). The bags of
// all tables lie in one batch, in the order of the exchange (sender, then table); a segment
// names the table of a run of consecutive bags and, for the lookup, where its pooled rows go.
// Each table keeps its own tensors. The arithmetic of every bag and every row is that of the
// one-table kernels (torch's embedding_bag for the sums, rowwise_row.h for the update), in the
// same order, so a batched step gives the same bits as one call per table. Loaded by
// kernels/native.py; called from kernels/table_batch.py.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "rowwise_row.h"

namespace {

// Gradient rows are prefetched this many distinct rows ahead: they lie at random in the step's
// output gradient (megabytes, in the outer caches), and the first read of each measured about a
// third of the update's time before.
constexpr int64_t kPrefetchGrad = 8;

// A segment: (table, first bag, end bag, output, first element, row stride): bag b's pooled
// row is added at outs[output][first element + (b - first bag) * row stride ...].
constexpr int64_t kSegmentFields = 6;

struct Segment {
  int64_t table, bag_begin, bag_end, out, offset, stride;
};

std::vector<Segment> read_segments(const torch::Tensor& segments, int64_t tables, int64_t bags) {
  TORCH_CHECK(segments.device().is_cpu() && segments.is_contiguous() &&
                  segments.scalar_type() == torch::kLong && segments.dim() == 2 &&
                  segments.size(1) == kSegmentFields,
              "segments must be a contiguous (n, 6) int64 CPU tensor");
  const int64_t* s = segments.data_ptr<int64_t>();
  std::vector<Segment> out(segments.size(0));
  for (size_t i = 0; i < out.size(); ++i, s += kSegmentFields) {
    out[i] = {s[0], s[1], s[2], s[3], s[4], s[5]};
    TORCH_CHECK(0 <= s[0] && s[0] < tables, "segment ", i, ": table ", s[0], " of ", tables);
    TORCH_CHECK(0 <= s[1] && s[1] <= s[2] && s[2] <= bags, "segment ", i, ": bags ", s[1], "..",
                s[2], " outside the ", bags, " bags");
  }
  return out;
}

// Where each bag's ids start (bags + 1 entries), checked against the number of ids.
std::vector<int64_t> bag_starts(const torch::Tensor& lengths, int64_t ids) {
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> starts(lengths.numel() + 1, 0);
  for (int64_t b = 0; b < lengths.numel(); ++b) {
    TORCH_CHECK(len[b] >= 0, "bag ", b, " has a negative length");
    starts[b + 1] = starts[b] + len[b];
  }
  TORCH_CHECK(starts.back() == ids, "lengths sum to ", starts.back(), " but there are ", ids,
              " ids");
  return starts;
}

void check_index(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == torch::kLong,
              what, " must be a contiguous int64 CPU tensor");
}

void check_rows(const torch::Tensor& t, torch::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1 && t.scalar_type() == dtype,
              what, " must be 2-D CPU tensors of one floating dtype with contiguous rows");
}

// Each bag's sum of rows as embedding_bag(mode="sum") computes it (from zero, in id order),
// added into its segment's output.
template <typename scalar_t>
void pool_tables_impl(const std::vector<torch::Tensor>& weights, const torch::Tensor& ids,
                      const std::vector<int64_t>& starts, const std::vector<Segment>& segments,
                      std::vector<torch::Tensor>& outs) {
  const int64_t* id = ids.data_ptr<int64_t>();
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment& seg = segments[s];
    const torch::Tensor& weight = weights[seg.table];
    const int64_t cols = weight.size(1), stride = weight.stride(0), rows = weight.size(0);
    const int64_t bags = seg.bag_end - seg.bag_begin;
    TORCH_CHECK(0 <= seg.out && seg.out < static_cast<int64_t>(outs.size()), "segment ", s,
                ": output ", seg.out, " of ", outs.size());
    TORCH_CHECK(bags == 0 || (seg.offset >= 0 && seg.stride >= cols &&
                              seg.offset + (bags - 1) * seg.stride + cols <= outs[seg.out].numel()),
                "segment ", s, ": its pooled rows lie outside output ", seg.out);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = outs[seg.out].data_ptr<scalar_t>() + seg.offset;
    const int64_t first_id = starts[seg.bag_begin], end_id = starts[seg.bag_end];
    for (int64_t i = first_id; i < end_id; ++i) {
      TORCH_CHECK(0 <= id[i] && id[i] < rows, "id ", id[i], " outside [0, ", rows, ")");
    }
    at::parallel_for(0, bags, 256, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> buffer(cols);
      scalar_t* __restrict__ acc = buffer.data();
      const int64_t last = starts[seg.bag_begin + end];
      for (int64_t b = begin; b < end; ++b) {
        const int64_t bag = seg.bag_begin + b;
        scalar_t* __restrict__ d = dst + b * seg.stride;
        const int64_t first = starts[bag], stop = starts[bag + 1];
        for (int64_t i = first; i < stop && i + kPrefetchFar < last; ++i) {
          prefetch_row_to_read(w + id[i + kPrefetchFar] * stride, cols);
        }
        if (stop - first == 1) {  // one id: the sum is its row
          const scalar_t* __restrict__ src = w + id[first] * stride;
          for (int64_t c = 0; c < cols; ++c) d[c] += scalar_t(0) + src[c];
          continue;
        }
        std::fill(acc, acc + cols, scalar_t(0));
        for (int64_t i = first; i < stop; ++i) {
          const scalar_t* __restrict__ src = w + id[i] * stride;
          for (int64_t c = 0; c < cols; ++c) acc[c] += src[c];
        }
        for (int64_t c = 0; c < cols; ++c) d[c] += acc[c];
      }
    });
  }
}

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

// rowwise_adagrad_row (rowwise_row.h) from the row's sum of squares, the same operations in
// the same order: kept beside it so that the loop below can take the sum from its inlined AVX
// version (a call per row to the dispatching one cost about 5% of the update).
template <typename scalar_t>
inline void rowwise_adagrad_row_from(scalar_t* __restrict__ w, scalar_t* sum,
                                     const scalar_t* __restrict__ g, double squares,
                                     scalar_t g_scale, int64_t full, int64_t col_start,
                                     int64_t cols, scalar_t lr, scalar_t eps) {
  const double scaled = static_cast<double>(g_scale);
  const scalar_t total = *sum + static_cast<scalar_t>(squares * scaled * scaled /
                                                      static_cast<double>(full));
  *sum = total;
  const scalar_t step = lr * g_scale / (std::sqrt(total) + eps);
  const scalar_t* __restrict__ src = g + col_start;
  for (int64_t k = 0; k < cols; ++k) w[k] -= step * src[k];
}

template <typename scalar_t, bool kAvx>
inline double row_squares(const scalar_t* g, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kAvx && std::is_same_v<scalar_t, float>) return sum_squares_avx(g, n);
#endif
  return sum_squares(g, n);
}

// The runs [first, last) of one table's rows: each distinct row's gradient summed from its
// bags as the one-table kernel sums it (sparse_rows.cpp, for_each_row_gradient, same
// prefetches), then the row-wise Adagrad row. The table's fields are locals here: read from
// memory per row, the update measured about 1.5x slower.
template <typename scalar_t, bool kAvx>
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
  for (int64_t i = first; i < last; ++i) {
    if (i + kPrefetchFar < last) {
      prefetch_row<1>(w + (key[selected[i + kPrefetchFar]] - offset) * stride, cols);
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
      const scalar_t* src = g->data + (bag - g->begin) * g->stride;
      rowwise_adagrad_row_from<scalar_t>(w + row * stride, sum + row, src,
                                         row_squares<scalar_t, kAvx>(src, full), g_scale, full,
                                         col_start, cols, in.lr, in.eps);
      continue;
    }
    std::fill(row_grad, row_grad + full, scalar_t(0));
    for (int64_t k = start[u]; k < start[u + 1]; ++k) {
      const int64_t bag = bag_of[k];
      const GradBlock<scalar_t>* g = block_of(bag);
      const scalar_t s = in.weight ? in.weight[in.ord[k]] * g->scale : g->scale;
      const scalar_t* __restrict__ src = g->data + (bag - g->begin) * g->stride;
      for (int64_t c = 0; c < full; ++c) row_grad[c] += s * src[c];
    }
    rowwise_adagrad_row_from<scalar_t>(w + row * stride, sum + row, row_grad,
                                       row_squares<scalar_t, kAvx>(row_grad, full), scalar_t(1),
                                       full, col_start, cols, in.lr, in.eps);
  }
}

template <typename scalar_t>
void table_runs_plain(const TableRows<scalar_t>& tr, const RunInputs<scalar_t>& in,
                      int64_t first, int64_t last, scalar_t* row_grad) {
  table_runs_body<scalar_t, false>(tr, in, first, last, row_grad);
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same loop compiled for AVX (chosen at run time, as sum_squares is): no FMA (the library
// builds with -ffp-contract=off, and AVX has none), so the same bits.
__attribute__((target("avx"))) void table_runs_avx(const TableRows<float>& tr,
                                                   const RunInputs<float>& in, int64_t first,
                                                   int64_t last, float* row_grad) {
  table_runs_body<float, true>(tr, in, first, last, row_grad);
}
#endif

template <typename scalar_t>
void rowwise_adagrad_table_runs(const TableRows<scalar_t>& tr, const RunInputs<scalar_t>& in,
                                int64_t begin, int64_t end) {
  at::parallel_for(begin, end, 256, [&](int64_t first, int64_t last) {
    std::vector<scalar_t> buffer(tr.full);
#if defined(__x86_64__) && defined(__GNUC__)
    if constexpr (std::is_same_v<scalar_t, float>) {
      static const bool avx = __builtin_cpu_supports("avx");
      if (avx) return table_runs_avx(tr, in, first, last, buffer.data());
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

}  // namespace

// Pool the bags of many tables in one call: `weights` one block per table (one dtype, rows
// contiguous), `ids`/`lengths` every bag of the batch, `segments` (n, 6) as above, `outs` the
// outputs the pooled rows are added into (of the weights' dtype; flat or 2-D, contiguous).
void pool_tables(std::vector<torch::Tensor> weights, torch::Tensor ids, torch::Tensor lengths,
                 torch::Tensor segments, std::vector<torch::Tensor> outs) {
  TORCH_CHECK(!weights.empty(), "pool_tables needs at least one table");
  check_index(ids, "ids");
  check_index(lengths, "lengths");
  const auto dtype = weights[0].scalar_type();
  for (const auto& weight : weights) check_rows(weight, dtype, "weights");
  for (const auto& out : outs) {
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == dtype,
                "outputs must be contiguous CPU tensors of the weights' dtype");
  }
  const auto starts = bag_starts(lengths, ids.numel());
  const auto parts = read_segments(segments, static_cast<int64_t>(weights.size()),
                                   lengths.numel());
  AT_DISPATCH_FLOATING_TYPES(dtype, "pool_tables", [&] {
    pool_tables_impl<scalar_t>(weights, ids, starts, parts, outs);
  });
}

// Each id as a key of one row space over all tables: row_offsets[t] + id for the ids of the
// bags of segments of table t (every bag in exactly one segment, as `pool_tables` takes them);
// an id outside its table's rows is refused.
torch::Tensor table_keys(torch::Tensor ids, torch::Tensor lengths, torch::Tensor segments,
                         torch::Tensor row_offsets) {
  check_index(ids, "ids");
  check_index(lengths, "lengths");
  check_index(row_offsets, "row_offsets");
  const int64_t tables = row_offsets.numel() - 1;
  const auto starts = bag_starts(lengths, ids.numel());
  const auto parts = read_segments(segments, tables, lengths.numel());
  const int64_t* offset = row_offsets.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  auto keys = torch::full({ids.numel()}, -1, ids.options());
  int64_t* key = keys.data_ptr<int64_t>();
  for (const Segment& seg : parts) {
    const int64_t base = offset[seg.table], rows = offset[seg.table + 1] - base;
    for (int64_t i = starts[seg.bag_begin]; i < starts[seg.bag_end]; ++i) {
      TORCH_CHECK(0 <= id[i] && id[i] < rows, "id ", id[i], " outside [0, ", rows, ")");
      key[i] = base + id[i];
    }
  }
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(key[i] >= 0, "id ", i, " lies in no segment");
  }
  return keys;
}

// Row-wise Adagrad of many tables in one call, from groups over `table_keys` keys (group_rows
// with num_rows = row_offsets[-1]): per table its block, its state, the width of its gradient
// rows and the first column of its block within them; the rest as rowwise_adagrad_update.
void rowwise_adagrad_update_tables(std::vector<torch::Tensor> weights,
                                   std::vector<torch::Tensor> states,
                                   c10::optional<torch::Tensor> id_weights, torch::Tensor order,
                                   torch::Tensor starts, torch::Tensor bags, torch::Tensor keys,
                                   torch::Tensor runs, int64_t run_begin, int64_t run_end,
                                   std::vector<torch::Tensor> blocks, std::vector<double> scales,
                                   int64_t first_bag, int64_t end_bag, torch::Tensor row_offsets,
                                   std::vector<int64_t> widths, std::vector<int64_t> col_starts,
                                   double lr, double eps) {
  const size_t n = weights.size();
  TORCH_CHECK(n > 0 && states.size() == n && widths.size() == n && col_starts.size() == n &&
                  row_offsets.numel() == static_cast<int64_t>(n) + 1,
              "one weight, state, width, first column and row offset per table");
  for (const auto* t : {&order, &starts, &bags, &keys, &runs, &row_offsets}) {
    check_index(*t, "groups");
  }
  TORCH_CHECK(order.numel() == bags.numel() && starts.numel() == keys.numel() + 1 &&
                  runs.numel() == keys.numel(), "inconsistent groups");
  TORCH_CHECK(0 <= run_begin && run_begin <= run_end && run_end <= runs.numel(),
              "runs outside the groups");
  const auto dtype = weights[0].scalar_type();
  const int64_t* offset = row_offsets.data_ptr<int64_t>();
  std::vector<int64_t> offsets(offset, offset + n + 1);
  for (size_t t = 0; t < n; ++t) {
    TORCH_CHECK(weights[t].device().is_cpu() && weights[t].is_contiguous() &&
                    weights[t].scalar_type() == dtype && weights[t].dim() == 2,
                "weights must be contiguous 2-D CPU tensors of one dtype");
    TORCH_CHECK(states[t].device().is_cpu() && states[t].is_contiguous() &&
                    states[t].scalar_type() == dtype &&
                    states[t].numel() >= weights[t].size(0),
                "states must be contiguous CPU tensors of the weights' dtype, one per row");
    TORCH_CHECK(offsets[t + 1] - offsets[t] <= weights[t].size(0),
                "row offsets give table ", t, " more rows than its block holds");
    TORCH_CHECK(col_starts[t] >= 0 && col_starts[t] + weights[t].size(1) <= widths[t],
                "table ", t, ": column block outside its gradient");
  }
  if (id_weights) {
    check_rows(id_weights->view({-1, 1}), dtype, "per-id weights");
    TORCH_CHECK(id_weights->numel() == order.numel(), "one weight per id");
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "rowwise_adagrad_update_tables", [&] {
    std::vector<TableRows<scalar_t>> tables;
    for (size_t t = 0; t < n; ++t) {
      tables.push_back({weights[t].data_ptr<scalar_t>(), states[t].data_ptr<scalar_t>(),
                        weights[t].stride(0), weights[t].size(1), widths[t], col_starts[t],
                        offsets[t]});
    }
    const auto grads = grad_blocks<scalar_t>(blocks, scales, first_bag, dtype);
    TORCH_CHECK(grads.end == end_bag, "gradients given for ", grads.end - first_bag,
                " bags, but these rows occur in bags ", first_bag, "..", end_bag - 1);
    const RunInputs<scalar_t> in{runs.data_ptr<int64_t>(),
                                 order.data_ptr<int64_t>(),
                                 starts.data_ptr<int64_t>(),
                                 bags.data_ptr<int64_t>(),
                                 keys.data_ptr<int64_t>(),
                                 id_weights ? id_weights->data_ptr<scalar_t>() : nullptr,
                                 &grads,
                                 static_cast<scalar_t>(lr),
                                 static_cast<scalar_t>(eps)};
    rowwise_adagrad_tables_impl<scalar_t>(tables, offsets, in, run_begin, run_end);
  });
}

void register_table_batch(pybind11::module& m) {
  m.def("pool_tables", &pool_tables);
  m.def("table_keys", &table_keys);
  m.def("rowwise_adagrad_update_tables", &rowwise_adagrad_update_tables);
}
