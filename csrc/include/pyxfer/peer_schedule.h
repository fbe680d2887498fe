// How a verified GPU -> GPU copy is split, as pure functions of sizes and measured rates (torch-free,
// host only; csrc/cuda/transfer_device.cpp runs them, csrc/transfer/peer_plan.cpp exposes them to the
// CPU tests).
//
// Sizes of the protocols (bytes copied):
//   n <= kSerialPeerBytes   the source hash, then one kernel on the destination that pulls, stores,
//                           reads back and hashes (the two kernels in a row: fewest launches and waits)
//   n <= fused max          the same two kernels side by side (the source hash no longer short)
//   larger                  the copy engine in chunks, chunk k hashed on the destination while k+1 moves
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cmath>

namespace pyxfer {

constexpr int64_t kSerialPeerBytes = int64_t(1) << 20;
constexpr int64_t kDefaultFusedPeerBytes = int64_t(64) << 20;  // PYXFER_PEER_FUSED_MIB overrides
constexpr int64_t kMinPeerChunk = int64_t(4) << 20;           // PYXFER_PEER_CHUNKS overrides
// Used where no pair was measured yet (a copy captured in a CUDA graph before any eager one): one H100
// pair's figures (benchmarks/RESULTS.md).
constexpr double kDefaultLinkGBps = 400.0, kDefaultHashGBps = 3000.0;

// The copy-engine pipeline of one pair.
struct PeerSchedule {
  int64_t shrink;       // each chunk is 1/shrink of the one before (<= 1: one chunk)
  int64_t min_chunk;    // bytes, a multiple of 8: no chunk smaller (the last absorbs the rest)
  int64_t hash_blocks;  // grid of the destination's chunk hashes while the copy engine writes
  int64_t src_blocks;   // grid of the source hash beside the copy
};

// The hash of chunk k (on the destination) runs while chunk k + 1 (1/shrink of it) moves; it stays
// hidden while it hashes at >= shrink x the link rate. A full grid hashes ~7.6x (H100) to ~10.8x (H200)
// the NVLink rate, but it reads HBM at full speed while the copy engine writes the same HBM, and slows
// the copy. So: spend at most kHashShare of the hash rate, keep kSlack of headroom, and give the
// hashes only the blocks that rate needs (linear in blocks up to a wave: memory-bound, one wave).
//   shrink      = floor(kHashShare * R / kSlack), clamped to [2, 16], R = hash / link
//   hash_blocks = ceil(wave * kSlack * shrink / R), clamped to [1, wave]
//   src_blocks  = ceil(wave * 2 * kSlack / R): the source hash ends by ~40% of the copy
// The last chunk (>= min_chunk) is hashed after the copy, alone, with a full grid: the only exposed hash.
inline PeerSchedule schedule_from_rates(double link_gbps, double hash_gbps, int64_t wave_blocks) {
  constexpr double kHashShare = 0.5, kSlack = 1.25;
  const double ratio = hash_gbps / link_gbps;
  const int64_t wave = std::max<int64_t>(1, wave_blocks);
  const auto blocks = [&](double fraction) {
    return std::min(wave, std::max<int64_t>(1, int64_t(std::ceil(double(wave) * fraction))));
  };
  PeerSchedule s;
  s.shrink = std::min<int64_t>(16, std::max<int64_t>(2, int64_t(std::floor(kHashShare * ratio / kSlack))));
  s.min_chunk = kMinPeerChunk;
  s.hash_blocks = blocks(kSlack * double(s.shrink) / ratio);
  s.src_blocks = blocks(2 * kSlack / ratio);
  return s;
}

// End of the chunk that starts at `begin` of a num_bytes copy: (shrink - 1) / shrink of what is left,
// at least min_chunk, and the whole rest when less than min_chunk would remain. Every end but the last
// is a multiple of 8 (PXH64 chunks compose on word boundaries) when begin is.
inline int64_t next_chunk_end(int64_t begin, int64_t num_bytes, int64_t shrink, int64_t min_chunk) {
  const int64_t left = num_bytes - begin;
  if (shrink <= 1) return num_bytes;
  int64_t chunk = std::max(min_chunk, (left - left / shrink + 7) / 8 * 8);
  if (left - chunk < min_chunk) chunk = left;
  return begin + chunk;
}

}  // namespace pyxfer
