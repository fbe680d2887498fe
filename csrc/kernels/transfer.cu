// Small kernels of the verified-transfer protocol: the deferred mismatch latch, the bit flip used by
// fault injection, and the one-block PXH64 of small transfers.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/launch.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace {

__global__ void latch_mismatch_kernel(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                      TransferLatch* latch, int64_t src_device, int64_t dst_device,
                                      int64_t num_bytes) {
  const uint64_t expected = src_hash != nullptr ? *src_hash : src_hash_value;
  const uint64_t got = *dst_hash;
  if (expected == got) return;
  atomicAdd_system(&latch->count, 1ull);
  if (atomicCAS_system(&latch->claimed, 0ull, 1ull) == 0ull) {
    latch->src_device = src_device;
    latch->dst_device = dst_device;
    latch->num_bytes = num_bytes;
    latch->src_hash = expected;
    latch->dst_hash = got;
    __threadfence_system();
  }
}

__global__ void xor_byte_kernel(uint8_t* byte, uint8_t mask) { *byte ^= mask; }

constexpr int kSmallThreads = 512;

// One block: thread t sums the terms of words t, t + 512, ... (coalesced), then a block reduction and
// thread 0 finalizes. The same sum as the multi-block kernel (PXH64 is a plain modular sum of terms).
__global__ void __launch_bounds__(kSmallThreads)
    pxh64_small_kernel(const uint8_t* data, uint64_t num_bytes, uint64_t seed, uint64_t* out) {
  const uint64_t num_words = (num_bytes + 7) / 8;
  const uint64_t full_words = (reinterpret_cast<uintptr_t>(data) % 8 == 0) ? num_bytes / 8 : 0;
  uint64_t sum = 0;
  for (uint64_t r = threadIdx.x; r < num_words; r += kSmallThreads) {
    const uint64_t w = r < full_words ? reinterpret_cast<const uint64_t*>(data)[r]
                                      : pxh64::load_partial_word(data + r * 8, num_bytes - r * 8);
    sum += pxh64::term(w, pxh64::key(seed, r));
  }
  __shared__ uint64_t warp_sums[kSmallThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int i = 1; i < kSmallThreads / 32; ++i) sum += warp_sums[i];
  *out = pxh64::finalize(sum, num_bytes, seed);
}

}  // namespace

cudaError_t launch_latch_mismatch(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                  TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                  cudaStream_t stream) {
  latch_mismatch_kernel<<<1, 1, 0, stream>>>(src_hash, src_hash_value, dst_hash, latch, src_device, dst_device,
                                             num_bytes);
  return cudaGetLastError();
}

cudaError_t launch_xor_byte(uint8_t* byte, uint8_t mask, cudaStream_t stream) {
  xor_byte_kernel<<<1, 1, 0, stream>>>(byte, mask);
  return cudaGetLastError();
}

cudaError_t launch_pxh64_small(const void* data, uint64_t num_bytes, uint64_t seed, uint64_t* out,
                               cudaStream_t stream) {
  if (num_bytes > kSmallHashBytes) return cudaErrorInvalidValue;
  pxh64_small_kernel<<<1, kSmallThreads, 0, stream>>>(static_cast<const uint8_t*>(data), num_bytes, seed, out);
  return cudaGetLastError();
}

}  // namespace pyxfer
