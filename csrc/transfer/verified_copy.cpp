// The verified-transfer protocol (docs/design.md "Transfer semantics"), written once for every pair of
// devices: hash the source on its device, copy, hash the destination on its device after the data
// landed, compare. On a mismatch mark the pair corrupt, copy again staged and verify again; if that
// fails too raise pyxfer.TransferError. What a CUDA graph cannot repeat is refused during capture.
// Also autograd (verified_copy and staged_copy), and the registry of path families the
// paths (csrc/cpu/transfer_cpu.cpp, csrc/cuda/transfer_cuda.cpp) register themselves in.
#include "transfer/transfer.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "transfer/errors.h"
#include "transfer/faults.h"
#include "transfer/health.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.verified_copy";
constexpr const char* kStagedNotCapturable =
    "cannot be captured in a CUDA graph (its pinned host buffers are shared with eager copies and resized by "
    "pyxfer.configure_staging, and its host legs would run once, at capture); use route='direct' in the graph, "
    "or copy staged outside it";

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

std::vector<PathFamily>& families() {
  static std::vector<PathFamily> registered;  // filled by static initializers of the path files
  return registered;
}

const PathFamily* family_for(at::DeviceType src, at::DeviceType dst) {
  for (const PathFamily& f : families())
    if (f.serves(src, dst)) return &f;
  return nullptr;
}

void check_device(const char* op, const char* arg, const at::Device& device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), op, ": ", arg, " must be a CPU or CUDA device, got ", device);
  // Only the CUDA family can be missing (a build without CUDA).
  TORCH_CHECK(family_for(device.type(), device.type()) != nullptr, op, ": ", arg, " is ", device,
              " but pyxfer was built without CUDA (pyxfer.build_info()['cuda'] is False)");
}

std::unique_ptr<TransferPath> make_path(const char* op, const at::Tensor& src, const at::Device& dst) {
  check_device(op, "src.device", src.device());
  check_device(op, "device", dst);
  return family_for(src.device().type(), dst.type())->make(op, src, dst);  // validates device indices
}

struct Attempt {
  at::Tensor dst;
  bool ok = true;
  uint64_t src_hash = 0, dst_hash = 0;
};

Attempt attempt(TransferPath& path, const at::Tensor& src, Route route, Verify verify, bool pin_memory) {
  const int64_t src_code = device_code(src.device()), dst_code = device_code(path.dst_device());
  Attempt a;
  a.dst = path.make_dst(src.sizes(), src.scalar_type(), verify, pin_memory);
  const CopyPlan plan = plan_copy(src_code, dst_code, route, int64_t(src.nbytes()));
  path.copy(a.dst, src, route, plan);
  if (verify != Verify::kNone) a.ok = path.compare(&a.src_hash, &a.dst_hash);
  return a;
}

// After the first attempt (on `route`, made by a path or a family's fast attempt): a match returns it;
// a mismatch marks the pair corrupt and copies again staged, verified, or raises.
at::Tensor conclude(const at::Tensor& s, at::Device dst_device, Route route, Verify verify, bool pin_memory,
                    Attempt first) {
  const int64_t src_code = device_code(s.device()), dst_code = device_code(dst_device);
  if (first.ok) {
    if (verify == Verify::kSync && route == Route::kDirect && health_get(src_code, dst_code) == kUnknown)
      health_set(src_code, dst_code, kHealthy);
    return first.dst;
  }
  // NOTE: only the sync mode gets here; nothing unverified is returned.
  health_set(src_code, dst_code, kCorrupt);
  first.dst = at::Tensor();
  std::unique_ptr<TransferPath> path = make_path(kOp, s, dst_device);
  const Attempt second = attempt(*path, s, Route::kStaged, Verify::kSync, pin_memory);
  if (second.ok) return second.dst;
  TransferErrorRecord failure;
  failure.count = 1;
  failure.src = src_code;
  failure.dst = dst_code;
  failure.num_bytes = int64_t(s.nbytes());
  failure.src_hash = first.src_hash;
  failure.dst_hash = first.dst_hash;
  failure.route = route;
  failure.attempt = 2;
  failure.retry_dst_hash = second.dst_hash;
  raise_transfer_error(failure);
}

at::Tensor verified_copy_impl(const at::Tensor& src, at::Device device, c10::string_view route_name,
                              c10::string_view verify_name, bool pin_memory) {
  check_dense(kOp, "src", src);
  const Route requested = parse_route(kOp, route_name);
  const Verify verify = parse_verify(verify_name);
  for (const PathFamily& f : families()) {  // the latency path, where a family has one for this copy
    FastAttempt fast;
    if (f.fast_attempt != nullptr && f.fast_attempt(src, device, requested, verify, &fast)) {
      Attempt first;
      first.dst = std::move(fast.dst);
      first.ok = fast.ok;
      first.src_hash = fast.src_hash;
      first.dst_hash = fast.dst_hash;
      return conclude(src, fast.dst_device, Route::kDirect, verify, pin_memory, std::move(first));
    }
  }
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
  if (path->capturing()) {
    if (route == Route::kStaged && requested == Route::kAuto) {
      TORCH_CHECK(false, kOp, ": route='auto' resolves to the staged route for ", device_name(src_code), " -> ",
                  device_name(dst_code), " (", path->direct_supported() ? "the pair is marked corrupt"
                  : "no peer access between them", "), which ", kStagedNotCapturable);
    }
    TORCH_CHECK(route != Route::kStaged, kOp, ": the staged route ", kStagedNotCapturable);
    path->check_capturable(kOp, src, verify);
  }

  // NOTE: no resolve_conj() / resolve_neg(): the dispatcher's Conjugate and Negative fallbacks
  // materialize lazily conjugated / negated views before this op runs (tests/transfer/test_transfer.py).
  const at::Tensor s = src.contiguous();  // the result is contiguous; hash and copy the same bytes
  Attempt first = attempt(*path, s, route, verify, pin_memory);
  path.reset();  // a repair makes a fresh one
  return conclude(s, dst_device, route, verify, pin_memory, std::move(first));
}

at::Tensor staged_copy_impl(const at::Tensor& src, at::Device device) {
  constexpr const char* op = "pyxfer.staged_copy";
  check_dense(op, "src", src);
  std::unique_ptr<TransferPath> path = make_path(op, src, device);  // validates before any allocation
  TORCH_CHECK(!path->capturing(), op, ": the staged route ", kStagedNotCapturable);
  return attempt(*path, src.contiguous(), Route::kStaged, Verify::kNone, /*pin_memory=*/true).dst;
}

// The op through the dispatcher (from below autograd, or for a backward).
at::Tensor staged_copy_op(const at::Tensor& src, at::Device device) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pyxfer::staged_copy", "")
                             .typed<at::Tensor(const at::Tensor&, at::Device)>();
  return op.call(src, device);
}

// Like VerifiedCopyFunction below: the gradient goes back to the source's device, staged.
class StagedCopyFunction : public torch::autograd::Function<StagedCopyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& src, at::Device device) {
    ctx->saved_data["device"] = src.device();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return staged_copy_op(src, device);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {staged_copy_op(grads[0], ctx->saved_data["device"].toDevice()), at::Tensor()};
  }
};

at::Tensor staged_copy_autograd(const at::Tensor& src, at::Device device) {
  if (!at::GradMode::is_enabled() || !src.requires_grad()) {  // no graph to record: skip the node's cost
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return staged_copy_op(src, device);
  }
  return StagedCopyFunction::apply(src, device);
}

// Autograd in C++ (not torch.library.register_autograd): no Python on the path of every copy.
// Backward moves the gradient back to the source's device through the same kind of verified copy (a
// CPU gradient of a GPU source is pinned, the default: pin_memory is the forward result's choice).
class VerifiedCopyFunction : public torch::autograd::Function<VerifiedCopyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& src, at::Device device,
                            const std::string& route, const std::string& verify, bool pin_memory) {
    ctx->saved_data["device"] = src.device();
    ctx->saved_data["route"] = route;
    ctx->saved_data["verify"] = verify;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return verified_copy_op(src, device, route, verify, pin_memory);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor grad = verified_copy_op(grads[0], ctx->saved_data["device"].toDevice(),
                                             ctx->saved_data["route"].toStringRef(),
                                             ctx->saved_data["verify"].toStringRef(), /*pin_memory=*/true);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

 public:
  static at::Tensor verified_copy_op(const at::Tensor& src, at::Device device, c10::string_view route,
                                     c10::string_view verify, bool pin_memory) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("pyxfer::verified_copy", "")
            .typed<at::Tensor(const at::Tensor&, at::Device, c10::string_view, c10::string_view, bool)>();
    return op.call(src, device, route, verify, pin_memory);
  }
};

at::Tensor verified_copy_autograd(const at::Tensor& src, at::Device device, c10::string_view route,
                                  c10::string_view verify, bool pin_memory) {
  if (!at::GradMode::is_enabled() || !src.requires_grad()) {  // no graph to record: skip the node's cost
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return VerifiedCopyFunction::verified_copy_op(src, device, route, verify, pin_memory);
  }
  return VerifiedCopyFunction::apply(src, device, std::string(route), std::string(verify), pin_memory);
}

}  // namespace

std::string device_name(int64_t code) { return code == kCpuCode ? "cpu" : "cuda:" + std::to_string(code); }

at::Tensor checksum_op(const at::Tensor& t, int64_t seed) {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("pyxfer::checksum", "")
                              .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(t, seed);
}

uint64_t cpu_hash(const at::Tensor& t) { return u64(*checksum_op(t, 0).data_ptr<int64_t>()); }

bool register_path_family(const PathFamily& family) {
  families().push_back(family);
  return true;
}

const std::vector<PathFamily>& path_families() { return families(); }

TORCH_LIBRARY_IMPL(pyxfer, CompositeExplicitAutograd, m) {
  m.impl("verified_copy", &verified_copy_impl);
  m.impl("staged_copy", &staged_copy_impl);
}

TORCH_LIBRARY_IMPL(pyxfer, Autograd, m) {
  m.impl("verified_copy", &verified_copy_autograd);
  m.impl("staged_copy", &staged_copy_autograd);
}

}  // namespace pyxfer
