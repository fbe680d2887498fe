// PXH64 on the GPU: one streaming read of the data, a per-thread 64-bit sum, warp shuffles, one
// atomic add per block. Bit-identical to the CPU reference whatever the grid (the sum is modular).
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "pyxfer/launch.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread

// How one launch splits its byte range (all indices are words relative to `data`):
//   [0, head_words)                     at most one 8-byte word before the 16-byte-aligned body
//   [head_words, head_words + 2*num_vectors)   the body, read as 16-byte vectors
//   [tail_begin, num_words)             the rest (and everything when data is not 8-byte aligned)
struct Plan {
  const uint8_t* data;
  uint64_t num_bytes;
  uint64_t word_offset;
  uint64_t seed;
  uint64_t head_words;
  uint64_t num_vectors;
  uint64_t tail_begin;
  uint64_t num_words;
};

// Word `r` of the range at any alignment; bytes past num_bytes read as zero.
// NOTE: the aligned 8-byte loads may touch bytes just before `data` or just past the end, but
// only inside an aligned word that also holds a byte of the range, so never outside its allocation.
__device__ __forceinline__ uint64_t load_word(const uint8_t* data, uint64_t num_bytes, uint64_t r) {
  const uint64_t begin = r * pxh64::kWordBytes;
  const uint64_t count = num_bytes - begin < 8 ? num_bytes - begin : 8;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data + begin);
  const unsigned misalign = unsigned(addr & 7u);
  const uint64_t* aligned = reinterpret_cast<const uint64_t*>(addr - misalign);
  uint64_t w = aligned[0] >> (8 * misalign);
  if (misalign != 0 && 8 - misalign < count) w |= aligned[1] << (64 - 8 * misalign);
  if (count < 8) w &= (uint64_t(1) << (8 * count)) - 1;
  return w;
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

__global__ void __launch_bounds__(kThreads)
    pxh64_kernel(Plan plan, unsigned long long* acc, unsigned int* blocks_done, uint64_t* out_hash,
                 uint64_t hash_bytes) {
  const uint64_t num_threads = uint64_t(gridDim.x) * kThreads;
  const uint64_t tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  uint64_t sum = 0;

  // Body: vector v holds words head + 2v and head + 2v + 1. Keys advance by a constant per step.
  const uint4* body = reinterpret_cast<const uint4*>(plan.data + plan.head_words * 8);
  const uint64_t first_key = pxh64::key(plan.seed, plan.word_offset + plan.head_words + 2 * tid);
  const uint64_t thread_step = 2 * num_threads * pxh64::kK;  // key distance between v and v+T
  uint64_t key = first_key;
  for (uint64_t v = tid; v < plan.num_vectors; v += kUnroll * num_threads) {
    uint4 vec[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t vu = v + u * num_threads;
      vec[u] = vu < plan.num_vectors ? __ldcs(body + vu) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v + u * num_threads < plan.num_vectors) {
        const uint64_t k0 = key + u * thread_step;
        const uint64_t w0 = (uint64_t(vec[u].y) << 32) | vec[u].x;
        const uint64_t w1 = (uint64_t(vec[u].w) << 32) | vec[u].z;
        sum += pxh64::term(w0, k0) + pxh64::term(w1, k0 + pxh64::kK);
      }
    }
    key += kUnroll * thread_step;
  }

  // Head word and tail words, any alignment.
  if (tid == 0 && plan.head_words != 0)
    sum += pxh64::term(load_word(plan.data, plan.num_bytes, 0), pxh64::key(plan.seed, plan.word_offset));
  for (uint64_t r = plan.tail_begin + tid; r < plan.num_words; r += num_threads)
    sum += pxh64::term(load_word(plan.data, plan.num_bytes, r), pxh64::key(plan.seed, plan.word_offset + r));

  __shared__ uint64_t warp_sums[kThreads / 32];
  sum = warp_sum(sum);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x >= 32) return;
  sum = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0;
  sum = warp_sum(sum);
  if (threadIdx.x != 0) return;
  atomicAdd(acc, static_cast<unsigned long long>(sum));
  if (out_hash == nullptr) return;
  // NOTE: last-block finalization: the fence orders this block's add before its ticket, so the
  // block that draws the last ticket sees every block's contribution.
  __threadfence();
  if (atomicAdd(blocks_done, 1u) == gridDim.x - 1) {
    const uint64_t total = atomicAdd(acc, 0ull);
    *out_hash = pxh64::finalize(total, hash_bytes, plan.seed);
  }
}

__global__ void pxh64_combine_kernel(const uint64_t* partials, int64_t num_partials,
                                     uint64_t num_bytes, uint64_t seed, uint64_t* out_hash) {
  uint64_t sum = 0;
  for (int64_t i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
  sum = warp_sum(sum);
  if (threadIdx.x == 0) *out_hash = pxh64::finalize(sum, num_bytes, seed);
}

// A grid of exactly the blocks that fit on the device at once (no ragged last wave).
// Cached per device ordinal; the launch runs on the current device (the binding's guard).
uint64_t max_resident_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 1;
  int blocks = cache[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pxh64_kernel, kThreads, 0) != cudaSuccess)
      return 1;  // the caller's cudaGetLastError() reports the failure
    blocks = sms * (per_sm > 0 ? per_sm : 1);
    cache[device].store(blocks, std::memory_order_relaxed);
  }
  return uint64_t(blocks);
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
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
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
  Plan plan{static_cast<const uint8_t*>(data), num_bytes, word_offset, seed, 0, 0, 0, 0};
  plan.num_words = (num_bytes + 7) / 8;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
  if (addr % 8 == 0) {
    plan.head_words = (addr % 16 == 8 && num_bytes >= 8) ? 1 : 0;
    plan.num_vectors = (num_bytes - plan.head_words * 8) / 16;
  }
  plan.tail_begin = plan.head_words + 2 * plan.num_vectors;
  const uint64_t work = plan.num_vectors / kUnroll + (plan.num_words - plan.tail_begin);
  uint64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  const uint64_t max_blocks = max_resident_blocks();
  if (blocks > max_blocks) blocks = max_blocks;
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
