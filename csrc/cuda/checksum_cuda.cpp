// CUDA bindings of the PXH64 ops: validate -> guard the data's device -> its current stream -> launch.
// NOTE: c10/cuda headers only (not ATen/cuda/CUDAContext.h, which needs cuBLAS/cuSPARSE headers).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "pyxfer/launch.h"

namespace pyxfer {
namespace {

uint64_t* u64_ptr(const at::Tensor& t) { return reinterpret_cast<uint64_t*>(t.data_ptr<int64_t>()); }

// Hash (or partially sum) t's logical bytes on t's device. With `finalize` the result is the
// PXH64 value, otherwise the unfinalized sum keyed from `word_offset`.
at::Tensor pxh64_cuda(const char* op, const at::Tensor& t, int64_t word_offset, int64_t seed, bool finalize) {
  check_dense(op, "t", t);
  check_non_negative(op, "word_offset", word_offset);
  const c10::cuda::CUDAGuard guard(t.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor c = t.contiguous();  // hash the logical row-major bytes
  const at::TensorOptions options = t.options().dtype(at::kLong);
  // workspace: [0] the running sum, [1] the count of finished blocks (the last block finalizes);
  // a partial sum needs only [0], which is then the result.
  at::Tensor workspace = finalize ? at::empty({2}, options) : at::empty({}, options);
  C10_CUDA_CHECK(cudaMemsetAsync(workspace.data_ptr(), 0, workspace.nbytes(), stream));
  at::Tensor out = finalize ? at::empty({}, options) : workspace;
  uint32_t* blocks_done = finalize ? reinterpret_cast<uint32_t*>(u64_ptr(workspace) + 1) : nullptr;
  C10_CUDA_CHECK(launch_pxh64(c.data_ptr(), c.nbytes(), u64(word_offset), u64(seed), u64_ptr(workspace),
                              blocks_done, finalize ? u64_ptr(out) : nullptr, c.nbytes(), stream));
  return out;
}

at::Tensor checksum_cuda(const at::Tensor& t, int64_t seed) {
  return pxh64_cuda("pyxfer.checksum", t, 0, seed, /*finalize=*/true);
}

at::Tensor checksum_partial_cuda(const at::Tensor& t, int64_t word_offset, int64_t seed) {
  return pxh64_cuda("pyxfer.checksum_partial", t, word_offset, seed, /*finalize=*/false);
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

TORCH_LIBRARY_IMPL(pyxfer, CUDA, m) {
  m.impl("checksum", &checksum_cuda);
  m.impl("checksum_partial", &checksum_partial_cuda);
  m.impl("checksum_combine", &checksum_combine_cuda);
}

}  // namespace pyxfer
