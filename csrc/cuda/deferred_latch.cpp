// Per-thread latches of deferred verification (declared and documented in cuda/deferred_latch.h).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/deferred_latch.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

namespace pyxfer {
namespace {

struct DeviceLatch {
  TransferLatch* latch = nullptr;  // device memory
  uint64_t reported = 0;           // latch->count at this thread's last take
};

struct ThreadLatches {
  std::map<int, DeviceLatch> by_device;
  std::set<int> pending;   // devices with latch kernels queued since the last take
  std::set<int> captured;  // devices with latch kernels in graphs this thread captured
};
// NOTE: a thread's latches are never freed (its graphs may outlive it): one small allocation per
// device per thread that made a deferred copy.
thread_local ThreadLatches latches;

// A private non-blocking stream per device for the latch's own memset and reads: never part of a
// capture, and (unlike the legacy stream) never implicitly ordered with a stream that is capturing.
cudaStream_t utility_stream(int device) {
  static std::mutex mutex;
  static auto* streams = new std::map<int, cudaStream_t>();  // NOTE: leaked: outlives CUDA teardown order
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& s = (*streams)[device];
  if (s == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

}  // namespace

TransferLatch* thread_latch(int device, bool capturing) {
  DeviceLatch& d = latches.by_device[device];
  if (d.latch == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    // NOTE: allowed while a stream captures a graph (neither call is a stream operation).
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&p, sizeof(TransferLatch)));
    const cudaStream_t s = utility_stream(device);
    C10_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(TransferLatch), s));
    C10_CUDA_CHECK(cudaStreamSynchronize(s));  // zero before any latch kernel, on any stream
    d.latch = static_cast<TransferLatch*>(p);
  }
  (capturing ? latches.captured : latches.pending).insert(device);
  return d.latch;
}

TransferErrors take_thread_latches() {
  TransferErrors out;
  if (latches.by_device.empty()) return out;
  std::set<int> devices = latches.pending;
  devices.insert(latches.captured.begin(), latches.captured.end());
  // This thread may be told to wait while another thread captures a graph: relaxed mode makes the
  // waits and the reads legal then (none of them is work on a capturing stream).
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  for (int device : devices) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaDeviceSynchronize());  // the latch is written by kernels: wait for them
    latches.pending.erase(device);            // only once waited for (a throw keeps it for the next take)
    DeviceLatch& d = latches.by_device[device];
    TransferLatch snapshot;
    const cudaStream_t s = utility_stream(device);
    C10_CUDA_CHECK(cudaMemcpyAsync(&snapshot, d.latch, sizeof(TransferLatch), cudaMemcpyDeviceToHost, s));
    C10_CUDA_CHECK(cudaStreamSynchronize(s));
    if (snapshot.count == d.reported) continue;
    out.count += int64_t(snapshot.count - d.reported);
    // Records past the ring's size were overwritten: the count says how many there were.
    const uint64_t first = std::max<uint64_t>(d.reported, snapshot.count > uint64_t(kLatchRecords)
                                                              ? snapshot.count - kLatchRecords : 0);
    for (uint64_t i = first; i < snapshot.count; ++i) {
      const TransferLatchRecord& r = snapshot.records[i % kLatchRecords];
      if (r.seq != i + 1) continue;  // still being written by a kernel queued after the wait
      TransferErrorRecord e;
      e.count = 1;
      e.src = r.src_device;
      e.dst = r.dst_device;
      e.num_bytes = r.num_bytes;
      e.src_hash = r.src_hash;
      e.dst_hash = r.dst_hash;
      e.index = r.index;
      out.records.push_back(e);
    }
    d.reported = snapshot.count;
  }
  return out;
}

}  // namespace pyxfer
