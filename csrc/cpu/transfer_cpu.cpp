// The CPU <-> CPU path of verified transfers (the protocol is csrc/transfer/verified_copy.cpp): memcpy
// spread over the host hashing pool (cpu/host_pool.h), each item hashed as it lands, or through one bounded
// staging buffer for the staged route; hashes on the host.
#include <ATen/ATen.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/host_pool.h"
#include "pyxfer/pxh64.h"
#include "transfer/errors.h"
#include "transfer/staging.h"
#include "transfer/transfer.h"

namespace pyxfer {
namespace {

// Staged host copies go through one bounded buffer of chunk_bytes, reused (like the pinned pool).
std::mutex host_staging_mutex;
std::vector<uint8_t> host_staging;

// Applies chunk `c` of a plan to the destination (zeros, the copy, a flipped bit).
void apply_chunk(uint8_t* d, const uint8_t* s, const PlanChunk& c, uint8_t flip_mask) {
  if (c.zero_fill) std::memset(d + c.begin, 0, size_t(c.end - c.begin));
  if (c.copy_length > 0) std::memcpy(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length));
  if (c.flip_byte >= 0) d[c.flip_byte] ^= flip_mask;
}

class HostPath final : public TransferPath {
 public:
  at::Device dst_device() const override { return at::kCPU; }
  bool direct_supported() const override { return true; }
  bool capturing() const override { return false; }
  void check_capturable(const char*, const at::Tensor&, Verify) const override {}

  // pin_memory is for copies from a GPU: a CPU -> CPU result is pageable.
  at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype, Verify verify, bool /*pin_memory*/) override {
    verify_ = verify;
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  }

  void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) override {
    num_bytes_ = plan.num_bytes;
    auto* d = static_cast<uint8_t*>(dst.data_ptr());
    const auto* s = static_cast<const uint8_t*>(src.data_ptr());
    const bool hash = verify_ != Verify::kNone;
    bool dst_hashed = false;
    if (route == Route::kStaged) {
      copy_staged(d, s, plan);
      if (hash) src_hash_ = host_hash(s, plan.num_bytes);
    } else {
      copy_direct(d, s, plan, hash);  // hashes both ends as it goes
      dst_hashed = hash;
    }
    if (plan.ensure_byte >= 0 && std::memcmp(d, s, size_t(plan.num_bytes)) == 0) {
      d[plan.ensure_byte] ^= 1;
      dst_hashed = false;
    }
    if (hash && !dst_hashed) dst_hash_ = host_hash(d, plan.num_bytes);
  }

  bool compare(uint64_t* src_value, uint64_t* dst_value) override {
    *src_value = src_hash_;
    *dst_value = dst_hash_;
    if (src_hash_ == dst_hash_) return true;
    if (verify_ != Verify::kDeferred) return false;
    latch_host_error(kCpuCode, kCpuCode, num_bytes_, src_hash_, dst_hash_);
    return true;
  }

 private:
  static uint64_t host_hash(const uint8_t* p, int64_t n) {
    return pxh64::finalize(host_pxh64_sum(p, n, 0, 0), uint64_t(n), 0);
  }

  // On the host hashing pool, one destination item at a time: hash the source's bytes of the item, write
  // the item as the plan says, then hash what landed there.
  void copy_direct(uint8_t* d, const uint8_t* s, const CopyPlan& plan, bool hash) {
    const int64_t items = (plan.num_bytes + kHostItemBytes - 1) / kHostItemBytes;
    std::vector<uint64_t> src_sums(size_t(items), 0), dst_sums(size_t(items), 0);
    const auto item = [&](const PlanChunk& c) {
      const size_t i = size_t(c.begin / kHostItemBytes);
      if (hash) src_sums[i] = pxh64_range_sum(s, c.begin, c.end);
      apply_chunk(d, s, c, plan.flip_mask);
      if (hash) dst_sums[i] = pxh64_range_sum(d, c.begin, c.end);
    };
    if (items <= 1) {
      for_each_chunk(plan, kHostItemBytes, item);
    } else {
      HostTasks tasks;  // NOTE: declared after what its tasks use (destroyed, and waited for, first)
      for_each_chunk(plan, kHostItemBytes, [&](const PlanChunk& c) { tasks.run([&item, c] { item(c); }); });
      tasks.wait();
    }
    uint64_t src_sum = 0, dst_sum = 0;
    for (int64_t i = 0; i < items; ++i) {
      src_sum += src_sums[size_t(i)];
      dst_sum += dst_sums[size_t(i)];
    }
    src_hash_ = pxh64::finalize(src_sum, uint64_t(plan.num_bytes), 0);
    dst_hash_ = pxh64::finalize(dst_sum, uint64_t(plan.num_bytes), 0);
  }

  // Through one bounded buffer of chunk_bytes, reused (like the pinned pool).
  static void copy_staged(uint8_t* d, const uint8_t* s, const CopyPlan& plan) {
    const std::lock_guard<std::mutex> lock(host_staging_mutex);
    const int64_t chunk = staging_config().chunk_bytes;
    host_staging.resize(size_t(chunk));
    for_each_chunk(plan, chunk, [&](const PlanChunk& c) {
      if (c.zero_fill) std::memset(d + c.begin, 0, size_t(c.end - c.begin));
      if (c.copy_length > 0) {
        std::memcpy(host_staging.data(), s + c.copy_src, size_t(c.copy_length));
        std::memcpy(d + c.copy_dst, host_staging.data(), size_t(c.copy_length));
      }
      if (c.flip_byte >= 0) d[c.flip_byte] ^= plan.flip_mask;
    });
  }

  Verify verify_ = Verify::kNone;
  int64_t num_bytes_ = 0;
  uint64_t src_hash_ = 0, dst_hash_ = 0;
};

bool serves(at::DeviceType src, at::DeviceType dst) { return src == at::kCPU && dst == at::kCPU; }

std::unique_ptr<TransferPath> make_host_path(const char* /*op*/, const at::Tensor& /*src*/, at::Device /*dst*/) {
  return std::make_unique<HostPath>();
}

// Deferred mismatches of this path go to the host latch at once: nothing to take.
const bool registered = register_path_family({&serves, &make_host_path, nullptr});

}  // namespace
}  // namespace pyxfer
