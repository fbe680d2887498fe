// PXH64 on the GPU: one streaming read of the data, a per-thread 64-bit sum, warp shuffles, one
// atomic add per block. Bit-identical to the CPU reference whatever the grid (the sum is modular).
// The kernels of verified copies (copies that hash as they go) are in verified_copy.cu.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/launch.h"
#include "pyxfer/pxh64.h"
#include "pyxfer/pxh64_device.cuh"
#include "pyxfer/resident_blocks.h"

namespace pyxfer {
namespace {

using pxh64_device::kThreads;
using pxh64_device::Plan;

// Adds the block's terms (`sum` of each of its kThreads threads) to *acc; with `out_hash`, the last
// block to finish writes finalize(*acc, hash_bytes, seed) there. Every thread of the block calls it.
__device__ __forceinline__ void add_block_sum(uint64_t sum, unsigned long long* acc, unsigned int* blocks_done,
                                              uint64_t* out_hash, uint64_t hash_bytes, uint64_t seed) {
  sum = pxh64_device::block_sum(sum);
  if (threadIdx.x != 0) return;
  atomicAdd(acc, static_cast<unsigned long long>(sum));
  if (out_hash == nullptr) return;
  // NOTE: last-block finalization: the block that draws the last ticket sees every block's add.
  if (pxh64_device::last_block(blocks_done)) {
    const uint64_t total = atomicAdd(acc, 0ull);
    *out_hash = pxh64::finalize(total, hash_bytes, seed);
  }
}

__global__ void __launch_bounds__(kThreads)
    pxh64_kernel(Plan plan, unsigned long long* acc, unsigned int* blocks_done, uint64_t* out_hash,
                 uint64_t hash_bytes) {
  const uint64_t num_threads = uint64_t(gridDim.x) * kThreads;
  const uint64_t tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  add_block_sum(pxh64_device::thread_sum(plan, tid, num_threads), acc, blocks_done, out_hash, hash_bytes, plan.seed);
}

__global__ void pxh64_combine_kernel(const uint64_t* partials, int64_t num_partials,
                                     uint64_t num_bytes, uint64_t seed, uint64_t* out_hash) {
  uint64_t sum = 0;
  for (int64_t i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
  sum = pxh64_device::warp_sum(sum);
  if (threadIdx.x == 0) *out_hash = pxh64::finalize(sum, num_bytes, seed);
}

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
  sum = pxh64_device::warp_sum(sum);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int i = 1; i < kSmallThreads / 32; ++i) sum += warp_sums[i];
  *out = pxh64::finalize(sum, num_bytes, seed);
}

}  // namespace

cudaError_t launch_pxh64(const void* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed,
                         uint64_t* acc, uint32_t* blocks_done, uint64_t* out_hash,
                         uint64_t hash_bytes, cudaStream_t stream) {
  const Plan plan = pxh64_device::make_plan(data, num_bytes, word_offset, seed);
  const uint64_t blocks = pxh64_device::plan_blocks(plan, max_resident_blocks<pxh64_kernel, kThreads>());
  pxh64_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(
      plan, reinterpret_cast<unsigned long long*>(acc), blocks_done, out_hash, hash_bytes);
  return cudaGetLastError();
}

cudaError_t launch_pxh64_combine(const uint64_t* partials, int64_t num_partials,
                                 uint64_t num_bytes, uint64_t seed, uint64_t* out_hash,
                                 cudaStream_t stream) {
  pxh64_combine_kernel<<<1, 32, 0, stream>>>(partials, num_partials, num_bytes, seed, out_hash);
  return cudaGetLastError();
}

cudaError_t launch_pxh64_small(const void* data, uint64_t num_bytes, uint64_t seed, uint64_t* out,
                               cudaStream_t stream) {
  if (num_bytes > kSmallHashBytes) return cudaErrorInvalidValue;
  pxh64_small_kernel<<<1, kSmallThreads, 0, stream>>>(static_cast<const uint8_t*>(data), num_bytes, seed, out);
  return cudaGetLastError();
}

}  // namespace pyxfer
