// Small kernels of the verified-transfer protocol: the deferred mismatch latch and the bit flip used
// by fault injection.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/launch.h"

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
}  // namespace pyxfer
