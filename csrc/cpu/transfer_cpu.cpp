// The CPU <-> CPU path of verified transfers (the protocol is csrc/transfer/verified_copy.cpp): plain
// memcpy, or through one bounded staging buffer for the staged route; hashes on the host.
#include <ATen/ATen.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "transfer/errors.h"
#include "transfer/staging.h"
#include "transfer/transfer.h"

namespace pyxfer {
namespace {

// Staged host copies go through one bounded buffer of chunk_bytes, reused (like the pinned pool).
std::mutex host_staging_mutex;
std::vector<uint8_t> host_staging;

class HostPath final : public TransferPath {
 public:
  at::Device dst_device() const override { return at::kCPU; }
  bool direct_supported() const override { return true; }
  bool capturing() const override { return false; }
  void check_capturable(const char*, const at::Tensor&, Verify) const override {}

  at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype, Verify verify) override {
    verify_ = verify;
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  }

  void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) override {
    num_bytes_ = plan.num_bytes;
    auto* d = static_cast<uint8_t*>(dst.data_ptr());
    const auto* s = static_cast<const uint8_t*>(src.data_ptr());
    const int64_t chunk = staging_config().chunk_bytes;
    std::unique_lock<std::mutex> lock(host_staging_mutex, std::defer_lock);
    if (route == Route::kStaged) {
      lock.lock();
      host_staging.resize(size_t(chunk));
    }
    for_each_chunk(plan, chunk, [&](const PlanChunk& c) {
      if (c.zero_fill) std::memset(d + c.begin, 0, size_t(c.end - c.begin));
      if (c.copy_length > 0 && route == Route::kStaged) {
        std::memcpy(host_staging.data(), s + c.copy_src, size_t(c.copy_length));
        std::memcpy(d + c.copy_dst, host_staging.data(), size_t(c.copy_length));
      } else if (c.copy_length > 0) {
        std::memcpy(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length));
      }
      if (c.flip_byte >= 0) d[c.flip_byte] ^= plan.flip_mask;
    });
    if (plan.ensure_byte >= 0 && std::memcmp(d, s, size_t(plan.num_bytes)) == 0) d[plan.ensure_byte] ^= 1;
    if (verify_ == Verify::kNone) return;
    src_hash_ = cpu_hash(src);
    dst_hash_ = cpu_hash(dst);
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
