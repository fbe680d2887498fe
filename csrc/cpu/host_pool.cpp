// The host hashing pool (declared and documented in cpu/host_pool.h), and the host_hash_info op (schema
// in csrc/torch_bindings.cpp).
#include "cpu/host_pool.h"

#include <c10/util/Exception.h>
#include <pthread.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/pxh64_host.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace detail {

class Pool;

// One group's state, guarded by its pool's mutex. Shared by the HostTasks that owns it, the pool's ready
// list, the worker running one of its tasks and any HostTasksIdle.
struct TaskGroup {
  explicit TaskGroup(Pool* p) : pool(p) {}
  Pool* const pool;  // the pool it was made for (a forked child's groups made before the fork keep the old one)
  std::deque<std::function<void()>> queued;
  int64_t running = 0;
  bool failed = false;
  bool listed = false;       // in the pool's ready list
  std::exception_ptr error;  // the first task's exception, until wait() rethrows it
  std::condition_variable idle;  // notified when nothing is queued or running
};

class Pool {
 public:
  explicit Pool(int64_t num_threads) : num_threads_(num_threads) {}

  void submit(const std::shared_ptr<TaskGroup>& g, std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (g->failed) return;  // dropped: the group's owner gets the first exception
      g->queued.push_back(std::move(task));
      if (!g->listed) {
        g->listed = true;
        ready_.push_back(g);
      }
      if (!started_) start_locked();
    }
    work_.notify_one();
  }

  // Runs g's queued tasks on this thread, then waits until none of them runs.
  void help_and_wait(const std::shared_ptr<TaskGroup>& g) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (!g->queued.empty()) {
        std::function<void()> task = std::move(g->queued.front());
        g->queued.pop_front();
        execute(lock, g, std::move(task));
      } else if (g->running > 0) {
        g->idle.wait(lock);
      } else {
        return;
      }
    }
  }

  // Takes the first exception of g (null if none).
  std::exception_ptr take_error(TaskGroup& g) {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(g.error, nullptr);
  }

  // Drops g's queued tasks and waits for the running ones.
  void drop(const std::shared_ptr<TaskGroup>& g) {
    std::unique_lock<std::mutex> lock(mutex_);
    g->queued.clear();
    g->failed = true;
    g->idle.wait(lock, [&] { return g->running == 0; });
  }

 private:
  // Runs one task of g (already taken off its queue) with the lock released around it.
  void execute(std::unique_lock<std::mutex>& lock, const std::shared_ptr<TaskGroup>& g, std::function<void()> task) {
    ++g->running;
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    task = nullptr;  // what it captured goes before the group can be seen idle
    lock.lock();
    if (error != nullptr && !g->failed) {
      g->failed = true;
      g->error = error;
      g->queued.clear();  // never run after the first failure
    }
    --g->running;
    if (g->queued.empty() && g->running == 0) g->idle.notify_all();
  }

  void worker() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      work_.wait(lock, [&] { return !ready_.empty(); });
      std::shared_ptr<TaskGroup> g = std::move(ready_.front());
      ready_.pop_front();
      if (g->queued.empty()) {  // its tasks ran on a waiting thread, or were dropped
        g->listed = false;
        continue;
      }
      std::function<void()> task = std::move(g->queued.front());
      g->queued.pop_front();
      if (g->queued.empty()) {
        g->listed = false;
      } else {
        ready_.push_back(g);  // round robin: groups of concurrent callers share the workers
      }
      execute(lock, g, std::move(task));
    }
  }

  void start_locked() {
    started_ = true;
    for (int64_t i = 0; i < num_threads_; ++i) {
      try {
        std::thread t([this] { worker(); });
        pthread_setname_np(t.native_handle(), "pyxfer-host");
        threads_.push_back(std::move(t));  // NOTE: never joined: see host_pool.h
      } catch (const std::system_error& e) {  // out of threads: the waiting threads do the work
        TORCH_WARN("pyxfer: the host hashing pool started ", i, " of ", num_threads_, " threads (", e.what(), ")");
        break;
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable work_;
  std::deque<std::shared_ptr<TaskGroup>> ready_;  // groups with queued tasks (possibly emptied since)
  std::vector<std::thread> threads_;
  const int64_t num_threads_;
  bool started_ = false;
};

}  // namespace detail

namespace {

using detail::Pool;
using detail::TaskGroup;

constexpr int64_t kMaxThreads = 256;

int64_t read_threads() {
  const char* text = std::getenv("PYXFER_HOST_HASH_THREADS");
  if (text == nullptr || *text == '\0') {
    const int64_t hw = int64_t(std::thread::hardware_concurrency());
    return std::max<int64_t>(1, std::min<int64_t>(hw / 2, 16));
  }
  char* end = nullptr;
  const long long n = std::strtoll(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0' && n >= 0 && n <= kMaxThreads, "PYXFER_HOST_HASH_THREADS must be an "
              "integer in [0, ", kMaxThreads, "] (worker threads of the host hashing pool; 0: the waiting threads "
              "do the work), got '", text, "'");
  return n;
}

int64_t configured_threads() {
  static const int64_t n = read_threads();  // a throwing initializer is tried again by the next call
  return n;
}

Pool* current_pool = nullptr;  // set by pool(); replaced in a forked child (its threads did not fork)

Pool& pool() {
  static const bool made = [] {
    current_pool = new Pool(configured_threads());  // NOTE: never destroyed (host_pool.h)
    pthread_atfork(nullptr, nullptr, [] { current_pool = new Pool(configured_threads()); });
    return true;
  }();
  (void)made;
  return *current_pool;
}

std::string host_hash_info() {
  std::ostringstream s;
  s << "{\"threads\": " << configured_threads() << ", \"isa\": \"" << host_isa_name(host_hash_isa())
    << "\", \"supported\": [";
  bool first = true;
  for (HostIsa isa : {HostIsa::kScalar, HostIsa::kAvx2, HostIsa::kAvx512}) {
    if (!host_isa_supported(isa)) continue;
    s << (first ? "" : ", ") << "\"" << host_isa_name(isa) << "\"";
    first = false;
  }
  s << "], \"item_bytes\": " << kHostItemBytes << "}";
  return s.str();
}

}  // namespace

void HostTasksIdle::wait() const {
  if (group_ != nullptr) group_->pool->help_and_wait(group_);
}

// NOTE: pool() is called here, not later: a bad PYXFER_HOST_HASH_THREADS raises before any task exists,
// and the destructor (which must not throw) needs no lookup.
HostTasks::HostTasks() : group_(std::make_shared<TaskGroup>(&pool())) {}

HostTasks::~HostTasks() { group_->pool->drop(group_); }

void HostTasks::run(std::function<void()> task) { group_->pool->submit(group_, std::move(task)); }

void HostTasks::wait() {
  group_->pool->help_and_wait(group_);
  if (std::exception_ptr error = group_->pool->take_error(*group_)) std::rethrow_exception(error);
}

int64_t host_pool_threads() { return configured_threads(); }

void host_parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n <= grain) return fn(0, n);
  HostTasks tasks;
  for (int64_t begin = 0; begin < n; begin += grain) {
    const int64_t end = std::min(n, begin + grain);
    tasks.run([&fn, begin, end] { fn(begin, end); });
  }
  tasks.wait();
}

uint64_t pxh64_range_sum(const uint8_t* base, int64_t begin, int64_t end) {
  TORCH_INTERNAL_ASSERT(begin % int64_t(pxh64::kWordBytes) == 0, "pyxfer: a hash item starts at byte ", begin,
                        ", not on an 8-byte word: PXH64 partial sums compose only on words");
  return pxh64_host_sum(base + begin, uint64_t(end - begin), uint64_t(begin) / pxh64::kWordBytes, 0);
}

uint64_t host_pxh64_sum(const uint8_t* data, int64_t num_bytes, uint64_t word_offset, uint64_t seed) {
  if (num_bytes < 2 * kHostItemBytes) return pxh64_host_sum(data, uint64_t(num_bytes), word_offset, seed);
  const int64_t items = (num_bytes + kHostItemBytes - 1) / kHostItemBytes;
  std::vector<uint64_t> sums(size_t(items), 0);
  host_parallel_for(num_bytes, kHostItemBytes, [&](int64_t begin, int64_t end) {
    TORCH_INTERNAL_ASSERT(begin % int64_t(pxh64::kWordBytes) == 0);  // items compose only on words
    sums[size_t(begin / kHostItemBytes)] =
        pxh64_host_sum(data + begin, uint64_t(end - begin), word_offset + uint64_t(begin) / pxh64::kWordBytes, seed);
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return total;
}

void HostHashJob::start(const uint8_t* data, int64_t num_bytes) {
  data_ = data;
  num_bytes_ = num_bytes;
  if (num_bytes < 2 * kHostItemBytes) return;  // finish() hashes it inline: no hand-over latency
  const int64_t items = (num_bytes + kHostItemBytes - 1) / kHostItemBytes;
  sums_.reset(new uint64_t[size_t(items)]());
  for (int64_t i = 0; i < items; ++i) {
    const int64_t begin = i * kHostItemBytes, end = std::min(num_bytes, begin + kHostItemBytes);
    uint64_t* out = &sums_[size_t(i)];
    tasks_.run([=] { *out = pxh64_range_sum(data, begin, end); });
  }
}

uint64_t HostHashJob::finish() {
  uint64_t total = 0;
  if (num_bytes_ < 2 * kHostItemBytes) {
    total = pxh64_host_sum(data_, uint64_t(num_bytes_), 0, 0);
  } else {
    tasks_.wait();
    const int64_t items = (num_bytes_ + kHostItemBytes - 1) / kHostItemBytes;
    for (int64_t i = 0; i < items; ++i) total += sums_[size_t(i)];
  }
  return pxh64::finalize(total, uint64_t(num_bytes_), 0);
}

namespace {

// Test support (tests/test_host_pool.py): num_tasks tasks, each spinning spin_us microseconds and counting
// itself in the caller's frame; the one numbered fail_at raises. A group that let a task outlive the call
// would write into a dead frame; one that kept running tasks after a failure would count them.
int64_t host_pool_selftest(int64_t num_tasks, int64_t fail_at, int64_t spin_us) {
  constexpr const char* op = "pyxfer._host_pool_selftest";
  TORCH_CHECK(num_tasks >= 0 && num_tasks <= (int64_t(1) << 20), op, ": num_tasks must be in [0, 2**20], got ",
              num_tasks);
  TORCH_CHECK(spin_us >= 0 && spin_us <= 100000, op, ": spin_us must be in [0, 100000], got ", spin_us);
  std::vector<int64_t> ran(size_t(num_tasks), 0);
  HostTasks tasks;
  for (int64_t i = 0; i < num_tasks; ++i) {
    tasks.run([&ran, i, fail_at, spin_us] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      while (std::chrono::steady_clock::now() < until) {
      }
      TORCH_CHECK(i != fail_at, "pyxfer._host_pool_selftest: task ", i, " failed, as asked");
      ran[size_t(i)] += 1;
    });
  }
  tasks.wait();
  int64_t total = 0;
  for (int64_t r : ran) total += r;
  return total;
}

}  // namespace

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) {
  m.impl("host_hash_info", &host_hash_info);
  m.impl("_host_pool_selftest", &host_pool_selftest);
}

}  // namespace pyxfer
