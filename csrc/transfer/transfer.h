// Verified transfers: the protocol (csrc/transfer/verified_copy.cpp) is written once, generic over
// where the bytes live; a TransferPath supplies the mechanics of one copy between two devices. Each
// family of paths registers itself (register_path_family) from its own file: the host path
// (CPU <-> CPU) from csrc/cpu/transfer_cpu.cpp, the CUDA path (any end on a GPU) from
// csrc/cuda/transfer_cuda.cpp when pyxfer is built with CUDA.
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
  // A fault always writes wrong bytes: if the destination still equals the source after the plan
  // ran (an all-zero source under zeros, a recycled destination that held the source's bytes),
  // XOR this destination byte with 1 before it is hashed. -1: nothing to check (no fault, bitflip).
  int64_t ensure_byte = -1;
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

// The part of chunk `c` inside destination bytes [begin, end), a range inside [c.begin, c.end).
inline PlanChunk narrow_chunk(const PlanChunk& c, int64_t begin, int64_t end) {
  PlanChunk r{begin, end, 0, 0, 0, c.zero_fill, -1};
  const int64_t lo = std::max(begin, c.copy_dst), hi = std::min(end, c.copy_dst + c.copy_length);
  if (c.copy_length > 0 && lo < hi) {
    r.copy_src = c.copy_src + (lo - c.copy_dst);
    r.copy_dst = lo;
    r.copy_length = hi - lo;
  }
  if (c.flip_byte >= begin && c.flip_byte < end) r.flip_byte = c.flip_byte;
  return r;
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
  // While capturing: raises (naming `op`) for what a replay could not repeat with `src` (contiguous or
  // not) and `verify` -- a CPU end that only the capture would touch, a non-contiguous source whose
  // contiguous copy would be made once. The protocol checks the route and verify='sync' itself.
  virtual void check_capturable(const char* op, const at::Tensor& src, Verify verify) const = 0;
  // The destination tensor (contiguous), allocated so that every later step is ordered after it, and
  // whatever `verify` needs beside it. pin_memory: a CPU destination of a copy from a GPU is page-locked
  // (torch's caching host allocator) rather than pageable; paths without such a pair ignore it.
  virtual at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype, Verify verify, bool pin_memory) = 0;
  // Execute `plan` (src/dst contiguous, same number of bytes) along `route`; unless verify is kNone,
  // also hash (PXH64, seed 0) the source on its device and the destination on its device after the
  // data landed. Afterwards, work on the destination device's current stream sees the copied bytes.
  virtual void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) = 0;
  // kSync: wait for both hashes, store them and return whether they match.
  // kDeferred: compare without a host wait where the device allows it; a mismatch is latched
  // (take_transfer_errors) and true is returned.
  virtual bool compare(uint64_t* src_value, uint64_t* dst_value) = 0;
};

// The checksum op through the dispatcher (runs on t's device, current stream).
at::Tensor checksum_op(const at::Tensor& t, int64_t seed);
// PXH64 (seed 0) of a CPU tensor, read straight from the op's 0-dim result (no item() dispatch).
uint64_t cpu_hash(const at::Tensor& t);

struct TransferErrors;  // transfer/errors.h

// The first attempt of a verified copy made without a TransferPath (PathFamily::fast_attempt).
struct FastAttempt {
  at::Tensor dst;
  at::Device dst_device{at::kCPU};  // resolved
  bool ok = true;
  uint64_t src_hash = 0, dst_hash = 0;  // kSync: both hashes (also when they differ)
};

// A family of paths: which device pairs it serves and how to make a path for one of them.
struct PathFamily {
  bool (*serves)(at::DeviceType src, at::DeviceType dst);
  // Returns a path for a served pair; validates device indices (messages name `op` and the argument).
  std::unique_ptr<TransferPath> (*make)(const char* op, const at::Tensor& src, at::Device dst);
  // Mismatches latched by the calling thread's deferred copies on this family's devices since its
  // last call, after waiting for the devices that ran them (and its captured graphs' devices); null
  // where they all go to the host latch (latch_host_error).
  TransferErrors (*take_errors)();
  // Optional: the first attempt of verified_copy(src, device, requested, verify) on the direct route
  // with no per-call heap objects (the latency path of small copies), for the cases the family serves
  // that way; false -- having done nothing (no fault consumed, nothing queued) -- for every other case
  // (any it is not sure of, bad input included), which then takes the general path.
  bool (*fast_attempt)(const at::Tensor& src, at::Device device, Route requested, Verify verify,
                       FastAttempt* out) = nullptr;
};
// Called once per family from a static initializer of the file that implements it (returns true).
// Registration happens while the library loads, before any op runs: readers take no lock.
bool register_path_family(const PathFamily& family);
// The registered families, in registration order.
const std::vector<PathFamily>& path_families();

}  // namespace pyxfer
