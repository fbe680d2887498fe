// Argument checks shared by the CPU implementations and the CUDA bindings (torch-aware).
// Every message names the op, the argument, what was expected and what came.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pyxfer {

// A tensor whose bytes an op reads: dense, strided, with storage. Any dtype.
inline void check_dense(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " must be a defined tensor");
  TORCH_CHECK(!t.is_nested(), op, ": ", arg, " must be a dense tensor, got a nested tensor");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " must be a dense strided tensor, got layout ",
              t.layout());
  TORCH_CHECK(t.has_storage(), op, ": ", arg, " must have storage (got a tensor without data)");
}

inline void check_non_negative(const char* op, const char* arg, int64_t value) {
  TORCH_CHECK(value >= 0, op, ": ", arg, " must be >= 0, got ", value);
}

// Partial sums handed to checksum_combine: a 1-D int64 tensor.
inline void check_partials(const char* op, const at::Tensor& partials) {
  check_dense(op, "partials", partials);
  TORCH_CHECK(partials.scalar_type() == at::kLong && partials.dim() == 1, op,
              ": partials must be a 1-D int64 tensor of partial sums, got ", partials.scalar_type(),
              " with shape ", partials.sizes());
}

// sm_copy's operands: dense, contiguous, the same number of bytes (any dtypes).
inline void check_sm_copy(const char* op, const at::Tensor& src, const at::Tensor& dst) {
  check_dense(op, "src", src);
  check_dense(op, "dst", dst);
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": src and dst must be contiguous, got ",
              src.is_contiguous() ? "a non-contiguous dst" : "a non-contiguous src");
  TORCH_CHECK(src.nbytes() == dst.nbytes(), op, ": src and dst must hold the same number of bytes, got ",
              src.nbytes(), " and ", dst.nbytes());
}

// pointer_chase's ring (a 1-D, contiguous, non-empty int64 tensor of node indices) and hop count.
inline void check_pointer_chase(const char* op, const at::Tensor& ring, int64_t num_hops) {
  check_dense(op, "ring", ring);
  TORCH_CHECK_TYPE(ring.scalar_type() == at::kLong, op, ": ring must be an int64 tensor of node indices, got ",
                   ring.scalar_type());
  TORCH_CHECK_VALUE(ring.dim() == 1 && ring.is_contiguous() && ring.numel() > 0, op,
                    ": ring must be a 1-D contiguous tensor with at least one node, got shape ", ring.sizes(),
                    ring.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK_VALUE(num_hops >= 0, op, ": num_hops must be >= 0, got ", num_hops);
}

// PXH64 takes the uint64 bits of int64 arguments (seeds and sums are unsigned by definition).
inline uint64_t u64(int64_t v) { return static_cast<uint64_t>(v); }

}  // namespace pyxfer
