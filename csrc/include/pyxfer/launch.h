// The seam between torch-aware bindings (csrc/cuda/) and torch-free kernels (csrc/kernels/).
// Plain pointers, sizes and streams in; a cudaError_t out (the launch's cudaGetLastError()).
// Callers check it once with C10_CUDA_CHECK. Nothing here synchronizes.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/verify_words.h"

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

// ---- verified GPU copies (csrc/kernels/verified_copy.cu; driven by csrc/cuda/transfer_device.cpp) ----
// Guarded kernels publish into VerifyWords (pyxfer/verify_words.h): each hash XOR the running device's
// canary, then a run token for `seq`. Their scratch is device memory of the device they run on, zero
// before a launch and left zero by it (the last block takes the sums and resets the ticket), so one
// scratch serves every kernel of one stream in turn; `out` / hash words may be mapped host memory.

// Device scratch of the guarded kernels: running sums and the ticket of the kernel in flight.
struct HashScratch {
  unsigned long long acc[2];  // [0] the destination's (or the hashed buffer's) sum, [1] the source's
  unsigned int blocks_done;
  unsigned int unused;
};

// Fault injection's "always wrong" rule, applied by the kernel that finalizes the destination hash:
// if it equals the source hash, XOR the destination byte byte_in_word of `word` with 1 (and hash the
// flipped word). word == nullptr: no fault to make sure of.
struct EnsureWrong {
  uint8_t* word = nullptr;             // the destination word holding the byte (8-byte aligned)
  uint64_t word_index = 0;             // its index in the hashed buffer (its key)
  uint32_t word_bytes = 8;             // 1..8 (the last word of a buffer may be partial)
  uint32_t byte_in_word = 0;
  const uint64_t* src_word = nullptr;  // VerifyWords::src, published before the kernel started (not
  uint64_t src_canary = 0;             // used by the GPU-local kernel, which has the source sum itself)
};

// Sets this device's canary (the current device's instance of it), read by every guarded kernel.
cudaError_t launch_set_device_canary(uint64_t canary, cudaStream_t stream);

// GPU-local verified copy, one kernel: copies num_bytes (> 0) from src (any alignment) to dst (16-byte
// aligned, else cudaErrorInvalidValue) as `fault` says, hashing the source as read and the destination
// as read back from L2 after its store, and publishes both into *out (src, dst, then both tokens).
// Runs on the current device, which holds both.
cudaError_t launch_copy_verify_local(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, const CopyFault& fault,
                                     const EnsureWrong& ensure, HashScratch* scratch, VerifyWords* out, uint64_t seq,
                                     cudaStream_t stream);

// GPU -> GPU, on the destination (current device, holding dst, 16-byte aligned): pulls num_bytes (> 0)
// from src (a peer GPU's memory with access enabled; any alignment) as `fault` says, hashes the
// destination as read back after its stores, and publishes out->dst and out->dst_token.
cudaError_t launch_pull_verify(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, const CopyFault& fault,
                               const EnsureWrong& ensure, HashScratch* scratch, VerifyWords* out, uint64_t seq,
                               cudaStream_t stream);

// Adds the PXH64 terms of data[0, num_bytes) (any alignment), keyed from word `word_offset`, to
// scratch->acc[0], with at most max_blocks blocks (0: one wave). With hash_word (the last range of a
// hash: nothing else may add to the scratch meanwhile), the last block finalizes the whole hash of
// hash_bytes, resets the scratch and publishes it (hash_word, then token_word). A whole buffer of at
// most kSmallHashBytes goes through one block and needs no scratch. Runs on the current device.
cudaError_t launch_hash_verify(const void* data, uint64_t num_bytes, uint64_t word_offset, uint64_t max_blocks,
                               HashScratch* scratch, uint64_t* hash_word, uint64_t* token_word, uint64_t seq,
                               uint64_t hash_bytes, const EnsureWrong& ensure, cudaStream_t stream);

// One wave of launch_hash_verify's kernel on the current device (what max_blocks is a share of).
uint64_t hash_wave_blocks();

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

// The deferred checker of a guarded verification (pyxfer/verify_words.h): judges *words for call `seq`
// (source hashed on the device with src_canary, destination on dst_canary), latches a mismatch in
// *latch (device memory of the current device) and prefills the words again, consuming the tokens.
// `words` may be mapped host memory written by other devices (read uncached). One thread.
cudaError_t launch_check_verify(VerifyWords* words, uint64_t seq, uint64_t src_canary, uint64_t dst_canary,
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
