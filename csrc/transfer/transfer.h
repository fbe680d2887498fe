// Verified transfers: the protocol (csrc/transfer/transfer.cpp) is written once, generic over where
// the bytes live; a TransferPath supplies the mechanics of one copy between two devices. The host
// path (CPU <-> CPU) lives beside the protocol; the CUDA path (any end on a GPU) registers itself
// from csrc/cuda/transfer_cuda.cpp when pyxfer is built with CUDA.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pyxfer {

enum class Route { kAuto, kDirect, kStaged };
enum class Verify { kNone, kSync, kDeferred };
enum class FaultKind { kNone, kZeros, kBitflip, kStale, kTruncate, kShift };

// Device codes used by the health registry, fault selectors and error records: -1 is the CPU,
// n >= 0 is cuda:n.
constexpr int64_t kCpuCode = -1;
constexpr int64_t kAnyDevice = -2;
inline int64_t device_code(const at::Device& d) { return d.is_cpu() ? kCpuCode : d.index(); }
std::string device_name(int64_t code);

// What one copy writes, after fault injection (pyxfer.testing) had its say. Offsets in bytes.
// Without a fault: copy all num_bytes from offset 0 to offset 0.
struct CopyPlan {
  int64_t num_bytes = 0;   // size of the source and destination
  int64_t src_offset = 0;  // copy [src_offset, src_offset + length) ...
  int64_t dst_offset = 0;  // ... to [dst_offset, dst_offset + length)
  int64_t length = 0;
  bool zero_fill = false;  // write zeros over the whole destination instead of copying
  int64_t flip_byte = -1;  // after the copy, XOR this destination byte with flip_mask
  uint8_t flip_mask = 0;
};

// One chunk of a plan: destination bytes [begin, end) and what to do with them.
struct PlanChunk {
  int64_t begin, end;
  int64_t copy_src, copy_dst, copy_length;  // the part of the plan's copy inside this chunk
  bool zero_fill;
  int64_t flip_byte;  // inside [begin, end), or -1
};
// Calls fn(PlanChunk) for consecutive destination chunks [begin, next_end(begin)); every end but the
// last must be a multiple of 8 (PXH64 chunks compose on word boundaries).
template <typename NextEnd, typename Fn>
void for_each_range(const CopyPlan& plan, const NextEnd& next_end, const Fn& fn) {
  for (int64_t begin = 0; begin < plan.num_bytes;) {
    const int64_t end = std::min(plan.num_bytes, next_end(begin));
    const int64_t lo = std::max(begin, plan.dst_offset), hi = std::min(end, plan.dst_offset + plan.length);
    PlanChunk c{begin, end, 0, 0, 0, plan.zero_fill, -1};
    if (!plan.zero_fill && lo < hi) {
      c.copy_src = plan.src_offset + (lo - plan.dst_offset);
      c.copy_dst = lo;
      c.copy_length = hi - lo;
    }
    if (plan.flip_byte >= begin && plan.flip_byte < end) c.flip_byte = plan.flip_byte;
    fn(c);
    begin = end;
  }
}

// Chunks of a fixed size (a multiple of 8).
template <typename Fn>
void for_each_chunk(const CopyPlan& plan, int64_t chunk_bytes, const Fn& fn) {
  for_each_range(plan, [&](int64_t begin) { return begin + chunk_bytes; }, fn);
}

// The mechanics of one copy from the source tensor's device to a destination device, for one attempt:
// make_dst, copy, compare (unless verify is kNone), in that order. verified_copy builds one path per
// call (it validates the devices and answers the routing questions) and reuses it for the first
// attempt; a staged repair gets a fresh one.
class TransferPath {
 public:
  virtual ~TransferPath() = default;
  virtual at::Device dst_device() const = 0;  // resolved (an index for CUDA)
  // Whether the direct route exists for this pair (peer access between two GPUs; always otherwise).
  virtual bool direct_supported() const = 0;
  // Whether a current stream of either device is capturing a CUDA graph (no host waits allowed).
  virtual bool capturing() const = 0;
  // The destination tensor (contiguous), allocated so that every later step is ordered after it, and
  // whatever `verify` needs beside it.
  virtual at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype, Verify verify) = 0;
  // Execute `plan` (src/dst contiguous, same number of bytes) along `route`; unless verify is kNone,
  // also hash (PXH64, seed 0) the source on its device and the destination on its device after the
  // data landed. Afterwards, work on the destination device's current stream sees the copied bytes.
  virtual void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) = 0;
  // kSync: wait for both hashes, store them and return whether they match.
  // kDeferred: compare without a host wait where the device allows it; a mismatch is latched
  // (take_transfer_errors) and true is returned.
  virtual bool compare(uint64_t* src_value, uint64_t* dst_value) = 0;
};

// A mismatch found by a deferred comparison, kept until take_transfer_errors().
struct TransferErrorRecord {
  int64_t count = 0;  // mismatches since the last take
  int64_t src = 0, dst = 0, num_bytes = 0;
  uint64_t src_hash = 0, dst_hash = 0;
};

// The checksum op through the dispatcher (runs on t's device, current stream).
at::Tensor checksum_op(const at::Tensor& t, int64_t seed);

// Registered by the CUDA build. Returns a path for a pair with at least one CUDA end.
using CudaPathFactory = std::unique_ptr<TransferPath> (*)(const char* op, const at::Tensor& src, at::Device dst);
using CudaErrorTaker = TransferErrorRecord (*)();
void register_cuda_transfer(CudaPathFactory factory, CudaErrorTaker taker);

// Host latch for deferred comparisons done on the CPU; shared with the CUDA path for the cases it
// compares on the host.
void latch_host_error(int64_t src, int64_t dst, int64_t num_bytes, uint64_t src_hash, uint64_t dst_hash);

// Staging pool settings shared by every staged copy (bytes per slot, number of slots).
struct StagingConfig {
  int64_t chunk_bytes;
  int64_t num_slots;
};
StagingConfig staging_config();

// The catch-all ops without tensor arguments (schemas in csrc/torch_bindings.cpp).
int64_t health_status_op(int64_t src, int64_t dst);
void health_mark_op(int64_t src, int64_t dst, int64_t state);
void health_reset_op();
int64_t fault_push_op(c10::string_view kind, int64_t src, int64_t dst, c10::string_view path, int64_t times,
                      int64_t seed);
int64_t fault_pop_op(int64_t id);
void configure_staging_op(int64_t chunk_bytes, int64_t num_slots);
std::vector<int64_t> take_transfer_errors_op();

}  // namespace pyxfer
