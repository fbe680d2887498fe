// Fault injection (pyxfer.testing): armed faults turn the next copies of a pair on a path into
// wrong writes, described as a CopyPlan that every path executes.
#pragma once

#include <cstdint>

#include "transfer/transfer.h"

namespace pyxfer {

// The plan for the next copy of num_bytes from src to dst (device codes) along route (kDirect or
// kStaged), with a pending fault applied (and counted as used).
CopyPlan plan_copy(int64_t src, int64_t dst, Route route, int64_t num_bytes);

// Whether a pending "skip_kernel" fault hits this direct copy from src to dst (counted as used if so):
// then the copy does not launch the kernel that publishes its destination hash (a test of the guards
// that catch a kernel that did not run). Asked only by paths that have such a kernel (GPU copies).
bool take_skip_kernel(int64_t src, int64_t dst);

}  // namespace pyxfer
