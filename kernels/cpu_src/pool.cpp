// The thread pool behind ms::parallel_for.

#include <unistd.h>

#include "common.h"

namespace ms {
namespace {

// ---------------------------------------------------------------------------------------
// A fixed thread pool: run(num_tasks, fn) calls fn(task) for every task, spread over up
// to `threads` threads (this one included), each task once; which thread runs a task never
// changes its bits. One pool per process (see pool()).

class Pool {
 public:
  void run(int threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
    if (threads <= 1 || num_tasks <= 1) {
      for (int64_t t = 0; t < num_tasks; ++t) fn(t);
      return;
    }
    std::lock_guard<std::mutex> call(call_mutex_);  // one parallel call at a time
    while (static_cast<int>(threads_.size()) < threads - 1) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { loop(index); });
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      num_tasks_ = num_tasks;
      next_.store(0);
      active_ = std::min<int64_t>(threads - 1, num_tasks - 1);
      pending_ = active_;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (int64_t t = next_.fetch_add(1); t < num_tasks_; t = next_.fetch_add(1)) (*fn_)(t);
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= active_) continue;
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex call_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int64_t active_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
};

// This process's pool. HAZARD: a forked child inherits the parent's pool object but not
// its threads, and its mutexes and condition variables may record waiters that do not
// exist there; the child gets a fresh pool and the inherited one is leaked, never touched.
// Pools are never destroyed: helper threads block in them until the process exits.
Pool& pool() {
  static Pool* current = nullptr;
  static pid_t owner = -1;
  if (owner != getpid()) {
    current = new Pool();
    owner = getpid();
  }
  return *current;
}

}  // namespace

void parallel_for(int threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  pool().run(threads, num_tasks, fn);
}

}  // namespace ms
