// Device-side building blocks of the PXH64 kernels (csrc/kernels/checksum.cu, verified_copy.cu):
// the split of a byte range into an aligned 16-byte body and 8-byte words, a thread's sum over its
// part, block reductions. Torch-free; include from .cu files only.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace pxh64_device {

constexpr int kThreads = 512;  // threads per block of every multi-block hash kernel
constexpr int kUnroll = 4;     // independent 16-byte loads in flight per thread

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

inline Plan make_plan(const void* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed) {
  Plan plan{static_cast<const uint8_t*>(data), num_bytes, word_offset, seed, 0, 0, 0, 0};
  plan.num_words = (num_bytes + 7) / 8;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
  if (addr % 8 == 0) {
    plan.head_words = (addr % 16 == 8 && num_bytes >= 8) ? 1 : 0;
    plan.num_vectors = (num_bytes - plan.head_words * 8) / 16;
  }
  plan.tail_begin = plan.head_words + 2 * plan.num_vectors;
  return plan;
}

// Blocks for a plan: enough for its work, at most max_blocks.
inline uint64_t plan_blocks(const Plan& plan, uint64_t max_blocks) {
  const uint64_t work = plan.num_vectors / kUnroll + (plan.num_words - plan.tail_begin);
  uint64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  return blocks < max_blocks ? blocks : max_blocks;
}

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

// The two words of a 16-byte vector, keyed as words k and k + 1 (k0 = the key of word k).
__device__ __forceinline__ uint64_t vector_terms(const uint4& v, uint64_t k0) {
  return pxh64::term((uint64_t(v.y) << 32) | v.x, k0) + pxh64::term((uint64_t(v.w) << 32) | v.z, k0 + pxh64::kK);
}

// This thread's share of the plan's terms (grid-stride over vectors, then the head and tail words).
__device__ __forceinline__ uint64_t thread_sum(const Plan& plan, uint64_t tid, uint64_t num_threads) {
  uint64_t sum = 0;
  // Body: vector v holds words head + 2v and head + 2v + 1. Keys advance by a constant per step.
  const uint4* body = reinterpret_cast<const uint4*>(plan.data + plan.head_words * 8);
  const uint64_t thread_step = 2 * num_threads * pxh64::kK;  // key distance between v and v+T
  uint64_t key = pxh64::key(plan.seed, plan.word_offset + plan.head_words + 2 * tid);
  for (uint64_t v = tid; v < plan.num_vectors; v += kUnroll * num_threads) {
    uint4 vec[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t vu = v + u * num_threads;
      vec[u] = vu < plan.num_vectors ? __ldcs(body + vu) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v + u * num_threads < plan.num_vectors) sum += vector_terms(vec[u], key + u * thread_step);
    key += kUnroll * thread_step;
  }
  // Head word and tail words, any alignment.
  if (tid == 0 && plan.head_words != 0)
    sum += pxh64::term(load_word(plan.data, plan.num_bytes, 0), pxh64::key(plan.seed, plan.word_offset));
  for (uint64_t r = plan.tail_begin + tid; r < plan.num_words; r += num_threads)
    sum += pxh64::term(load_word(plan.data, plan.num_bytes, r), pxh64::key(plan.seed, plan.word_offset + r));
  return sum;
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of `v` over the block (blockDim.x == kThreads), valid in thread 0. Every thread calls it
// (the barrier first lets a second call reuse the shared memory of the first).
__device__ __forceinline__ uint64_t block_sum(uint64_t v) {
  __shared__ uint64_t warp_sums[kThreads / 32];
  __syncthreads();
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0;
  if (threadIdx.x < 32) v = warp_sum(v);
  return v;
}

// Called by thread 0 of each block after its atomic adds: true in the last block to finish, which
// then sees every block's adds. The fence orders this block's adds before its ticket.
__device__ __forceinline__ bool last_block(unsigned int* blocks_done) {
  __threadfence();
  return atomicAdd(blocks_done, 1u) == gridDim.x - 1;
}

}  // namespace pxh64_device
}  // namespace pyxfer
