// The verified-transfer protocol (DESIGN.md "Transfer semantics"), written once for every pair of
// devices: hash the source on its device, copy, hash the destination on its device after the data
// landed, compare. On a mismatch mark the pair corrupt, copy again staged and verify again; if that
// fails too raise pyxfer.TransferError. Also: the per-pair health registry, fault injection, the
// deferred-error latch on the host, the staging settings, and the CPU <-> CPU path.
#include "transfer/transfer.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <vector>

#include "checks.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.verified_copy";
enum HealthState : int64_t { kUnknown = 0, kHealthy = 1, kCorrupt = 2 };

// ---- health registry: ordered (src, dst) device codes -> state -----------------------------------
std::mutex health_mutex;
std::map<std::pair<int64_t, int64_t>, int64_t> health;

int64_t health_get(int64_t src, int64_t dst) {
  std::lock_guard<std::mutex> lock(health_mutex);
  auto it = health.find({src, dst});
  return it == health.end() ? kUnknown : it->second;
}

void health_set(int64_t src, int64_t dst, int64_t state) {
  std::lock_guard<std::mutex> lock(health_mutex);
  health[{src, dst}] = state;
}

// ---- fault injection ------------------------------------------------------------------------------
struct FaultEntry {
  int64_t id;
  FaultKind kind;
  int64_t src, dst;  // device codes or kAnyDevice
  Route path;
  int64_t remaining;
  std::mt19937_64 rng;
};
std::mutex fault_mutex;
std::vector<FaultEntry> faults;
int64_t next_fault_id = 1;
std::atomic<int64_t> num_faults{0};  // faults.size(): copies skip the lock while none is armed

FaultKind parse_fault_kind(c10::string_view kind) {
  if (kind == "zeros") return FaultKind::kZeros;
  if (kind == "bitflip") return FaultKind::kBitflip;
  if (kind == "stale") return FaultKind::kStale;
  if (kind == "truncate") return FaultKind::kTruncate;
  if (kind == "shift") return FaultKind::kShift;
  TORCH_CHECK(false, "pyxfer.testing.inject_fault: kind must be one of 'zeros', 'bitflip', 'stale', 'truncate', "
              "'shift', got '", std::string(kind), "'");
}

Route parse_route(const char* op, c10::string_view route) {
  if (route == "auto") return Route::kAuto;
  if (route == "direct") return Route::kDirect;
  if (route == "staged") return Route::kStaged;
  TORCH_CHECK(false, op, ": route must be 'auto', 'direct' or 'staged', got '", std::string(route), "'");
}

Verify parse_verify(c10::string_view verify) {
  if (verify == "sync") return Verify::kSync;
  if (verify == "deferred") return Verify::kDeferred;
  if (verify == "none") return Verify::kNone;
  TORCH_CHECK(false, kOp, ": verify must be 'sync', 'deferred' or 'none', got '", std::string(verify), "'");
}

// The plan for the next copy of num_bytes from src to dst along route, with a pending fault applied.
CopyPlan plan_copy(int64_t src, int64_t dst, Route route, int64_t num_bytes) {
  CopyPlan plan{num_bytes, 0, 0, num_bytes, false, -1, 0};
  if (num_bytes == 0) return plan;  // nothing to corrupt: a pending fault waits for a real copy
  if (num_faults.load(std::memory_order_acquire) == 0) return plan;
  std::lock_guard<std::mutex> lock(fault_mutex);
  for (FaultEntry& f : faults) {
    if (f.remaining <= 0 || f.path != route || (f.src != kAnyDevice && f.src != src) ||
        (f.dst != kAnyDevice && f.dst != dst))
      continue;
    --f.remaining;
    const int64_t shift = num_bytes > 4 ? 4 : 1;  // "lands a few bytes off"
    switch (f.kind) {
      case FaultKind::kZeros: plan.zero_fill = true; break;  // a dropped write reads back as zeros
      case FaultKind::kBitflip: {
        const uint64_t r = f.rng();
        plan.flip_byte = static_cast<int64_t>((r >> 3) % uint64_t(num_bytes));
        plan.flip_mask = uint8_t(1u << (r & 7));
        break;
      }
      case FaultKind::kStale: plan.length = 0; break;  // nothing arrives: the old bytes stay
      case FaultKind::kTruncate: plan.length = num_bytes - std::max<int64_t>(1, num_bytes / 8); break;
      case FaultKind::kShift: plan.dst_offset = shift; plan.length = num_bytes - shift; break;
      case FaultKind::kNone: break;
    }
    break;
  }
  return plan;
}

// ---- staging settings and the deferred-error latch -------------------------------------------------
std::mutex config_mutex;
StagingConfig config{int64_t(8) << 20, 4};  // 4 slots of 8 MiB

std::mutex latch_mutex;
TransferErrorRecord host_latch;

CudaPathFactory cuda_factory = nullptr;
CudaErrorTaker cuda_error_taker = nullptr;

// ---- the CPU <-> CPU path -------------------------------------------------------------------------
// Staged host copies go through one bounded buffer of chunk_bytes, reused (like the pinned pool).
std::mutex host_staging_mutex;
std::vector<uint8_t> host_staging;

// PXH64 of a CPU tensor, read straight from the op's 0-dim result (no item() dispatch).
uint64_t host_hash(const at::Tensor& t) { return u64(*checksum_op(t, 0).data_ptr<int64_t>()); }

class HostPath final : public TransferPath {
 public:
  at::Device dst_device() const override { return at::kCPU; }
  bool direct_supported() const override { return true; }
  bool capturing() const override { return false; }

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
    if (verify_ == Verify::kNone) return;
    src_hash_ = host_hash(src);
    dst_hash_ = host_hash(dst);
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

void check_device(const char* op, const char* arg, const at::Device& device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), op, ": ", arg, " must be a CPU or CUDA device, got ", device);
  TORCH_CHECK(device.is_cpu() || cuda_factory != nullptr, op, ": ", arg, " is ", device,
              " but pyxfer was built without CUDA (pyxfer.build_info()['cuda'] is False)");
}

std::unique_ptr<TransferPath> make_path(const char* op, const at::Tensor& src, const at::Device& dst) {
  check_device(op, "src.device", src.device());
  check_device(op, "device", dst);
  if (src.device().is_cpu() && dst.is_cpu()) return std::make_unique<HostPath>();
  return cuda_factory(op, src, dst);  // validates CUDA device indices
}

struct Attempt {
  at::Tensor dst;
  bool ok = true;
  uint64_t src_hash = 0, dst_hash = 0;
};

Attempt attempt(TransferPath& path, const at::Tensor& src, Route route, Verify verify) {
  const int64_t src_code = device_code(src.device()), dst_code = device_code(path.dst_device());
  Attempt a;
  a.dst = path.make_dst(src.sizes(), src.scalar_type(), verify);
  const CopyPlan plan = plan_copy(src_code, dst_code, route, int64_t(src.nbytes()));
  path.copy(a.dst, src, route, plan);
  if (verify != Verify::kNone) a.ok = path.compare(&a.src_hash, &a.dst_hash);
  return a;
}

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

at::Tensor verified_copy_impl(const at::Tensor& src, at::Device device, c10::string_view route_name,
                              c10::string_view verify_name) {
  check_dense(kOp, "src", src);
  const Route requested = parse_route(kOp, route_name);
  const Verify verify = parse_verify(verify_name);
  // Validates before any allocation, answers the routing questions, then runs the first attempt.
  std::unique_ptr<TransferPath> path = make_path(kOp, src, device);
  const at::Device dst_device = path->dst_device();
  const int64_t src_code = device_code(src.device()), dst_code = device_code(dst_device);
  Route route = requested;
  if (route == Route::kAuto)
    route = (health_get(src_code, dst_code) == kCorrupt || !path->direct_supported()) ? Route::kStaged : Route::kDirect;
  TORCH_CHECK(route != Route::kDirect || path->direct_supported(), kOp, ": route='direct' is not available from ",
              src.device(), " to ", dst_device, " (no peer access between them); use route='auto' or 'staged'");
  TORCH_CHECK(verify != Verify::kSync || !path->capturing(), kOp,
              ": verify='sync' waits for the checksums, which cannot happen while a CUDA graph is being captured; "
              "use verify='deferred' (then pyxfer.check_transfers() after replays)");

  const at::Tensor s = src.contiguous();  // the result is contiguous; hash and copy the same bytes
  Attempt first = attempt(*path, s, route, verify);
  if (first.ok) {
    if (verify == Verify::kSync && route == Route::kDirect && health_get(src_code, dst_code) == kUnknown)
      health_set(src_code, dst_code, kHealthy);
    return first.dst;
  }
  // NOTE: only the sync mode gets here; nothing unverified is returned.
  health_set(src_code, dst_code, kCorrupt);
  first.dst = at::Tensor();
  path = make_path(kOp, s, dst_device);
  const Attempt second = attempt(*path, s, Route::kStaged, Verify::kSync);
  if (second.ok) return second.dst;
  TORCH_CHECK(false, "pyxfer.TransferError: copy ", device_name(src_code), " -> ", device_name(dst_code), " of ",
              s.nbytes(), " bytes failed verification on the ", route == Route::kDirect ? "direct" : "staged",
              " path and again on the staged path: source PXH64 ", hex(first.src_hash), ", destination PXH64 ",
              hex(first.dst_hash), " (first try), ", hex(second.dst_hash), " (staged retry)");
}

at::Tensor staged_copy_impl(const at::Tensor& src, at::Device device) {
  constexpr const char* op = "pyxfer.staged_copy";
  check_dense(op, "src", src);
  std::unique_ptr<TransferPath> path = make_path(op, src, device);  // validates before any allocation
  return attempt(*path, src.contiguous(), Route::kStaged, Verify::kNone).dst;
}

// Autograd in C++ (not torch.library.register_autograd): no Python on the path of every copy.
// Backward moves the gradient back to the source's device through the same kind of verified copy.
class VerifiedCopyFunction : public torch::autograd::Function<VerifiedCopyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& src, at::Device device,
                            const std::string& route, const std::string& verify) {
    ctx->saved_data["device"] = src.device();
    ctx->saved_data["route"] = route;
    ctx->saved_data["verify"] = verify;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return verified_copy_op(src, device, route, verify);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor grad = verified_copy_op(grads[0], ctx->saved_data["device"].toDevice(),
                                             ctx->saved_data["route"].toStringRef(),
                                             ctx->saved_data["verify"].toStringRef());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }

 public:
  static at::Tensor verified_copy_op(const at::Tensor& src, at::Device device, c10::string_view route,
                                     c10::string_view verify) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("pyxfer::verified_copy", "")
                               .typed<at::Tensor(const at::Tensor&, at::Device, c10::string_view, c10::string_view)>();
    return op.call(src, device, route, verify);
  }
};

at::Tensor verified_copy_autograd(const at::Tensor& src, at::Device device, c10::string_view route,
                                  c10::string_view verify) {
  if (!at::GradMode::is_enabled() || !src.requires_grad()) {  // no graph to record: skip the node's cost
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return VerifiedCopyFunction::verified_copy_op(src, device, route, verify);
  }
  return VerifiedCopyFunction::apply(src, device, std::string(route), std::string(verify));
}

}  // namespace

std::string device_name(int64_t code) { return code == kCpuCode ? "cpu" : "cuda:" + std::to_string(code); }

at::Tensor checksum_op(const at::Tensor& t, int64_t seed) {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("pyxfer::checksum", "")
                              .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(t, seed);
}

void register_cuda_transfer(CudaPathFactory factory, CudaErrorTaker taker) {
  cuda_factory = factory;
  cuda_error_taker = taker;
}

void latch_host_error(int64_t src, int64_t dst, int64_t num_bytes, uint64_t src_hash, uint64_t dst_hash) {
  std::lock_guard<std::mutex> lock(latch_mutex);
  if (host_latch.count++ == 0) {
    host_latch.src = src;
    host_latch.dst = dst;
    host_latch.num_bytes = num_bytes;
    host_latch.src_hash = src_hash;
    host_latch.dst_hash = dst_hash;
  }
}

StagingConfig staging_config() {
  std::lock_guard<std::mutex> lock(config_mutex);
  return config;
}

int64_t health_status_op(int64_t src, int64_t dst) { return health_get(src, dst); }

void health_mark_op(int64_t src, int64_t dst, int64_t state) {
  TORCH_CHECK(state >= kUnknown && state <= kCorrupt, "pyxfer.health.mark: state must be 0, 1 or 2, got ", state);
  health_set(src, dst, state);
}

void health_reset_op() {
  std::lock_guard<std::mutex> lock(health_mutex);
  health.clear();
}

int64_t fault_push_op(c10::string_view kind, int64_t src, int64_t dst, c10::string_view path, int64_t times,
                      int64_t seed) {
  constexpr const char* op = "pyxfer.testing.inject_fault";
  const FaultKind k = parse_fault_kind(kind);
  TORCH_CHECK(path == "direct" || path == "staged", op, ": path must be 'direct' or 'staged', got '",
              std::string(path), "'");
  TORCH_CHECK(times >= 1, op, ": times must be >= 1, got ", times);
  std::lock_guard<std::mutex> lock(fault_mutex);
  faults.push_back({next_fault_id, k, src, dst, path == "direct" ? Route::kDirect : Route::kStaged, times,
                    std::mt19937_64(uint64_t(seed))});
  num_faults.store(int64_t(faults.size()), std::memory_order_release);
  return next_fault_id++;
}

int64_t fault_pop_op(int64_t id) {
  std::lock_guard<std::mutex> lock(fault_mutex);
  for (auto it = faults.begin(); it != faults.end(); ++it) {
    if (it->id == id) {
      const int64_t remaining = it->remaining;
      faults.erase(it);
      num_faults.store(int64_t(faults.size()), std::memory_order_release);
      return remaining;
    }
  }
  return 0;
}

void configure_staging_op(int64_t chunk_bytes, int64_t num_slots) {
  constexpr const char* op = "pyxfer.configure_staging";
  TORCH_CHECK(chunk_bytes >= 4096 && chunk_bytes % 4096 == 0, op,
              ": chunk_bytes must be a positive multiple of 4096, got ", chunk_bytes);
  TORCH_CHECK(num_slots >= 2 && num_slots <= 64, op, ": num_slots must be in [2, 64], got ", num_slots);
  std::lock_guard<std::mutex> lock(config_mutex);
  config = {chunk_bytes, num_slots};
}

std::vector<int64_t> take_transfer_errors_op() {
  TransferErrorRecord r;
  {
    std::lock_guard<std::mutex> lock(latch_mutex);
    r = host_latch;
    host_latch = TransferErrorRecord{};
  }
  if (cuda_error_taker != nullptr) {
    const TransferErrorRecord g = cuda_error_taker();  // waits for the devices with deferred copies
    if (r.count == 0) r = g; else r.count += g.count;
  }
  if (r.count == 0) return {};
  return {r.count, r.src, r.dst, r.num_bytes, int64_t(r.src_hash), int64_t(r.dst_hash)};
}

TORCH_LIBRARY_IMPL(pyxfer, CompositeExplicitAutograd, m) {
  m.impl("verified_copy", &verified_copy_impl);
  m.impl("staged_copy", &staged_copy_impl);
}

TORCH_LIBRARY_IMPL(pyxfer, Autograd, m) { m.impl("verified_copy", &verified_copy_autograd); }

}  // namespace pyxfer
