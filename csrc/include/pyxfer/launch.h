// The seam between torch-aware bindings (csrc/cuda/) and torch-free kernels (csrc/kernels/).
// Plain pointers, sizes and streams in; a cudaError_t out (the launch's cudaGetLastError()).
// Callers check it once with C10_CUDA_CHECK. Nothing here synchronizes.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace pyxfer {

// Adds the PXH64 partial sum of data[0, num_bytes) into *acc (atomically, mod 2^64). Word j of the
// range is keyed as absolute word `word_offset + j`. `data` may have any alignment.
// If `out_hash` is not null, the last block to finish also writes
// finalize(*acc, hash_bytes, seed) to *out_hash; then *blocks_done must start at zero and no other
// launch may add to *acc meanwhile (*acc may already hold the partial sums of the earlier ranges of
// the same hash: a pipelined copy finalizes its whole destination hash with its last chunk).
// Runs on the current device, which must be the one holding `data`.
cudaError_t launch_pxh64(const void* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed,
                         uint64_t* acc, uint32_t* blocks_done, uint64_t* out_hash,
                         uint64_t hash_bytes, cudaStream_t stream);

// *out_hash = finalize(sum of partials[0, num_partials), num_bytes, seed). One tiny launch.
cudaError_t launch_pxh64_combine(const uint64_t* partials, int64_t num_partials,
                                 uint64_t num_bytes, uint64_t seed, uint64_t* out_hash,
                                 cudaStream_t stream);

// What a copy writes under fault injection (pyxfer.testing; the identity is {0, 0, num_bytes, false,
// -1, 0}): copy src[src_offset, +length) to dst[dst_offset, ...), or zeros everywhere; bytes outside
// keep their old value; then XOR byte flip_byte (if >= 0) with flip_mask.
struct CopyFault {
  uint64_t src_offset, dst_offset, length;
  bool zero_fill;
  int64_t flip_byte;
  uint8_t flip_mask;
};

// Copies num_bytes from src to dst (both 16-byte aligned, else cudaErrorInvalidValue; src may be on
// a peer GPU with access enabled) as `fault` says, and adds the PXH64 (seed 0) terms of the
// destination, read back after it landed, to *acc; the last block writes finalize(*acc, num_bytes, 0)
// to *out_hash. *acc and *blocks_done must start at zero. Runs on the current device, which must be
// the one holding dst: one kernel does the copy and the destination hash (no copy-engine step, no
// dependency between two operations in the tail).
cudaError_t launch_copy_pxh64(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, const CopyFault& fault,
                              uint64_t* acc, uint32_t* blocks_done, uint64_t* out_hash, cudaStream_t stream);

// Copies num_bytes from src to dst with SM loads and stores (16-byte vectors where both are 16-byte
// aligned), a grid of one wave. Either pointer may be on a peer GPU with access enabled. Runs on the
// current device.
cudaError_t launch_sm_copy(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, cudaStream_t stream);

// Largest input of launch_pxh64_small: one block reads it in about a microsecond.
constexpr uint64_t kSmallHashBytes = uint64_t(64) << 10;

// *out = PXH64(data[0, num_bytes), seed) from one block, with no workspace to zero first: the latency
// path of small transfers (one launch instead of memset + launch). num_bytes <= kSmallHashBytes; any
// alignment; `out` may be device memory or mapped host memory. Runs on the current device, which must
// be the one holding `data`.
cudaError_t launch_pxh64_small(const void* data, uint64_t num_bytes, uint64_t seed, uint64_t* out,
                               cudaStream_t stream);

}  // namespace pyxfer

namespace pyxfer {

// Mismatches seen by deferred verification, in device memory of the one device whose kernels write
// it (device-scope atomics: atomic on every host, unlike system-scope atomics on mapped host memory
// without host-native atomics). The host only reads it, after waiting for the device: it never
// resets it (a replayed graph may still be writing), it remembers how many it has reported.
constexpr int kLatchRecords = 16;
struct TransferLatchRecord {
  unsigned long long seq;  // i + 1 once mismatch i's fields below are complete; 0 or another value: not
  long long src_device, dst_device, num_bytes;
  unsigned long long src_hash, dst_hash;
};
struct TransferLatch {
  unsigned long long count;                        // mismatches ever latched here (never reset)
  TransferLatchRecord records[kLatchRecords];  // mismatch i in records[i % kLatchRecords]
};

// If *dst_hash differs from the source hash (*src_hash, or src_hash_value when src_hash is null),
// count it in *latch (device memory of the current device) and record its details. `src_hash` may be
// mapped host memory written by another device (read uncached). One thread, no host wait.
cudaError_t launch_latch_mismatch(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                  TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                  cudaStream_t stream);

// Fault injection that always writes wrong bytes: if PXH64 `a` (*a, or a_value when a is null) equals
// PXH64 `b` (*b) -- the faulty destination still equals the source -- *byte ^= 1. `a` and `b` may be
// mapped host memory written by other devices (read uncached). One thread.
cudaError_t launch_flip_if_equal(const uint64_t* a, uint64_t a_value, const uint64_t* b, uint8_t* byte,
                                 cudaStream_t stream);

// *byte ^= mask (fault injection: one flipped bit, written like any other device write).
cudaError_t launch_xor_byte(uint8_t* byte, uint8_t mask, cudaStream_t stream);
}  // namespace pyxfer
