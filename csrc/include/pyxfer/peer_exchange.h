// The concurrent peer exchange that `pyxfer doctor` runs on a GPU pair (torch.ops.pyxfer.peer_exchange): both
// sides run at the same time, each writing rounds of words into the other's memory and polling flags in its
// own, as NCCL's producer and consumer kernels do. Shared bit for bit by the CPU reference (two threads,
// csrc/cpu/peer_exchange_cpu.cpp) and the CUDA kernel (csrc/kernels/transfer.cu).
//
// Each side owns one int64 buffer: kHeaderWords of header, then the inbox's words.
//   header[kReady]  the last round the partner finished writing into this inbox (written by the partner)
//   header[kAck]    the last round of this side's data the partner has checked (written by the partner)
// Round r (1..rounds) of a side: wait until its ack >= r - 1 (the partner checked the previous round, so the
// inbox may be overwritten), write exchange_word(seed, side, r, i) into the partner's inbox, release
// ready = r there; wait until its own ready >= r, check its inbox against the partner's words, release the
// partner's ack = r. Every wait is on the side's own memory; every write to the partner is a store into peer
// memory. A wait longer than the timeout ends the side's run (timed_out).
#pragma once

#include <cstdint>

#include "pyxfer/host_device.h"

namespace pyxfer {

constexpr int kExchangeThreads = 256;  // one block per side
constexpr int64_t kExchangeHeaderWords = 16;  // 128 bytes: the flags on their own cache line
constexpr int64_t kExchangeReady = 0, kExchangeAck = 1;
// One row of the op's result per side (row 0: what side 0, buffer a, found in its inbox: the b -> a direction).
constexpr int64_t kExchangeResultWords = 5;
constexpr int64_t kResultWrong = 0, kResultFirstBadRound = 1, kResultFirstBadWord = 2, kResultRoundsDone = 3,
                  kResultTimedOut = 4;

// The word side `side` writes at index i of round r (splitmix64 of the four): never the same word twice, so
// a stale round or a misplaced word shows.
PYXFER_HOST_DEVICE uint64_t exchange_word(uint64_t seed, int64_t side, int64_t round, int64_t i) {
  uint64_t z = seed ^ (uint64_t(side) << 62) ^ (uint64_t(round) << 40) ^ uint64_t(i);
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace pyxfer
