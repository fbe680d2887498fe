// CUDA binding of sm_copy: the copy kernel `pyxfer bench` times, pulled by the destination GPU or
// pushed by the source GPU (nvbandwidth's SM copies).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/peer_access.h"
#include "cuda/stream_order.h"
#include "pyxfer/launch.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.sm_copy";

void sm_copy_cuda(const at::Tensor& src, const at::Tensor& dst, bool pull) {
  check_sm_copy(kOp, src, dst);
  TORCH_CHECK(src.is_cuda() && dst.is_cuda(), kOp, ": src and dst must both be CUDA tensors (a copy kernel "
              "moves GPU memory), got src on ", src.device(), " and dst on ", dst.device());
  const int s = src.get_device(), d = dst.get_device();
  if (s != d) {
    TORCH_CHECK(can_access_peer(s, d) && can_access_peer(d, s), kOp, ": no peer access between cuda:", s,
                " and cuda:", d, " (a copy kernel on one GPU cannot reach the other's memory)");
    enable_peer_access(s, d);
  }
  const int runner = pull ? d : s;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(runner));
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(runner);
  // Ordered like a copy_ between devices: after the other GPU's queued work (it may still be writing
  // src or reading dst), and the other GPU's later work after the copy.
  const c10::cuda::CUDAStream other = c10::cuda::getCurrentCUDAStream(pull ? s : d);
  order(other, stream);
  C10_CUDA_CHECK(launch_sm_copy(static_cast<uint8_t*>(dst.data_ptr()), static_cast<const uint8_t*>(src.data_ptr()),
                                dst.nbytes(), stream.stream()));
  order(stream, other);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CUDA, m) { m.impl("sm_copy", &sm_copy_cuda); }

}  // namespace pyxfer
