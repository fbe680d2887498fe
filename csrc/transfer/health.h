// The per-pair health registry: ordered (src, dst) device codes (transfer/transfer.h) -> state.
// verified_copy reads it to route and writes it after a verified direct copy or a mismatch;
// pyxfer.health reads and marks it through the health_* ops.
#pragma once

#include <cstdint>

namespace pyxfer {

enum HealthState : int64_t { kUnknown = 0, kHealthy = 1, kCorrupt = 2 };

int64_t health_get(int64_t src, int64_t dst);
void health_set(int64_t src, int64_t dst, int64_t state);

}  // namespace pyxfer
