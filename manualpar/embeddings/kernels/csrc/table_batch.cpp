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
#include <tuple>
#include <type_traits>
#include <vector>

#include "pool_float.h"
#include "prefetch.h"
#include "row_groups.h"
#include "rowwise_row.h"
#include "table_batch_update.h"

namespace {

using table_batch_update::check_rows;
using table_batch_update::RunInputs;
using table_batch_update::TableRows;
using table_batch_update::grad_blocks;
using table_batch_update::kPoolLinesAhead;
using table_batch_update::rowwise_adagrad_tables_impl;

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

// Each bag's sum of rows as embedding_bag(mode="sum") computes it (from zero, in id order),
// added into its segment's output, or (`assign`) written there: 0 + the sum, the bits of adding
// it into zeros, with no zeros written first.
template <typename scalar_t>
void pool_tables_impl(const std::vector<torch::Tensor>& weights, const torch::Tensor& ids,
                      const std::vector<int64_t>& starts, const std::vector<Segment>& segments,
                      std::vector<torch::Tensor>& outs, bool assign) {
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
    const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t lines = std::max<int64_t>((row_bytes + kCacheLine - 1) / kCacheLine, 1);
    const int64_t ahead = std::max<int64_t>(kPrefetchFar, kPoolLinesAhead / lines);
    at::parallel_for(0, bags, 256, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__) && defined(__GNUC__)
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (simd_level() == 2) {
          const int64_t b0 = seg.bag_begin + begin, b1 = seg.bag_begin + end;
          return pool_float::bags(w, stride, cols, id, starts.data(), b0, b1, ahead, starts[b1],
                                  dst + begin * seg.stride, seg.stride, assign);
        }
      }
#endif
      std::vector<scalar_t> buffer(cols);
      scalar_t* __restrict__ acc = buffer.data();
      const int64_t head = starts[seg.bag_begin + begin], last = starts[seg.bag_begin + end];
      // the first rows asked for at once (else each segment's first `ahead` waited alone)
      for (int64_t i = head; i < std::min(last, head + ahead); ++i) {
        prefetch_row_to_read(w + id[i] * stride, cols);
      }
      for (int64_t b = begin; b < end; ++b) {
        const int64_t bag = seg.bag_begin + b;
        scalar_t* __restrict__ d = dst + b * seg.stride;
        const int64_t first = starts[bag], stop = starts[bag + 1];
        for (int64_t i = first; i < stop && i + ahead < last; ++i) {
          prefetch_row_to_read(w + id[i + ahead] * stride, cols);
        }
        if (stop - first == 1) {  // one id: the sum is its row
          const scalar_t* __restrict__ src = w + id[first] * stride;
          if (assign) {
            for (int64_t c = 0; c < cols; ++c) d[c] = scalar_t(0) + src[c];
          } else {
            for (int64_t c = 0; c < cols; ++c) d[c] += scalar_t(0) + src[c];
          }
          continue;
        }
        std::fill(acc, acc + cols, scalar_t(0));
        for (int64_t i = first; i < stop; ++i) {
          const scalar_t* __restrict__ src = w + id[i] * stride;
          for (int64_t c = 0; c < cols; ++c) acc[c] += src[c];
        }
        if (assign) {
          for (int64_t c = 0; c < cols; ++c) d[c] = scalar_t(0) + acc[c];
        } else {
          for (int64_t c = 0; c < cols; ++c) d[c] += acc[c];
        }
      }
    });
  }
}

}  // namespace

// Pool the bags of many tables in one call: `weights` one block per table (one dtype, rows
// contiguous), `ids`/`lengths` every bag of the batch, `segments` (n, 6) as above, `outs` the
// outputs the pooled rows are added into (of the weights' dtype; flat or 2-D, contiguous), or
// written into (`assign`: the segments' rows must not overlap).
void pool_tables(std::vector<torch::Tensor> weights, torch::Tensor ids, torch::Tensor lengths,
                 torch::Tensor segments, std::vector<torch::Tensor> outs, bool assign) {
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
    pool_tables_impl<scalar_t>(weights, ids, starts, parts, outs, assign);
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

// The batch's ids grouped by key (row_offsets[t] + id for table t's ids, as `table_keys`
// makes them), in one pass with no keys tensor: group_rows over those keys, the same groups.
// The segments must cover the bags in order (as a batch's do); an id outside its table's rows
// is refused.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t>
group_tables(torch::Tensor ids, torch::Tensor lengths, torch::Tensor segments,
             torch::Tensor row_offsets, int64_t own_begin, int64_t own_end) {
  check_index(ids, "ids");
  check_index(lengths, "lengths");
  check_index(row_offsets, "row_offsets");
  const int64_t tables = row_offsets.numel() - 1;
  TORCH_CHECK(tables > 0, "group_tables needs at least one table");
  const auto parts = read_segments(segments, tables, lengths.numel());
  const int64_t* offset = row_offsets.data_ptr<int64_t>();
  std::vector<KeyRange> ranges;
  ranges.reserve(parts.size());
  int64_t covered = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Segment& seg = parts[i];
    TORCH_CHECK(seg.bag_begin == covered, "segment ", i, " starts at bag ", seg.bag_begin,
                ", not where the one before ends (", covered, ")");
    covered = seg.bag_end;
    const int64_t base = offset[seg.table], rows = offset[seg.table + 1] - base;
    TORCH_CHECK(base >= 0 && rows >= 0 && base + rows <= offset[tables], "row offsets of table ",
                seg.table, " lie outside [0, ", offset[tables], ")");
    ranges.push_back({seg.bag_end, base, rows});
  }
  TORCH_CHECK(covered == lengths.numel(), "the segments end at bag ", covered, " of ",
              lengths.numel());
  Groups g = group_ids(ids, lengths, offset[tables], own_begin, own_end, &ranges);
  return {g.order, g.starts, g.bags, g.rows, g.runs, g.num_own};
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
  m.def("pool_tables", &pool_tables, pybind11::arg("weights"), pybind11::arg("ids"),
        pybind11::arg("lengths"), pybind11::arg("segments"), pybind11::arg("outs"),
        pybind11::arg("assign") = false);
  m.def("table_keys", &table_keys);
  m.def("group_tables", &group_tables);
  m.def("rowwise_adagrad_update_tables", &rowwise_adagrad_update_tables);
}
