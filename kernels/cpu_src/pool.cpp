// The thread pool behind ms::parallel_for.

#include <unistd.h>

#include "common.h"

namespace ms {
namespace {

// ---------------------------------------------------------------------------------------
// A fixed thread pool: run(num_tasks, fn) calls fn(task) for every task, spread over up
// to `threads` threads (this one included), each task once; which thread runs a task never
// changes its bits. One pool per process (see pool()).
//
// The caller claims tasks too and returns as soon as every task is done: it waits only for
// helpers that joined the call (and so may hold a claimed task), never for one that has not
// woken up yet. On a loaded machine a helper may wait milliseconds for a CPU; the calls of
// a decode step must not each wait for it. A helper that wakes after its call ended sleeps
// again (or joins a later call).

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
    Job job(&fn, num_tasks);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      wanted_ = std::min<int64_t>(threads - 1, num_tasks - 1);
      ++generation_;
    }
    wake_.notify_all();
    job.work();
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = nullptr;  // no helper joins from here on
    done_.wait(lock, [&] { return job.users == 0; });  // helpers inside finish their tasks
  }

 private:
  struct Job {
    Job(const std::function<void(int64_t)>* f, int64_t n) : fn(f), num_tasks(n) {}
    void work() {
      for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) (*fn)(t);
    }
    const std::function<void(int64_t)>* fn;
    const int64_t num_tasks;
    std::atomic<int64_t> next{0};
    int users = 0;  // helpers inside work(); guarded by the pool's mutex_
  };

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (job_ == nullptr || index >= wanted_) continue;
        job = job_;
        ++job->users;
      }
      job->work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--job->users == 0) done_.notify_all();
    }
  }

  std::mutex call_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  Job* job_ = nullptr;  // the call in progress, while helpers may join it
  int64_t wanted_ = 0;  // helpers (by index) that may join it
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
