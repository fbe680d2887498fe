// Verified copies with both ends on GPUs, direct route (csrc/cuda/transfer_device.cpp): the GPU-local
// fused kernel, the two-kernel peer protocol, the copy-engine pipeline of large peer copies, and the
// fast first attempt that runs the first two with no per-call heap objects. The CUDA path
// (csrc/cuda/transfer_cuda.cpp) hands its GPU -> GPU direct copies to DeviceCopy and registers
// device_fast_attempt as its family's fast attempt.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuda/side_streams.h"
#include "pyxfer/launch.h"
#include "pyxfer/verify_words.h"
#include "transfer/transfer.h"

namespace pyxfer {

// The two ends of one copy and the streams it runs on (the callers' current streams, or in a capture
// across two GPUs the side stream that joined it).
struct DeviceEnds {
  c10::DeviceIndex src, dst;
  c10::cuda::CUDAStream sa, sb;
  // Set while a CUDA graph is being captured: the stream the graph is captured on. Then the copy
  // owns its workspaces (kept with the graph), measures nothing and never waits on the host.
  c10::optional<c10::cuda::CUDAStream> capture_origin;
};

// One copy between GPUs (or within one) on the direct route: copy(), then compare(), once each.
class DeviceCopy {
 public:
  // `side`: where the copy-engine pipeline takes its side streams (held until `side` is destroyed);
  // may be null when the copy is known not to need them (the fast attempt).
  DeviceCopy(const DeviceEnds& ends, Verify verify, SideStreams* side);
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy();

  // Queues `plan` (src, dst contiguous, plan.num_bytes each) and, unless verify is kNone, the hashes
  // and, for kDeferred, the check on the destination's stream. Afterwards work on ends.sb sees the
  // copied bytes, and work queued on ends.sa later runs after the copy's reads of src (deferred and
  // unverified copies; a sync copy's reads are over when compare returns).
  void copy(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan);
  // kSync: one host wait, then the checker's verdict (both hashes stored, canaries removed). kDeferred
  // and kNone: true (the check kernel latches a mismatch).
  bool compare(uint64_t* src_value, uint64_t* dst_value);

  // Whether copy() of such a copy takes side streams (then `side` must not be null): a verified peer
  // copy above the fused size (the copy-engine pipeline).
  static bool needs_side_streams(bool peer, int64_t num_bytes, Verify verify);

 private:
  void plain_copy(uint8_t* d, const uint8_t* s, const CopyPlan& plan);
  void copy_local(uint8_t* d, const uint8_t* s, const CopyPlan& plan);
  void copy_pull(uint8_t* d, const uint8_t* s, const CopyPlan& plan);
  void copy_pipelined(uint8_t* d, const at::Tensor& src, const CopyPlan& plan);
  void finish();
  HashScratch* scratch_for(c10::DeviceIndex device, const c10::cuda::CUDAStream& s);
  void wait_for_words();

  DeviceEnds ends_;
  Verify verify_;
  SideStreams* side_;
  bool peer_;
  bool skip_ = false;           // pyxfer.testing's skip_kernel: the destination's hashing kernel is left out
  int64_t num_bytes_ = 0;
  uint64_t seq_ = 0, src_canary_ = 0, dst_canary_ = 0;
  VerifyWords* words_ = nullptr;
  bool sync_pending_ = false;   // sync words launched into and not yet waited for
  cudaEvent_t done_ = nullptr;  // sync: what the host waits for, on ends.sb
  std::vector<at::Tensor> graph_owned_;  // in capture: workspaces the graph keeps
};

// PathFamily::fast_attempt of the CUDA family: a GPU -> GPU (or GPU-local) verified copy, sync or
// deferred, of a contiguous source, on the direct route (requested, or auto with the pair not marked
// corrupt), no stream capturing, up to the fused peer size between two GPUs (any size within one).
bool device_fast_attempt(const at::Tensor& src, at::Device device, Route requested, Verify verify,
                         FastAttempt* out);

}  // namespace pyxfer
