// CUDA binding of pointer_chase: one thread of `device` walks a ring of node indices in its own memory or a
// peer GPU's, one dependent load per hop (what `pyxfer bench` times as the SM pointer-chase latency).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "checks.h"
#include "cuda/peer_access.h"
#include "cuda/stream_order.h"
#include "pyxfer/launch.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.pointer_chase";

at::Tensor pointer_chase_cuda(const at::Tensor& ring, int64_t num_hops, std::optional<at::Device> device) {
  check_pointer_chase(kOp, ring, num_hops);
  TORCH_CHECK(ring.is_cuda(), kOp, ": ring must be a CUDA tensor here, got one on ", ring.device());
  const int holder = ring.get_device();
  int walker = holder;
  if (device.has_value()) {
    TORCH_CHECK_VALUE(device->is_cuda(), kOp, ": device must be a CUDA device for a ring in GPU memory (the GPU "
                      "that walks it), got ", device->str());
    walker = device->has_index() ? device->index() : c10::cuda::current_device();
    TORCH_CHECK_VALUE(walker < c10::cuda::device_count(), kOp, ": device must be a CUDA device of this process, "
                      "got ", device->str(), " (", int(c10::cuda::device_count()), " visible)");
  }
  if (walker != holder) {
    TORCH_CHECK_VALUE(can_access_peer(walker, holder), kOp, ": device cuda:", walker, " has no peer access to cuda:",
                      holder, ", which holds the ring");
    enable_peer_access(walker, holder);
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(walker));
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(walker);
  at::Tensor out = at::empty({}, ring.options().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(walker))));
  if (walker != holder) {
    // After the holder's queued work (it may still be writing the ring); the ring's memory stays allocated
    // until the walk finished.
    order(c10::cuda::getCurrentCUDAStream(holder), stream);
    keep_alive_on(ring, stream);
  }
  C10_CUDA_CHECK(launch_pointer_chase(ring.const_data_ptr<int64_t>(), ring.numel(), num_hops,
                                      out.mutable_data_ptr<int64_t>(), stream.stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CUDA, m) { m.impl("pointer_chase", &pointer_chase_cuda); }

}  // namespace pyxfer
