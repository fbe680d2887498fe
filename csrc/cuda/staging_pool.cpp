// The bounded pool of pinned staging buffers (declared in cuda/staging_pool.h).
#include "cuda/staging_pool.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <utility>

namespace pyxfer {

StagingPool::Slot StagingPool::acquire() {
  std::unique_lock<std::mutex> lock(mutex_);
  int64_t i = -1;
  // NOTE: the slot is picked after the wait, from the pool as it is then: configure_staging may have
  // resized it meanwhile (an index picked before the wait could be past its end).
  while (true) {
    maybe_reallocate();
    const int64_t n = int64_t(slots_.size());
    for (int64_t k = 0; k < n && i < 0; ++k)  // round robin from the slot after the last one taken
      if (!slots_[(next_ + k) % n].held) i = (next_ + k) % n;
    if (i >= 0) break;
    idle_.wait(lock);
  }
  next_ = i + 1;
  slots_[i].held = true;
  cudaEvent_t prior = slots_[i].last_reader;
  slots_[i].last_reader = nullptr;
  ++num_held_;
  return {base_ + i * config_.chunk_bytes, config_.chunk_bytes, i, prior, std::move(slots_[i].host_reader)};
}

void StagingPool::release(int64_t index, cudaEvent_t last_reader, HostTasksIdle host_reader) {
  std::lock_guard<std::mutex> lock(mutex_);
  slots_[index].held = false;
  slots_[index].last_reader = last_reader;
  slots_[index].host_reader = std::move(host_reader);
  --num_held_;
  idle_.notify_all();
}

int64_t StagingPool::chunk_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_.chunk_bytes != 0 ? config_.chunk_bytes : staging_config().chunk_bytes;
}

// (Re)allocate when the configuration changed and no copy holds a slot.
void StagingPool::maybe_reallocate() {
  const StagingConfig want = staging_config();
  if (base_ != nullptr && (num_held_ > 0 || (want.chunk_bytes == config_.chunk_bytes &&
                                             want.num_slots == config_.num_slots)))
    return;
  for (SlotState& s : slots_) {
    s.host_reader.wait();  // NOTE: host tasks never take this lock: no deadlock
    if (s.last_reader != nullptr) {
      C10_CUDA_CHECK(cudaEventSynchronize(s.last_reader));
      C10_CUDA_CHECK(cudaEventDestroy(s.last_reader));
    }
  }
  if (base_ != nullptr) C10_CUDA_CHECK(cudaFreeHost(base_));
  // NOTE: allowed while a stream captures a graph (the allocation is not a stream operation).
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  void* p = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&p, size_t(want.chunk_bytes * want.num_slots), cudaHostAllocPortable));
  base_ = static_cast<uint8_t*>(p);
  config_ = want;
  slots_.assign(size_t(want.num_slots), SlotState{});
}

StagingPool& staging_pool() {
  static StagingPool* pool = new StagingPool();  // NOTE: leaked on purpose: outlives CUDA teardown order
  return *pool;
}

}  // namespace pyxfer
