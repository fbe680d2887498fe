// Stream-ordering helpers for CUDA work spread over several streams and devices: fork/join by
// reusable per-thread events, host waits, graph-capture queries, allocator lifetimes.
// NOTE: every raw call that takes a stream runs with that stream's device current: torch's default
// stream is the legacy stream (handle 0), which means "the current device's".
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace pyxfer {

// Whether `s` is capturing a CUDA graph.
bool is_capturing(const c10::cuda::CUDAStream& s);

// Reusable events per device and thread: a wait captures the event's state when it is queued, so an
// event can be recorded again right away (no create/destroy per ordering). Slot 0 orders streams
// (record / wait below); slots 1, 2, ... mark the chunks of one pipelined copy, all recorded before
// the first wait on them.
cudaEvent_t device_event(c10::DeviceIndex device, size_t slot);

// Records the device's ordering event on `s` and returns it (valid for waits until the next record).
cudaEvent_t record(const c10::cuda::CUDAStream& s);

// Work queued on `s` from now on runs after `event` fired.
void wait(const c10::cuda::CUDAStream& s, cudaEvent_t event);

// Work queued on `after` from now on runs after everything queued on `before` so far.
void order(const c10::cuda::CUDAStream& before, const c10::cuda::CUDAStream& after);

// The host waits for everything queued on `s` so far (by this thread's event: other threads' later
// work on the same stream is not waited for).
void host_wait(const c10::cuda::CUDAStream& s);

// The caching allocator must not reuse `t`'s memory before work queued on `stream` finished.
void keep_alive_on(const at::Tensor& t, const c10::cuda::CUDAStream& stream);

}  // namespace pyxfer
