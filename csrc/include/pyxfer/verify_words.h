// What the checker of a verified GPU copy reads, and the guards that make a match mean that the
// hashing kernels really ran, on the devices they were meant for, in this call. Torch-free; shared by
// the kernels (csrc/kernels/verified_copy.cu, transfer.cu), the host (csrc/cuda/transfer_device.cpp)
// and the CPU test op (csrc/transfer/peer_plan.cpp) bit for bit.
//
// Three guards, each closing a way in which two hashes could agree without proving the copy:
//   prefill  the words start every copy (and end every deferred check) as {kPrefillSrc, kPrefillDst,
//            0, 0}: hashes that were never written differ, and tokens that were never written are 0,
//            which no run token is;
//   token    the kernel that writes a hash then writes run_token(seq, its device's canary): the
//            checker expects the call's sequence number (a leftover of another call, or a replay whose
//            kernel did not run after the check consumed the last one, does not match);
//   canary   each device holds its own canary (a __device__ variable: one instance per device),
//            XORed into every hash a guarded kernel publishes and into its token, and removed by the
//            checker with the canary of the device that should have run it: a kernel that ran on
//            another device (the legacy stream of the wrong current device) publishes a wrong token,
//            and between two GPUs a wrong hash too (a GPU-local copy's two hashes carry the same
//            canary, so there the token is what tells).
#pragma once

#include <stdint.h>

#include "pyxfer/host_device.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {

// One verification's results. In mapped pinned host memory (valid on every device through UVA): the
// source's kernel writes src / src_token from the source GPU, the destination's kernel dst / dst_token
// from the destination GPU; neither crosses the peer link whose copy it checks.
struct alignas(32) VerifyWords {
  uint64_t src;        // PXH64 of the source ^ canary of the device that hashed it
  uint64_t dst;        // PXH64 of the destination ^ canary of the device that hashed it
  uint64_t src_token;  // run_token(seq, canary) of the kernel that wrote src, written after src
  uint64_t dst_token;  // likewise for dst
};

constexpr uint64_t kPrefillSrc = 0x50524546494C4C53ull;  // "PREFILLS"
constexpr uint64_t kPrefillDst = ~kPrefillSrc;

namespace verify {

// The canary of CUDA device `device` (ordinal in this process): distinct for distinct ordinals (mix is
// a bijection) and never 0, the value of a device whose canary was never set.
PYXFER_HOST_DEVICE uint64_t device_canary(int64_t device) {
  return pxh64::mix(0x43414E4152593634ull ^ (uint64_t(device) + 1) * pxh64::kK);
}

// What a guarded kernel of call `seq` writes after its hash, on the device with `canary`. Odd, so
// never the 0 of a prefilled or consumed token.
PYXFER_HOST_DEVICE uint64_t run_token(uint64_t seq, uint64_t canary) {
  return pxh64::mix(seq * pxh64::kM2 ^ canary) | 1u;
}

PYXFER_HOST_DEVICE void prefill(volatile VerifyWords* w) {
  w->src = kPrefillSrc;
  w->dst = kPrefillDst;
  w->src_token = 0;
  w->dst_token = 0;
}

struct Verdict {
  bool ok;
  uint64_t src_hash, dst_hash;  // the PXH64s as published, canaries removed
};

// The checker's decision on a snapshot of the words of call `seq` whose source was hashed on the
// device with src_canary and destination on the device with dst_canary (equal for a GPU-local copy).
PYXFER_HOST_DEVICE Verdict judge(const VerifyWords& w, uint64_t seq, uint64_t src_canary, uint64_t dst_canary) {
  Verdict v;
  v.src_hash = w.src ^ src_canary;
  v.dst_hash = w.dst ^ dst_canary;
  v.ok = w.src_token == run_token(seq, src_canary) && w.dst_token == run_token(seq, dst_canary) &&
         v.src_hash == v.dst_hash;
  return v;
}

}  // namespace verify
}  // namespace pyxfer
