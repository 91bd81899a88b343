// The disk tier's row IO (storage/row_file.py): a batch of fixed-size records read or written at
// their rows' offsets with pread/pwrite, without the interpreter (a Python loop added 0.7 us to
// each 2.7-4.7 us call) and without holding the GIL (the step's other threads run meanwhile),
// split over up to `threads` workers (the caller and helper threads kept between calls:
// kept_threads.h): on a disk whose reads wait on the device, several in flight are what makes it
// fast; rows in the page cache cost CPU, which threads do not add. Records are copied to and
// from the cache's rows here too, one memcpy per field.
#include <torch/extension.h>

#include "kept_threads.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <future>
#include <tuple>
#include <vector>

namespace {

using kept_threads::run_on_workers;

// Rows below this per worker stay on the calling thread: a part handed to a helper pays a wake-up
// and a wait, worth it only over many reads.
constexpr int64_t kRowsPerThread = 256;

// One failed row: its index in the batch, errno (0: the file ended), bytes moved.
struct Failure {
  int64_t index = -1;
  int64_t error = 0;
  int64_t moved = 0;
};

// Runs of consecutive rows move in one call (their records are adjacent in the batch too): the
// write log's batches are one run, and one pwrite of them cost 0.09 us a row against 1-5 us
// for a call per record (bench_row_writes.py).
template <bool Write>
Failure move_records(int fd, const int64_t* rows, uint8_t* records, int64_t record,
                     int64_t begin, int64_t end) {
  int64_t i = begin;
  while (i < end) {
    int64_t run = 1;
    while (i + run < end && rows[i + run] == rows[i] + run) ++run;
    uint8_t* buffer = records + i * record;
    const off_t offset = static_cast<off_t>(rows[i]) * record;
    const int64_t bytes = run * record;
    int64_t done = 0;
    while (done < bytes) {
      const ssize_t got = Write ? pwrite(fd, buffer + done, bytes - done, offset + done)
                                : pread(fd, buffer + done, bytes - done, offset + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return Failure{i + done / record, got < 0 ? errno : 0, done % record};
      done += got;
    }
    i += run;
  }
  return Failure{};
}

template <bool Write>
std::vector<int64_t> move_batch(int64_t fd, const torch::Tensor& rows, torch::Tensor& records,
                                int64_t threads) {
  TORCH_CHECK(rows.device().is_cpu() && rows.is_contiguous() &&
                  rows.scalar_type() == torch::kLong && rows.dim() == 1,
              "row IO: rows must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(records.device().is_cpu() && records.is_contiguous() &&
                  records.scalar_type() == torch::kByte && records.dim() == 2 &&
                  records.size(0) == rows.size(0),
              "row IO: records must be a contiguous (rows, record bytes) uint8 CPU tensor");
  const int64_t n = rows.size(0);
  const int64_t record = records.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  uint8_t* data = records.data_ptr<uint8_t>();
  const int64_t workers = std::max<int64_t>(1, std::min(threads, n / kRowsPerThread));
  std::vector<Failure> failures(workers);
  const auto run = [&](int64_t w) {
    const int64_t begin = n * w / workers, end = n * (w + 1) / workers;
    failures[w] = move_records<Write>(static_cast<int>(fd), row, data, record, begin, end);
  };
  run_on_workers(workers, run);
  for (const Failure& f : failures) {
    if (f.index >= 0) return {f.index, f.error, f.moved};
  }
  return {-1, 0, 0};
}

}  // namespace

// Records of `rows` (any order) into `out` (rows, record bytes). Returns [-1, 0, 0], or the first
// failed row's [index in the batch, errno (0: past the end of the file), bytes read of it].
std::vector<int64_t> read_records(int64_t fd, torch::Tensor rows, torch::Tensor out,
                                  int64_t threads) {
  return move_batch<false>(fd, rows, out, threads);
}

// `records` (rows, record bytes) to `rows`; returns as read_records does.
std::vector<int64_t> write_records(int64_t fd, torch::Tensor rows, torch::Tensor records,
                                   int64_t threads) {
  return move_batch<true>(fd, rows, records, threads);
}

namespace {

// Checks one cache tensor against the slots and the records' width; its row size in bytes.
int64_t row_bytes_of(const torch::Tensor& t, const torch::Tensor& slots, int64_t offset,
                     int64_t record) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() >= 1,
              "row IO: cache tensors must be contiguous CPU tensors");
  const int64_t bytes = t.size(0) ? t.numel() / t.size(0) * t.element_size() : 0;
  TORCH_CHECK(offset >= 0 && offset + bytes <= record, "row IO: a field of ", bytes,
              " bytes at ", offset, " does not fit a record of ", record, " bytes");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t k = 0; k < slots.numel(); ++k) {
    TORCH_CHECK(slot[k] >= 0 && slot[k] < t.size(0), "row IO: slot ", slot[k], " outside ",
                t.size(0), " cache rows");
  }
  return bytes;
}

template <bool ToSlots>
void copy_fields(torch::Tensor records, torch::Tensor slots, std::vector<torch::Tensor> tensors,
                 std::vector<int64_t> offsets) {
  TORCH_CHECK(records.device().is_cpu() && records.is_contiguous() &&
                  records.scalar_type() == torch::kByte && records.dim() == 2 &&
                  slots.scalar_type() == torch::kLong && slots.is_contiguous() &&
                  slots.numel() == records.size(0) && tensors.size() == offsets.size(),
              "row IO: records must be (n, record bytes) uint8 with n int64 slots and an "
              "offset per tensor");
  const int64_t n = records.size(0), record = records.size(1);
  uint8_t* data = records.data_ptr<uint8_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (size_t f = 0; f < tensors.size(); ++f) {
    const int64_t bytes = row_bytes_of(tensors[f], slots, offsets[f], record);
    uint8_t* rows = static_cast<uint8_t*>(tensors[f].data_ptr());
    for (int64_t k = 0; k < n; ++k) {
      uint8_t* field = data + k * record + offsets[f];
      uint8_t* row = rows + slot[k] * bytes;
      if (ToSlots) {
        std::memcpy(row, field, bytes);
      } else {
        std::memcpy(field, row, bytes);
      }
    }
  }
}

}  // namespace

// Record k's field at offsets[f] into row slots[k] of tensors[f], for each cache tensor (the
// weights and each optimizer state): what a fetch did with an index_copy_ per tensor.
void records_to_slots(torch::Tensor records, torch::Tensor slots,
                      std::vector<torch::Tensor> tensors, std::vector<int64_t> offsets) {
  copy_fields<true>(records, slots, tensors, offsets);
}

// The other way: rows slots[k] of each cache tensor into record k (a write-back's copy).
void slots_to_records(torch::Tensor records, torch::Tensor slots,
                      std::vector<torch::Tensor> tensors, std::vector<int64_t> offsets) {
  copy_fields<false>(records, slots, tensors, offsets);
}

namespace {

constexpr int32_t kNever = -1;    // row_cache.NEVER: never written, generated by the caller
constexpr int32_t kAtPlace = -2;  // row_cache.STORED: at the row's own record
// values <= row_cache.LOGGED (-3): at write-log record LOGGED - value (after the rows' records)
constexpr int64_t kBlock = 64;  // records read into a buffer, then copied to their slots

// One record's fields into the cache rows of `slot`.
struct Fields {
  std::vector<uint8_t*> base;
  std::vector<int64_t> bytes, offset;

  void copy(const uint8_t* record, const int64_t slot) const {
    for (size_t f = 0; f < base.size(); ++f) {
      std::memcpy(base[f] + slot * bytes[f], record + offset[f], static_cast<size_t>(bytes[f]));
    }
  }
};

// The records of want[begin..end) (record_of[want[i]]) read, runs of adjacent ones in one pread
// through a buffer (one preadv scattering each record into its slot's rows cost 1.18x the CPU),
// and copied into their slots. Returns the first failure (its index in want).
Failure read_into(int fd, const std::vector<int64_t>& want, const int64_t* record_of,
                  const int64_t* slot, const Fields& fields, int64_t record, int64_t begin,
                  int64_t end) {
  std::vector<uint8_t> buffer(static_cast<size_t>(kBlock * record));
  int64_t i = begin;
  while (i < end) {
    int64_t run = 1;
    while (i + run < end && run < kBlock &&
           record_of[want[i + run]] == record_of[want[i]] + run) {
      ++run;
    }
    const int64_t bytes = run * record;
    const off_t offset = static_cast<off_t>(record_of[want[i]]) * record;
    int64_t done = 0;
    while (done < bytes) {
      const ssize_t got = pread(fd, buffer.data() + done, bytes - done, offset + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return Failure{i + done / record, got < 0 ? errno : 0, done % record};
      done += got;
    }
    for (int64_t j = 0; j < run; ++j) fields.copy(buffer.data() + j * record, slot[want[i + j]]);
    i += run;
  }
  return Failure{};
}

}  // namespace

// A fetch's rows read into their cache slots in one call (what a read into records, a copy
// per field and a dozen torch ops around them did: 3 ms of a disk step's 13 on its thread).
// rows[k] goes to slots[k] from where origins[k] (its slot_of value before) says: its place,
// the write log (records from `log_base` on), or, when it is in the batch being written
// (`batch_rows` ascending, `batch_records` theirs), that batch's own record; a row never
// written is left to the caller. The reads are split over `threads` threads as read_records
// splits them. Returns (the positions k of the rows never written, [-1, 0, 0, 0] or the first
// failed row's [k, errno (0: past the file's end), bytes read of it, its record]).
std::tuple<torch::Tensor, std::vector<int64_t>> fetch_into_slots(
    int64_t fd, int64_t log_base, torch::Tensor rows, torch::Tensor slots, torch::Tensor origins,
    torch::Tensor batch_rows, torch::Tensor batch_records, std::vector<torch::Tensor> tensors,
    std::vector<int64_t> offsets, int64_t record, int64_t threads) {
  const int64_t n = rows.numel();
  TORCH_CHECK(rows.device().is_cpu() && rows.is_contiguous() &&
                  rows.scalar_type() == torch::kLong && slots.is_contiguous() &&
                  slots.scalar_type() == torch::kLong && slots.numel() == n &&
                  origins.is_contiguous() && origins.scalar_type() == torch::kInt &&
                  origins.numel() == n && tensors.size() == offsets.size(),
              "row IO: fetch takes n int64 rows and slots, n int32 origins, an offset a tensor");
  TORCH_CHECK(batch_rows.is_contiguous() && batch_rows.scalar_type() == torch::kLong &&
                  batch_records.is_contiguous() && batch_records.scalar_type() == torch::kByte &&
                  batch_records.dim() == 2 && batch_records.size(0) == batch_rows.numel() &&
                  (batch_rows.numel() == 0 || batch_records.size(1) == record),
              "row IO: the batch in flight must be ascending int64 rows and their records");
  Fields fields;
  for (size_t f = 0; f < tensors.size(); ++f) {
    fields.base.push_back(static_cast<uint8_t*>(tensors[f].data_ptr()));
    fields.bytes.push_back(row_bytes_of(tensors[f], slots, offsets[f], record));
    fields.offset.push_back(offsets[f]);
  }
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* origin = origins.data_ptr<int32_t>();
  const int64_t* batch = batch_rows.data_ptr<int64_t>();
  const int64_t batch_n = batch_rows.numel();
  const uint8_t* batch_data = batch_records.data_ptr<uint8_t>();
  std::vector<int64_t> fresh, to_read, record_of(n);
  to_read.reserve(n);
  for (int64_t k = 0; k < n; ++k) {
    if (origin[k] == kNever) {
      fresh.push_back(k);
      continue;
    }
    const int64_t r = origin[k] == kAtPlace ? row[k] : log_base + (kAtPlace - 1 - origin[k]);
    record_of[k] = r;
    const int64_t* found = std::lower_bound(batch, batch + batch_n, r);
    if (found != batch + batch_n && *found == r) {
      fields.copy(batch_data + (found - batch) * record, slot[k]);  // evicted a moment ago
    } else {
      to_read.push_back(k);
    }
  }

  const int64_t reads = static_cast<int64_t>(to_read.size());
  const int64_t workers = std::max<int64_t>(1, std::min(threads, reads / kRowsPerThread));
  std::vector<Failure> failures(workers);
  const auto run = [&](int64_t w) {
    failures[w] = read_into(static_cast<int>(fd), to_read, record_of.data(), slot, fields,
                            record, reads * w / workers, reads * (w + 1) / workers);
  };
  run_on_workers(workers, run);
  std::vector<int64_t> failed = {-1, 0, 0, 0};
  for (const Failure& f : failures) {
    if (f.index >= 0) {
      const int64_t k = to_read[f.index];
      failed = {k, f.error, f.moved, record_of[k]};
      break;
    }
  }
  torch::Tensor never = torch::empty({static_cast<int64_t>(fresh.size())}, torch::kLong);
  std::copy(fresh.begin(), fresh.end(), never.data_ptr<int64_t>());
  return {never, failed};
}

// A batch of records written by a thread of its own, started and awaited without the
// interpreter (a Python thread pool's worker took the GIL to start each call). On two busy
// cores the writes' CPU is the cost either way: the disk step measured 0.96x the pool's (median
// of 5 repeats). Holds the tensors until done.
class BackgroundWrite {
 public:
  BackgroundWrite(int64_t fd, torch::Tensor rows, torch::Tensor records)
      : rows_(std::move(rows)), records_(std::move(records)) {
    result_ = std::async(std::launch::async,
                         [this, fd] { return move_batch<true>(fd, rows_, records_, 1); });
  }
  ~BackgroundWrite() {
    if (result_.valid()) result_.wait();
  }
  // As write_records returns; an error the thread raised is raised here. Once only.
  std::vector<int64_t> wait() {
    TORCH_CHECK(result_.valid(), "row IO: this background write was already waited for");
    return result_.get();
  }
  bool done() const {
    return !result_.valid() ||
           result_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

 private:
  torch::Tensor rows_, records_;
  std::future<std::vector<int64_t>> result_;
};

void register_row_io(pybind11::module& m) {
  pybind11::class_<BackgroundWrite>(m, "BackgroundWrite")
      .def(pybind11::init<int64_t, torch::Tensor, torch::Tensor>())
      .def("wait", &BackgroundWrite::wait, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("done", &BackgroundWrite::done);
  m.def("records_to_slots", &records_to_slots);
  m.def("fetch_into_slots", &fetch_into_slots,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("slots_to_records", &slots_to_records);
  m.def("read_records", &read_records, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("write_records", &write_records, pybind11::call_guard<pybind11::gil_scoped_release>());
}
