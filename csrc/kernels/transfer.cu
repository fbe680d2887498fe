// Small kernels of the verified-transfer protocol: the deferred mismatch latch and the byte flips used
// by fault injection.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/launch.h"

namespace pyxfer {
namespace {

__global__ void latch_mismatch_kernel(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                      TransferLatch* latch, int64_t src_device, int64_t dst_device,
                                      int64_t num_bytes) {
  // NOTE: uncached loads: the hashes may sit in mapped host memory written by another device.
  const uint64_t expected = src_hash != nullptr ? __ldcv(reinterpret_cast<const unsigned long long*>(src_hash))
                                                : src_hash_value;
  const uint64_t got = __ldcv(reinterpret_cast<const unsigned long long*>(dst_hash));
  if (expected == got) return;
  const unsigned long long i = atomicAdd(&latch->count, 1ull);
  TransferLatchRecord* r = &latch->records[i % kLatchRecords];
  atomicExch(&r->seq, 0ull);  // incomplete while the fields change (a reader skips it)
  __threadfence();
  volatile TransferLatchRecord* v = r;
  v->src_device = src_device;
  v->dst_device = dst_device;
  v->num_bytes = num_bytes;
  v->src_hash = expected;
  v->dst_hash = got;
  __threadfence();
  atomicExch(&r->seq, i + 1);
}

__global__ void flip_if_equal_kernel(const uint64_t* a, uint64_t a_value, const uint64_t* b, uint8_t* byte) {
  const uint64_t x = a != nullptr ? __ldcv(reinterpret_cast<const unsigned long long*>(a)) : a_value;
  if (x == __ldcv(reinterpret_cast<const unsigned long long*>(b))) *byte ^= 1;
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

cudaError_t launch_flip_if_equal(const uint64_t* a, uint64_t a_value, const uint64_t* b, uint8_t* byte,
                                 cudaStream_t stream) {
  flip_if_equal_kernel<<<1, 1, 0, stream>>>(a, a_value, b, byte);
  return cudaGetLastError();
}

cudaError_t launch_xor_byte(uint8_t* byte, uint8_t mask, cudaStream_t stream) {
  xor_byte_kernel<<<1, 1, 0, stream>>>(byte, mask);
  return cudaGetLastError();
}
}  // namespace pyxfer
