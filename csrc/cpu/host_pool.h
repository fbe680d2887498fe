// The host hashing pool: one set of worker threads per process, created at its first use and kept, that
// hashes (PXH64), copies and splits CPU work for every pyxfer op: pyxfer.checksum on the CPU, the CPU
// formats kernels, the CPU <-> CPU verified copy and every host leg of a copy with a GPU end.
//
// Threads: $PYXFER_HOST_HASH_THREADS (0..256, read once; 0: the waiting threads do all the work), else
// min(hardware threads / 2, 16). Work is queued in groups (HostTasks); a thread that waits for a group
// runs that group's queued tasks itself, so every wait makes progress even when all workers are busy
// (or there are none) -- no wait in pyxfer can deadlock on the pool.
// NOTE: the pool is never destroyed (the process's exit ends its threads, which then only wait for
// work): a std::thread destroyed while joinable would call std::terminate at exit, and a join at exit
// would race CUDA's own teardown. A forked child starts a fresh pool at its first use.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace pyxfer {

// Bytes of one work item of the host legs and of parallel hashing: small enough that a chunk that just
// landed is spread over all threads, large enough that queuing costs nothing (~150 us of hashing each).
constexpr int64_t kHostItemBytes = int64_t(1) << 20;

namespace detail {
struct TaskGroup;
}

// Waits until a group has nothing queued or running (running what is queued on the calling thread);
// never throws what a task threw (the group's owner gets that). Copyable; valid after the group is gone.
class HostTasksIdle {
 public:
  HostTasksIdle() = default;
  void wait() const;
  explicit operator bool() const { return group_ != nullptr; }

 private:
  friend class HostTasks;
  explicit HostTasksIdle(std::shared_ptr<detail::TaskGroup> g) : group_(std::move(g)) {}
  std::shared_ptr<detail::TaskGroup> group_;
};

// A group of tasks on the pool. Tasks run in any order, on any worker or on the thread that waits.
// The first task that throws fails the group: its tasks still queued are dropped (never run) and wait()
// rethrows the exception (a c10::Error stays one). The destructor drops what is queued and waits for
// what runs, so nothing a task touches is freed under it; declare the group after what its tasks use.
class HostTasks {
 public:
  HostTasks();
  ~HostTasks();
  HostTasks(const HostTasks&) = delete;
  HostTasks& operator=(const HostTasks&) = delete;

  // Queues `task` (dropped at once if the group has failed).
  void run(std::function<void()> task);
  // Runs queued tasks on the calling thread too, waits for the running ones, then rethrows the first
  // exception of a task, if any (once).
  void wait();
  HostTasksIdle idle() const { return HostTasksIdle(group_); }

 private:
  std::shared_ptr<detail::TaskGroup> group_;
};

// Worker threads of the pool (the configured number; they start at the first task).
int64_t host_pool_threads();

// Calls fn(begin, end) on consecutive ranges [i * grain, min(n, (i + 1) * grain)) covering [0, n),
// spread over the pool and the calling thread; returns when all ran; rethrows the first exception.
// One range (n <= grain) runs inline.
void host_parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Unfinalized PXH64 (seed 0) sum of base[begin, end), keyed as the words of the whole buffer at `base`, on
// the calling thread: one item of a split hash. `begin` must fall on a word (PXH64 partial sums compose
// only on 8-byte boundaries): an internal assert, no caller can get this wrong.
uint64_t pxh64_range_sum(const uint8_t* base, int64_t begin, int64_t end);

// Unfinalized PXH64 sum of data[0, num_bytes), word j keyed as absolute word `word_offset + j`, split into
// kHostItemBytes items over the pool (inline below two items).
uint64_t host_pxh64_sum(const uint8_t* data, int64_t num_bytes, uint64_t word_offset, uint64_t seed);

// PXH64 (seed 0) of a host buffer hashed on the pool while the caller does something else: start() queues
// it, finish() runs what is still queued on the calling thread, waits and returns the finalized value.
class HostHashJob {
 public:
  void start(const uint8_t* data, int64_t num_bytes);
  uint64_t finish();

 private:
  const uint8_t* data_ = nullptr;
  int64_t num_bytes_ = 0;
  std::unique_ptr<uint64_t[]> sums_;  // one per item
  HostTasks tasks_;                   // NOTE: after sums_: destroyed (and waited for) first
};

}  // namespace pyxfer
