// Hash results in mapped pinned host memory (declared and documented in cuda/host_hashes.h).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/host_hashes.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <deque>
#include <map>
#include <mutex>
#include <vector>

namespace pyxfer {
namespace {

// Pairs of one pinned, mapped, portable allocation per 64; each pair with its own event (created
// once) that marks its last reader when it was given back after work on a stream.
class HostHashPool {
 public:
  HostHashes* take() {
    // NOTE: may run while this thread captures a CUDA graph: neither the queries (of events recorded
    // outside any capture) nor the allocation is a stream operation.
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    std::lock_guard<std::mutex> lock(mutex_);
    // Pairs given back after stream work, oldest first: free once their event fired.
    while (!pending_.empty()) {
      const Pending& p = pending_.front();
      const cudaError_t err = cudaEventQuery(p.event);
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        break;
      }
      C10_CUDA_CHECK(err);
      free_.push_back(p.pair);
      spare_events_[p.device].push_back(p.event);
      pending_.pop_front();
    }
    if (free_.empty()) {
      constexpr int kPerBlock = 64;
      void* p = nullptr;
      C10_CUDA_CHECK(cudaHostAlloc(&p, sizeof(HostHashes) * kPerBlock, cudaHostAllocMapped | cudaHostAllocPortable));
      for (int i = 0; i < kPerBlock; ++i) free_.push_back(static_cast<HostHashes*>(p) + i);
    }
    HostHashes* h = free_.back();
    free_.pop_back();
    return h;
  }

  void give_after(HostHashes* h, const c10::cuda::CUDAStream& s) {
    const c10::DeviceIndex device = s.device_index();
    const c10::cuda::CUDAGuard guard(device);
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<cudaEvent_t>& spare = spare_events_[device];  // an event records on its own device only
      if (!spare.empty()) {
        event = spare.back();
        spare.pop_back();
      }
    }
    if (event == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event, s.stream()));
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back({h, event, device});
  }

  void give_now(HostHashes* h) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(h);
  }

 private:
  struct Pending {
    HostHashes* pair;
    cudaEvent_t event;  // recorded after the pair's last reader
    c10::DeviceIndex device;
  };

  std::mutex mutex_;
  std::vector<HostHashes*> free_;
  std::deque<Pending> pending_;
  std::map<c10::DeviceIndex, std::vector<cudaEvent_t>> spare_events_;
};

HostHashPool& pool() {
  static HostHashPool* pool = new HostHashPool();  // NOTE: leaked on purpose: outlives CUDA teardown order
  return *pool;
}

struct ThreadHostHashes {
  HostHashes* slot = nullptr;
  ~ThreadHostHashes() {
    if (slot != nullptr) pool().give_now(slot);
  }
};
thread_local ThreadHostHashes thread_pair;

}  // namespace

HostHashes* thread_host_hashes() {
  if (thread_pair.slot == nullptr) thread_pair.slot = pool().take();
  return thread_pair.slot;
}

void abandon_thread_host_hashes() { thread_pair.slot = nullptr; }

HostHashes* take_host_hashes() { return pool().take(); }

void give_host_hashes_after(HostHashes* h, const c10::cuda::CUDAStream& s) { pool().give_after(h, s); }

void give_host_hashes_now(HostHashes* h) { pool().give_now(h); }

}  // namespace pyxfer
