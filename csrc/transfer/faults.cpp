// Fault injection: the registry of armed faults, the plans they turn copies into, and the
// fault_push / fault_pop ops (schemas in csrc/torch_bindings.cpp). A fault hits the copies of the
// thread that armed it unless it was armed process-wide.
#include "transfer/faults.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace pyxfer {
namespace {

enum class FaultKind { kNone, kZeros, kBitflip, kStale, kTruncate, kShift, kSkipKernel };

struct FaultEntry {
  int64_t id;
  FaultKind kind;
  int64_t src, dst;  // device codes or kAnyDevice
  Route path;
  int64_t remaining;
  std::mt19937_64 rng;
  bool process_wide;      // hits every thread's copies; else only those of `owner`
  std::thread::id owner;  // the thread that armed it
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
  if (kind == "skip_kernel") return FaultKind::kSkipKernel;
  TORCH_CHECK(false, "pyxfer.testing.inject_fault: kind must be one of 'zeros', 'bitflip', 'stale', 'truncate', "
              "'shift', 'skip_kernel', got '", std::string(kind), "'");
}

int64_t fault_push_op(c10::string_view kind, int64_t src, int64_t dst, c10::string_view path, int64_t times,
                      int64_t seed, bool process_wide) {
  constexpr const char* op = "pyxfer.testing.inject_fault";
  const FaultKind k = parse_fault_kind(kind);
  TORCH_CHECK(path == "direct" || path == "staged", op, ": path must be 'direct' or 'staged', got '",
              std::string(path), "'");
  TORCH_CHECK(times >= 1, op, ": times must be >= 1, got ", times);
  TORCH_CHECK(k != FaultKind::kSkipKernel || path == "direct", op, ": kind 'skip_kernel' needs path='direct' (the "
              "kernels it skips are those of direct GPU copies), got path='", std::string(path), "'");
  std::lock_guard<std::mutex> lock(fault_mutex);
  faults.push_back({next_fault_id, k, src, dst, path == "direct" ? Route::kDirect : Route::kStaged, times,
                    std::mt19937_64(uint64_t(seed)), process_wide, std::this_thread::get_id()});
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

bool hits(const FaultEntry& f, int64_t src, int64_t dst, Route route, std::thread::id me) {
  return f.remaining > 0 && f.path == route && (f.src == kAnyDevice || f.src == src) &&
         (f.dst == kAnyDevice || f.dst == dst) && (f.process_wide || f.owner == me);
}

}  // namespace

bool take_skip_kernel(int64_t src, int64_t dst) {
  if (num_faults.load(std::memory_order_acquire) == 0) return false;
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(fault_mutex);
  for (FaultEntry& f : faults) {
    if (f.kind != FaultKind::kSkipKernel || !hits(f, src, dst, Route::kDirect, me)) continue;
    --f.remaining;
    return true;
  }
  return false;
}

CopyPlan plan_copy(int64_t src, int64_t dst, Route route, int64_t num_bytes) {
  CopyPlan plan{num_bytes, 0, 0, num_bytes, false, -1, 0};
  if (num_bytes == 0) return plan;  // nothing to corrupt: a pending fault waits for a real copy
  if (num_faults.load(std::memory_order_acquire) == 0) return plan;
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(fault_mutex);
  for (FaultEntry& f : faults) {
    if (f.kind == FaultKind::kSkipKernel || !hits(f, src, dst, route, me)) continue;
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
      case FaultKind::kNone:
      case FaultKind::kSkipKernel: break;
    }
    // Where the kind's bytes equal the source's, the copy must still be wrong somewhere: in the
    // part the fault kept from before (truncate: the missing tail; shift: the head it skipped).
    if (f.kind != FaultKind::kBitflip) plan.ensure_byte = f.kind == FaultKind::kTruncate ? num_bytes - 1 : 0;
    break;
  }
  return plan;
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) {
  m.impl("fault_push", &fault_push_op);
  m.impl("fault_pop", &fault_pop_op);
}

}  // namespace pyxfer
