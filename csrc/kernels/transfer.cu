// Small kernels of the verified-transfer protocol: the deferred mismatch latch and checker, and the byte
// flips used by fault injection; and the plain SM copy that `pyxfer bench` times (pull and push).
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/launch.h"
#include "pyxfer/resident_blocks.h"
#include "pyxfer/verify_words.h"

namespace pyxfer {
namespace {

// Counts a mismatch in *latch and records its details (one thread).
__device__ void latch_record(TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                             uint64_t src_hash, uint64_t dst_hash) {
  const unsigned long long i = atomicAdd(&latch->count, 1ull);
  TransferLatchRecord* r = &latch->records[i % kLatchRecords];
  atomicExch(&r->seq, 0ull);  // incomplete while the fields change (a reader skips it)
  __threadfence();
  volatile TransferLatchRecord* v = r;
  v->src_device = src_device;
  v->dst_device = dst_device;
  v->num_bytes = num_bytes;
  v->src_hash = src_hash;
  v->dst_hash = dst_hash;
  __threadfence();
  atomicExch(&r->seq, i + 1);
}

__global__ void latch_mismatch_kernel(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                      TransferLatch* latch, int64_t src_device, int64_t dst_device,
                                      int64_t num_bytes) {
  // NOTE: uncached loads: the hashes may sit in mapped host memory written by another device.
  const uint64_t expected = src_hash != nullptr ? __ldcv(reinterpret_cast<const unsigned long long*>(src_hash))
                                                : src_hash_value;
  const uint64_t got = __ldcv(reinterpret_cast<const unsigned long long*>(dst_hash));
  if (expected != got) latch_record(latch, src_device, dst_device, num_bytes, expected, got);
}

// The deferred checker of a guarded verification (pyxfer/verify_words.h): judge the words, latch a
// mismatch, then prefill them again, consuming this call's tokens (a kernel of the next call, or of
// the next replay, that does not run leaves the prefill, which fails the check).
__global__ void check_verify_kernel(VerifyWords* words, uint64_t seq, uint64_t src_canary, uint64_t dst_canary,
                                    TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes) {
  // NOTE: uncached loads: mapped host memory written by kernels on both devices.
  const auto load = [](const uint64_t* p) { return uint64_t(__ldcv(reinterpret_cast<const unsigned long long*>(p))); };
  VerifyWords w;
  w.src = load(&words->src);
  w.dst = load(&words->dst);
  w.src_token = load(&words->src_token);
  w.dst_token = load(&words->dst_token);
  const verify::Verdict v = verify::judge(w, seq, src_canary, dst_canary);
  if (!v.ok) latch_record(latch, src_device, dst_device, num_bytes, v.src_hash, v.dst_hash);
  verify::prefill(words);
  __threadfence_system();
}

__global__ void flip_if_equal_kernel(const uint64_t* a, uint64_t a_value, const uint64_t* b, uint8_t* byte) {
  const uint64_t x = a != nullptr ? __ldcv(reinterpret_cast<const unsigned long long*>(a)) : a_value;
  if (x == __ldcv(reinterpret_cast<const unsigned long long*>(b))) *byte ^= 1;
}

__global__ void xor_byte_kernel(uint8_t* byte, uint8_t mask) { *byte ^= mask; }

constexpr int kCopyThreads = 512;
constexpr int kCopyUnroll = 4;  // loads in flight per thread before its stores: peer reads are slow to return

__global__ void __launch_bounds__(kCopyThreads)
    sm_copy_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, uint64_t num_vectors) {
  const uint64_t stride = uint64_t(gridDim.x) * kCopyThreads;
  uint64_t i = uint64_t(blockIdx.x) * kCopyThreads + threadIdx.x;
  for (; i + (kCopyUnroll - 1) * stride < num_vectors; i += kCopyUnroll * stride) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) dst[i + k * stride] = v[k];
  }
  for (; i < num_vectors; i += stride) dst[i] = src[i];
}

__global__ void __launch_bounds__(kCopyThreads)
    sm_copy_bytes_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t num_bytes) {
  const uint64_t stride = uint64_t(gridDim.x) * kCopyThreads;
  for (uint64_t i = uint64_t(blockIdx.x) * kCopyThreads + threadIdx.x; i < num_bytes; i += stride) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_latch_mismatch(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                  TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                  cudaStream_t stream) {
  latch_mismatch_kernel<<<1, 1, 0, stream>>>(src_hash, src_hash_value, dst_hash, latch, src_device, dst_device,
                                             num_bytes);
  return cudaGetLastError();
}

cudaError_t launch_check_verify(VerifyWords* words, uint64_t seq, uint64_t src_canary, uint64_t dst_canary,
                                TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                cudaStream_t stream) {
  check_verify_kernel<<<1, 1, 0, stream>>>(words, seq, src_canary, dst_canary, latch, src_device, dst_device,
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

cudaError_t launch_sm_copy(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, cudaStream_t stream) {
  if (num_bytes == 0) return cudaSuccess;
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const uint64_t vectors = aligned ? num_bytes / 16 : 0, tail = num_bytes - vectors * 16;
  if (vectors > 0) {
    uint64_t blocks = (vectors + kCopyThreads - 1) / kCopyThreads;
    const uint64_t wave = max_resident_blocks<sm_copy_kernel, kCopyThreads>();
    sm_copy_kernel<<<unsigned(blocks < wave ? blocks : wave), kCopyThreads, 0, stream>>>(
        reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), vectors);
  }
  if (tail > 0) {  // the bytes after the last whole vector, or all of a misaligned copy
    uint64_t blocks = (tail + kCopyThreads - 1) / kCopyThreads;
    const uint64_t wave = max_resident_blocks<sm_copy_bytes_kernel, kCopyThreads>();
    sm_copy_bytes_kernel<<<unsigned(blocks < wave ? blocks : wave), kCopyThreads, 0, stream>>>(
        dst + vectors * 16, src + vectors * 16, tail);
  }
  return cudaGetLastError();
}
}  // namespace pyxfer
