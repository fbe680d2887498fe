// Argument checks shared by the CPU implementations and the CUDA bindings (torch-aware).
// Every message names the op, the argument, what was expected and what came.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

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

// peer_exchange's buffers (two separate 1-D contiguous int64 tensors of the same length, the header and at
// least one word) and options.
inline void check_peer_exchange(const char* op, const at::Tensor& a, const at::Tensor& b, int64_t rounds,
                                double timeout_s, int64_t corrupt_round, int64_t stall_side, int64_t header_words) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"a", &a}, {"b", &b}}) {
    check_dense(op, name, *t);
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, op, ": ", name, " must be an int64 tensor, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->dim() == 1 && t->is_contiguous() && t->numel() > header_words, op, ": ", name,
                      " must be a 1-D contiguous tensor of more than ", header_words, " words (the header, then "
                      "the inbox), got shape ", t->sizes(), t->is_contiguous() ? "" : " (non-contiguous)");
  }
  TORCH_CHECK_VALUE(a.numel() == b.numel(), op, ": a and b must have the same length, got ", a.numel(), " and ",
                    b.numel());
  TORCH_CHECK_VALUE(!a.is_alias_of(b), op, ": a and b must be two separate buffers, got views of one storage");
  TORCH_CHECK_VALUE(rounds >= 1 && rounds <= 1000000, op, ": rounds must be in [1, 1000000], got ", rounds);
  TORCH_CHECK_VALUE(timeout_s > 0 && timeout_s <= 3600, op, ": timeout_s must be in (0, 3600] seconds, got ",
                    timeout_s);
  TORCH_CHECK_VALUE(corrupt_round == -1 || (corrupt_round >= 1 && corrupt_round <= rounds), op,
                    ": corrupt_round must be -1 (none) or a round in [1, rounds], got ", corrupt_round);
  TORCH_CHECK_VALUE(stall_side >= -1 && stall_side <= 1, op, ": stall_side must be -1 (none), 0 or 1, got ",
                    stall_side);
}

// PXH64 takes the uint64 bits of int64 arguments (seeds and sums are unsigned by definition).
inline uint64_t u64(int64_t v) { return static_cast<uint64_t>(v); }

}  // namespace pyxfer
