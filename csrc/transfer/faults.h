// Fault injection (pyxfer.testing): armed faults turn the next copies of a pair on a path into
// wrong writes, described as a CopyPlan that every path executes.
#pragma once

#include <cstdint>

#include "transfer/transfer.h"

namespace pyxfer {

// The plan for the next copy of num_bytes from src to dst (device codes) along route (kDirect or
// kStaged), with a pending fault applied (and counted as used).
CopyPlan plan_copy(int64_t src, int64_t dst, Route route, int64_t num_bytes);

}  // namespace pyxfer
