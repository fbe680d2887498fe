// The per-pair health registry and its ops (schemas in csrc/torch_bindings.cpp).
#include "transfer/health.h"

#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>

namespace pyxfer {
namespace {

std::mutex health_mutex;
std::map<std::pair<int64_t, int64_t>, int64_t> health;

int64_t health_status_op(int64_t src, int64_t dst) { return health_get(src, dst); }

void health_mark_op(int64_t src, int64_t dst, int64_t state) {
  TORCH_CHECK(state >= kUnknown && state <= kCorrupt, "pyxfer.health.mark: state must be 0, 1 or 2, got ", state);
  health_set(src, dst, state);
}

void health_reset_op() {
  std::lock_guard<std::mutex> lock(health_mutex);
  health.clear();
}

}  // namespace

int64_t health_get(int64_t src, int64_t dst) {
  std::lock_guard<std::mutex> lock(health_mutex);
  auto it = health.find({src, dst});
  return it == health.end() ? kUnknown : it->second;
}

void health_set(int64_t src, int64_t dst, int64_t state) {
  std::lock_guard<std::mutex> lock(health_mutex);
  health[{src, dst}] = state;
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) {
  m.impl("health_status", &health_status_op);
  m.impl("health_mark", &health_mark_op);
  m.impl("health_reset", &health_reset_op);
}

}  // namespace pyxfer
