// Stream-ordering helpers (declared and documented in cuda/stream_order.h).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/stream_order.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

namespace pyxfer {

using c10::cuda::CUDAStream;

bool is_capturing(const CUDAStream& s) {
  const c10::cuda::CUDAGuard guard(s.device_index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(s.stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

namespace {

// A thread's events, destroyed when it exits (an event can be destroyed while work that records or
// waits on it is queued). Errors are ignored there: at process exit CUDA may be gone already.
struct ThreadEvents {
  std::vector<std::vector<cudaEvent_t>> per_device;
  ~ThreadEvents() {
    for (const std::vector<cudaEvent_t>& events : per_device)
      for (cudaEvent_t e : events)
        if (e != nullptr && cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
  }
};

}  // namespace

cudaEvent_t device_event(c10::DeviceIndex device, size_t slot) {
  thread_local ThreadEvents thread_events;
  std::vector<std::vector<cudaEvent_t>>& events = thread_events.per_device;
  if (size_t(device) >= events.size()) events.resize(size_t(device) + 1);
  std::vector<cudaEvent_t>& mine = events[device];
  if (slot >= mine.size()) mine.resize(slot + 1, nullptr);
  if (mine[slot] == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&mine[slot], cudaEventDisableTiming));
  }
  return mine[slot];
}

cudaEvent_t record(const CUDAStream& s) {
  const cudaEvent_t event = device_event(s.device_index(), 0);
  const c10::cuda::CUDAGuard guard(s.device_index());
  C10_CUDA_CHECK(cudaEventRecord(event, s.stream()));
  return event;
}

void wait(const CUDAStream& s, cudaEvent_t event) {
  const c10::cuda::CUDAGuard guard(s.device_index());
  C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), event, 0));
}

void order(const CUDAStream& before, const CUDAStream& after) {
  if (before != after) wait(after, record(before));
}

void host_wait(const CUDAStream& s) {
  const cudaEvent_t event = record(s);
  C10_CUDA_CHECK(cudaEventSynchronize(event));
}

void keep_alive_on(const at::Tensor& t, const CUDAStream& stream) {
  if (t.is_cuda() && t.storage().data_ptr().get() != nullptr)
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

}  // namespace pyxfer
