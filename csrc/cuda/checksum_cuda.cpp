// CUDA bindings of the PXH64 ops: validate -> guard the data's device -> its current stream -> launch.
// NOTE: c10/cuda headers only (not ATen/cuda/CUDAContext.h, which needs cuBLAS/cuSPARSE headers).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/pxh64_cuda.h"
#include "pyxfer/launch.h"

namespace pyxfer {
namespace {

uint64_t* u64_ptr(const at::Tensor& t) { return reinterpret_cast<uint64_t*>(t.data_ptr<int64_t>()); }

// Sum t's logical bytes keyed from `word_offset` into *acc (zeroed here); with `out_hash`, the last
// block also writes the finalized PXH64 there. Current device and stream.
void pxh64_launch(const at::Tensor& contiguous, int64_t word_offset, int64_t seed, uint64_t* out_hash,
                  at::Tensor& workspace) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // workspace: [0] the running sum, [1] the count of finished blocks (the last block finalizes)
  C10_CUDA_CHECK(cudaMemsetAsync(workspace.data_ptr(), 0, workspace.nbytes(), stream));
  uint32_t* blocks_done = out_hash ? reinterpret_cast<uint32_t*>(u64_ptr(workspace) + 1) : nullptr;
  C10_CUDA_CHECK(launch_pxh64(contiguous.data_ptr(), contiguous.nbytes(), u64(word_offset), u64(seed),
                              u64_ptr(workspace), blocks_done, out_hash, contiguous.nbytes(), stream));
}

at::Tensor checksum_cuda(const at::Tensor& t, int64_t seed) {
  check_dense("pyxfer.checksum", "t", t);
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor out = at::empty({}, t.options().dtype(at::kLong));
  pxh64_into(t.contiguous(), seed, u64_ptr(out));  // hash the logical row-major bytes
  return out;
}

at::Tensor checksum_partial_cuda(const at::Tensor& t, int64_t word_offset, int64_t seed) {
  check_dense("pyxfer.checksum_partial", "t", t);
  check_non_negative("pyxfer.checksum_partial", "word_offset", word_offset);
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor sum = at::empty({}, t.options().dtype(at::kLong));  // the partial sum is the result
  pxh64_launch(t.contiguous(), word_offset, seed, nullptr, sum);
  return sum;
}

at::Tensor checksum_combine_cuda(const at::Tensor& partials, int64_t num_bytes, int64_t seed) {
  check_partials("pyxfer.checksum_combine", partials);
  check_non_negative("pyxfer.checksum_combine", "num_bytes", num_bytes);
  const c10::cuda::CUDAGuard guard(partials.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor c = partials.contiguous();
  at::Tensor out = at::empty({}, partials.options());
  C10_CUDA_CHECK(launch_pxh64_combine(u64_ptr(c), c.numel(), u64(num_bytes), u64(seed), u64_ptr(out), stream));
  return out;
}

}  // namespace

at::Tensor pxh64_into(const at::Tensor& t, int64_t seed, uint64_t* out) {
  if (uint64_t(t.nbytes()) <= kSmallHashBytes) {  // one launch, no workspace to zero: the latency path
    C10_CUDA_CHECK(launch_pxh64_small(t.data_ptr(), t.nbytes(), u64(seed), out, c10::cuda::getCurrentCUDAStream()));
    return at::Tensor();
  }
  at::Tensor workspace = at::empty({2}, t.options().dtype(at::kLong));
  pxh64_launch(t, 0, seed, out, workspace);
  return workspace;
}

TORCH_LIBRARY_IMPL(pyxfer, CUDA, m) {
  m.impl("checksum", &checksum_cuda);
  m.impl("checksum_partial", &checksum_partial_cuda);
  m.impl("checksum_combine", &checksum_combine_cuda);
}

}  // namespace pyxfer
