// CUDA binding of peer_exchange: `pyxfer doctor`'s concurrent probe of a GPU pair. One block on each GPU runs
// the protocol of pyxfer/peer_exchange.h at the same time as the other (a copy followed by a synchronize never
// has both GPUs polling each other's writes; NCCL's kernels do). Each side runs on a stream of its own, so that
// neither waits behind nor holds up the work queued on the GPUs, and ends by itself after its wait limit: a
// partner that never answers is reported (timed out). (A store that never completes, on a dead link, can still
// hold the host's synchronize: the doctor runs the op in a child process under its watchdog.)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "checks.h"
#include "cuda/peer_access.h"
#include "cuda/stream_order.h"
#include "pyxfer/launch.h"
#include "pyxfer/peer_exchange.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.peer_exchange";

at::Tensor peer_exchange_cuda(const at::Tensor& a, const at::Tensor& b, int64_t rounds, int64_t seed,
                              double timeout_s, int64_t corrupt_round, int64_t stall_side) {
  check_peer_exchange(kOp, a, b, rounds, timeout_s, corrupt_round, stall_side, kExchangeHeaderWords);
  TORCH_CHECK_VALUE(a.is_cuda() && b.is_cuda(), kOp, ": a and b must both be CUDA tensors here, got ", a.device(),
                    " and ", b.device());
  const c10::DeviceIndex da = a.get_device(), db = b.get_device();
  TORCH_CHECK_VALUE(da != db, kOp, ": a and b must be on two different GPUs, got both on cuda:", int(da));
  TORCH_CHECK_VALUE(can_access_peer(da, db) && can_access_peer(db, da), kOp, ": cuda:", int(da), " and cuda:",
                    int(db), " must have peer access both ways (their copies go staged; nothing to probe here)");
  enable_peer_access(da, db);
  const at::Tensor* ends[2] = {&a, &b};
  const c10::DeviceIndex devices[2] = {da, db};
  c10::cuda::CUDAStream streams[2] = {c10::cuda::getStreamFromPool(false, da), c10::cuda::getStreamFromPool(false, db)};
  at::Tensor results[2];
  for (int side = 0; side < 2; ++side) {
    const c10::cuda::CUDAGuard guard(devices[side]);
    order(c10::cuda::getCurrentCUDAStream(devices[side]), streams[side]);  // after the caller's work on the buffer
    C10_CUDA_CHECK(cudaMemsetAsync(ends[side]->data_ptr(), 0, ends[side]->nbytes(), streams[side].stream()));
    results[side] = at::tensor({int64_t(0), int64_t(-1), int64_t(-1), int64_t(0), int64_t(0)},
                               a.options().device(at::kCPU)).to(ends[side]->device(), /*non_blocking=*/false);
  }
  for (int side = 0; side < 2; ++side) {
    const c10::cuda::CUDAGuard guard(devices[side]);
    C10_CUDA_CHECK(load_peer_exchange());
  }
  // Both buffers zeroed before either side stores into the other's.
  for (auto& s : streams) s.synchronize();
  const uint64_t timeout_ns = static_cast<uint64_t>(std::llround(timeout_s * 1e9));
  const int64_t num_words = a.numel() - kExchangeHeaderWords;
  cudaError_t launched[2] = {cudaSuccess, cudaSuccess};
  for (int side = 0; side < 2; ++side) {
    if (side == stall_side) continue;  // the test hook: this side never runs
    const c10::cuda::CUDAGuard guard(devices[side]);
    launched[side] = launch_peer_exchange(ends[side]->mutable_data_ptr<int64_t>(),
                                          ends[1 - side]->mutable_data_ptr<int64_t>(), num_words, rounds, u64(seed),
                                          side, timeout_ns, corrupt_round, results[side].mutable_data_ptr<int64_t>(),
                                          streams[side].stream());
    if (launched[side] != cudaSuccess) break;  // the other side, if it runs, ends by its wait limit
  }
  // Both streams waited for before anything can throw: a side still running writes into the other's buffer
  // and into its result, which must not be freed under it.
  cudaError_t waited[2];
  for (int side = 0; side < 2; ++side) {
    const c10::cuda::CUDAGuard guard(devices[side]);
    waited[side] = cudaStreamSynchronize(streams[side].stream());
  }
  for (cudaError_t e : {launched[0], launched[1], waited[0], waited[1]}) C10_CUDA_CHECK(e);
  return at::stack({results[0].cpu(), results[1].cpu()});
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CUDA, m) { m.impl("peer_exchange", &peer_exchange_cuda); }

}  // namespace pyxfer
