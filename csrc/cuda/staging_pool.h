// The bounded pool of pinned staging buffers, sized by the staging settings (transfer/staging.h):
// num_slots buffers of chunk_bytes in one portable pinned allocation. A slot is held only while one
// copy enqueues its legs; its reuse is ordered by the event of its last device user (stream waits, or a
// host wait where the next writer is the host) and by the host tasks still reading it (the host legs of
// a copy into host memory, on the host hashing pool: the next taker waits for them on the host), so the
// pool never grows with the tensor and no copy holds two slots at once (copies never wait on each other
// while holding one).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cpu/host_pool.h"
#include "transfer/staging.h"

namespace pyxfer {

class StagingPool {
 public:
  struct Slot {
    uint8_t* ptr;
    int64_t capacity;
    int64_t index;
    cudaEvent_t prior_reader;   // the writer must wait for it (may be null); the taker destroys it
    HostTasksIdle prior_host;   // host tasks still reading the slot (may be empty): wait() before writing
  };

  // A slot no other copy holds (round robin among the free ones), waiting for one if need be;
  // (re)allocates the pool first when the settings changed and no slot is held.
  Slot acquire();
  // Gives the slot back; `last_reader` (may be null) is the event its next writer waits for, `host_reader`
  // (may be empty) the host tasks it waits for (a wait that runs them if no worker has).
  void release(int64_t index, cudaEvent_t last_reader, HostTasksIdle host_reader = {});
  // Bytes per slot: of the pool as allocated, else of the current settings.
  int64_t chunk_bytes();

 private:
  struct SlotState {
    bool held = false;
    cudaEvent_t last_reader = nullptr;
    HostTasksIdle host_reader;
  };

  void maybe_reallocate();

  std::mutex mutex_;
  std::condition_variable idle_;
  uint8_t* base_ = nullptr;
  StagingConfig config_{0, 0};
  std::vector<SlotState> slots_;
  int64_t next_ = 0;
  int64_t num_held_ = 0;
};

// The process's pool (never destroyed: it outlives CUDA's teardown order).
StagingPool& staging_pool();

}  // namespace pyxfer
