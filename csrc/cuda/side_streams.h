// pyxfer's own side streams (hashes beside a copy, staged legs, a device's work during another
// device's graph capture). Never torch's pool streams: torch hands those to anyone, its
// torch.cuda.graph() captures on one by default, and eager work queued on a stream another thread
// is capturing on would be captured into that graph or break it.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <vector>

namespace pyxfer {

// Side streams held by one copy: acquire() hands out a stream no other copy holds (round robin over
// the free ones; a new one when none is free); the destructor gives them back. A stream given back
// while part of a CUDA graph capture is not handed out again until that capture ended (work queued
// on it meanwhile would become part of the graph, or break it).
class SideStreams {
 public:
  SideStreams() = default;
  SideStreams(const SideStreams&) = delete;
  SideStreams& operator=(const SideStreams&) = delete;
  ~SideStreams();

  // A non-blocking stream of `device`, held until this object is destroyed.
  c10::cuda::CUDAStream acquire(c10::DeviceIndex device);

 private:
  std::vector<c10::cuda::CUDAStream> held_;
};

}  // namespace pyxfer
