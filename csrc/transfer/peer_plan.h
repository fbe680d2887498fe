// Verified GPU -> GPU copies, the device-generic part: the knobs that tune them (environment, read
// once) and a pair's schedule from its rates with the knobs applied. The CUDA path
// (csrc/cuda/transfer_device.cpp) and the test ops of csrc/transfer/peer_plan.cpp share it.
#pragma once

#include <cstdint>

#include "pyxfer/peer_schedule.h"

namespace pyxfer {

// Copies whose host waits by polling the words the kernels publish (no longer: an event wait).
constexpr int64_t kSpinWaitBytes = int64_t(64) << 20;

struct PeerKnobs {
  int64_t fused_max = kDefaultFusedPeerBytes;  // PYXFER_PEER_FUSED_MIB="<MiB>" (0: always the copy engine)
  int64_t shrink = 0, min_chunk = 0;           // PYXFER_PEER_CHUNKS="<shrink>,<min chunk MiB>" (0: from the rates)
  double hash_grid = 0;   // PYXFER_PEER_HASH_GRID="<share of a wave>" for both hashes beside the copy (0: rates)
  double link_gbps = 0;   // PYXFER_PEER_RATES="<link GB/s>,<hash GB/s>" (0: each pair measured once)
  double hash_gbps = 0;
};

// The knobs, read at the first call; a malformed value raises a RuntimeError naming the variable and
// the expected form (at every call: nothing is cached until all of them parse).
const PeerKnobs& peer_knobs();

// schedule_from_rates with PYXFER_PEER_CHUNKS and PYXFER_PEER_HASH_GRID applied.
PeerSchedule tuned_schedule(double link_gbps, double hash_gbps, int64_t wave_blocks);

}  // namespace pyxfer
