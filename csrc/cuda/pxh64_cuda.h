// PXH64 of a CUDA tensor for other CUDA bindings (csrc/cuda/transfer_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pyxfer {

// *out = PXH64(t's bytes, seed); t must be contiguous; `out` is device memory reachable from t's
// device, or mapped host memory. Runs on the current device and stream (the caller guards them):
// one one-block launch up to kSmallHashBytes, else a workspace memset and the multi-block kernel.
// No host sync. Returns the workspace (undefined for the one-block launch): a caller whose launches
// a CUDA graph captures outside the graph's memory pool keeps it for the graph's lifetime.
at::Tensor pxh64_into(const at::Tensor& t, int64_t seed, uint64_t* out);

}  // namespace pyxfer
