// Threads kept from one call to the next for the disk tier's row IO (row_io.cpp): a call's
// parts run on the calling thread and its own set of helper threads.
#pragma once

#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kept_threads {

// Threads kept from one call to the next, one set per calling thread (the step's, the drain's:
// each helper inherits its caller's priority, as the threads once started per call did).
// Starting and joining three threads per fetch cost more CPU than their reads saved on rows in
// the page cache. The caller takes parts too, so a part no helper picked up runs on it: a
// process forked from one with helpers (they are not copied) runs every part itself.
class Helpers {
 public:
  Helpers() : owner_(getpid()), threads_(new std::vector<std::thread>()) {}
  Helpers(const Helpers&) = delete;
  Helpers& operator=(const Helpers&) = delete;
  ~Helpers() {
    if (getpid() != owner_) return;  // forked: the threads are not ours to join (leaked)
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : *threads_) t.join();
    delete threads_;
  }

  // Calls run(0..parts-1), each once, over this thread and up to parts-1 helpers; returns once
  // every part has run. `run` must not throw.
  void run(int64_t parts, const std::function<void(int64_t)>& run) {
    if (parts <= 1) {
      if (parts == 1) run(0);
      return;
    }
    if (getpid() == owner_) {
      while (static_cast<int64_t>(threads_->size()) < parts - 1) {
        threads_->emplace_back([this] { serve(); });
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &run;
      next_ = 0;
      parts_ = parts;
      done_ = 0;
    }
    wake_.notify_all();
    std::unique_lock<std::mutex> lock(mutex_);
    while (next_ < parts_) {
      const int64_t part = next_++;
      lock.unlock();
      run(part);
      lock.lock();
      ++done_;
    }
    finished_.wait(lock, [this] { return done_ == parts_; });
    task_ = nullptr;
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || (task_ != nullptr && next_ < parts_); });
      if (stop_) return;
      const int64_t part = next_++;
      const std::function<void(int64_t)>* task = task_;
      lock.unlock();
      (*task)(part);
      lock.lock();
      if (++done_ == parts_) finished_.notify_one();
    }
  }

  const pid_t owner_;
  std::vector<std::thread>* threads_;
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t next_ = 0, parts_ = 0, done_ = 0;
  bool stop_ = false;
};

inline Helpers& helpers_of_this_thread() {
  thread_local Helpers helpers;
  return helpers;
}

// Calls run(0..workers-1), on this thread and its helpers.
template <typename Run>
inline void run_on_workers(int64_t workers, const Run& run) {
  if (workers <= 1) {
    run(0);
    return;
  }
  helpers_of_this_thread().run(workers, std::function<void(int64_t)>(run));
}

}  // namespace kept_threads
