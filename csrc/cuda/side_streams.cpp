// pyxfer's own side streams (declared and documented in cuda/side_streams.h).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/side_streams.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>

#include "cuda/stream_order.h"

namespace pyxfer {
namespace {

using c10::cuda::CUDAStream;

// Copies on different streams of one device spread their side work over at least this many side
// streams (round robin), so unrelated copies rarely queue behind each other's hashes.
constexpr size_t kMinStreamsPerDevice = 4;

struct SideStream {
  cudaStream_t stream;
  bool held = false;      // a copy is using it
  bool captured = false;  // given back while part of a capture: free again once that capture ended
};

struct DeviceStreams {
  std::vector<SideStream> streams;
  size_t next = 0;  // round robin
};

std::mutex streams_mutex;
// NOTE: streams are never destroyed: graphs may reference them, and they outlive CUDA's teardown order.
std::map<c10::DeviceIndex, DeviceStreams>& all_streams() {
  static auto* streams = new std::map<c10::DeviceIndex, DeviceStreams>();
  return *streams;
}

}  // namespace

CUDAStream SideStreams::acquire(c10::DeviceIndex device) {
  const c10::cuda::CUDAGuard guard(device);
  std::lock_guard<std::mutex> lock(streams_mutex);
  DeviceStreams& d = all_streams()[device];
  for (SideStream& s : d.streams)  // captures that ended give their streams back
    if (s.captured && !is_capturing(c10::cuda::getStreamFromExternal(s.stream, device))) s.captured = false;
  const size_t n = d.streams.size();
  size_t pick = n;
  if (n >= kMinStreamsPerDevice) {
    for (size_t k = 0; k < n && pick == n; ++k) {
      const size_t i = (d.next + k) % n;
      if (!d.streams[i].held && !d.streams[i].captured) pick = i;
    }
  }
  if (pick == n) {  // none free (or too few yet): a new one
    // NOTE: allowed while a stream captures a graph (creating a stream is not a stream operation).
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    d.streams.push_back({s});
  }
  d.next = pick + 1;
  d.streams[pick].held = true;
  held_.push_back(c10::cuda::getStreamFromExternal(d.streams[pick].stream, device));
  return held_.back();
}

SideStreams::~SideStreams() {
  if (held_.empty()) return;
  std::lock_guard<std::mutex> lock(streams_mutex);
  for (const CUDAStream& h : held_) {
    DeviceStreams& d = all_streams()[h.device_index()];
    for (SideStream& s : d.streams) {
      if (s.stream != h.stream() || !s.held) continue;
      s.held = false;
      const c10::cuda::CUDAGuard guard(h.device_index());
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      // NOTE: no throw from a destructor; a stream whose state is unknown stays out of use.
      const cudaError_t err = cudaStreamIsCapturing(s.stream, &status);
      if (err != cudaSuccess) (void)cudaGetLastError();
      s.captured = err != cudaSuccess || status != cudaStreamCaptureStatusNone;
      break;
    }
  }
}

}  // namespace pyxfer
