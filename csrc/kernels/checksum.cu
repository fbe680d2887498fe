// PXH64 on the GPU: one streaming read of the data, a per-thread 64-bit sum, warp shuffles, one
// atomic add per block. Bit-identical to the CPU reference whatever the grid (the sum is modular).
// Also the copy that hashes its destination as it goes (verified peer copies up to a size).
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstring>

#include "pyxfer/launch.h"
#include "pyxfer/pxh64.h"
#include "pyxfer/resident_blocks.h"

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

// Adds the block's terms (`sum` of each of its kThreads threads) to *acc; with `out_hash`, the last
// block to finish writes finalize(*acc, hash_bytes, seed) there. Every thread of the block calls it.
__device__ __forceinline__ void add_block_sum(uint64_t sum, unsigned long long* acc, unsigned int* blocks_done,
                                              uint64_t* out_hash, uint64_t hash_bytes, uint64_t seed) {
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
    *out_hash = pxh64::finalize(total, hash_bytes, seed);
  }
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

  add_block_sum(sum, acc, blocks_done, out_hash, hash_bytes, plan.seed);
}

__global__ void pxh64_combine_kernel(const uint64_t* partials, int64_t num_partials,
                                     uint64_t num_bytes, uint64_t seed, uint64_t* out_hash) {
  uint64_t sum = 0;
  for (int64_t i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
  sum = warp_sum(sum);
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
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int i = 1; i < kSmallThreads / 32; ++i) sum += warp_sums[i];
  *out = pxh64::finalize(sum, num_bytes, seed);
}

// The destination byte at `pos` of a copy that follows `fault` (pyxfer.testing's plan): zeros, a
// source byte, or the old destination byte where nothing is copied; then the optional bit flip.
__device__ __forceinline__ uint8_t planned_byte(const uint8_t* src, uint8_t old, uint64_t pos, const CopyFault& fault) {
  uint8_t b = old;
  if (fault.zero_fill) b = 0;
  else if (pos >= fault.dst_offset && pos < fault.dst_offset + fault.length) b = src[pos - fault.dst_offset + fault.src_offset];
  return pos == fault.flip_byte ? uint8_t(b ^ fault.flip_mask) : b;
}

__device__ __forceinline__ void flip_in_vector(uint4& v, unsigned byte, uint8_t mask) {
  const uint32_t bits = uint32_t(mask) << (8 * (byte & 3));
  switch (byte >> 2) {  // NOTE: no dynamic register index (it would put the vector in local memory)
    case 0: v.x ^= bits; break;
    case 1: v.y ^= bits; break;
    case 2: v.z ^= bits; break;
    default: v.w ^= bits; break;
  }
}

// Copies src[0, n) to dst in 16-byte vectors (src may be a peer GPU's memory, read over NVLink) and
// hashes each vector as read back from dst after the thread's own store (ld.global.cg: from the
// destination's L2, where the copy landed). Same terms as pxh64_kernel. The loads of a thread's next
// kUnroll vectors are issued before it reads back the current ones, so the link always has requests
// in flight. `fault` is the identity except under pyxfer.testing: shifted or partial copies take a
// byte-wise path.
__global__ void __launch_bounds__(kThreads)
    copy_pxh64_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t n, CopyFault fault,
                      unsigned long long* acc, unsigned int* blocks_done, uint64_t* out_hash) {
  const uint64_t num_threads = uint64_t(gridDim.x) * kThreads;
  const uint64_t tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  const uint64_t num_vectors = n / 16;
  const uint64_t step = kUnroll * num_threads;
  const bool bytewise = !fault.zero_fill && !(fault.src_offset == 0 && fault.dst_offset == 0 && fault.length == n);
  uint4* d4 = reinterpret_cast<uint4*>(dst);
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  const auto load = [&](uint64_t v) {  // what vector v of dst must become
    uint4 x = make_uint4(0, 0, 0, 0);
    if (bytewise) {
      uint8_t bytes[16];
      const uint4 old = d4[v];
      memcpy(bytes, &old, 16);
      for (int b = 0; b < 16; ++b) bytes[b] = planned_byte(src, bytes[b], v * 16 + b, fault);
      memcpy(&x, bytes, 16);
      return x;
    }
    if (!fault.zero_fill) x = s4[v];
    if (fault.flip_byte >= 0 && uint64_t(fault.flip_byte) / 16 == v) flip_in_vector(x, unsigned(fault.flip_byte % 16), fault.flip_mask);
    return x;
  };
  uint64_t sum = 0;
  uint4 cur[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (tid + u * num_threads < num_vectors) cur[u] = load(tid + u * num_threads);
  for (uint64_t v = tid; v < num_vectors; v += step) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v + u * num_threads < num_vectors) d4[v + u * num_threads] = cur[u];
    uint4 next[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v + step + u * num_threads < num_vectors) next[u] = load(v + step + u * num_threads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t vu = v + u * num_threads;
      if (vu >= num_vectors) continue;
      const uint4 back = __ldcg(d4 + vu);
      sum += pxh64::term((uint64_t(back.y) << 32) | back.x, pxh64::key(0, 2 * vu)) +
             pxh64::term((uint64_t(back.w) << 32) | back.z, pxh64::key(0, 2 * vu + 1));
      cur[u] = next[u];
    }
  }
  if (tid == 0 && n % 16 != 0) {  // the last 1..15 bytes, then their (at most two) words
    for (uint64_t pos = num_vectors * 16; pos < n; ++pos) dst[pos] = planned_byte(src, dst[pos], pos, fault);
    for (uint64_t r = 2 * num_vectors; r * 8 < n; ++r)
      sum += pxh64::term(pxh64::load_partial_word(dst + r * 8, n - r * 8), pxh64::key(0, r));
  }
  add_block_sum(sum, acc, blocks_done, out_hash, n, 0);
}

}  // namespace

cudaError_t launch_copy_pxh64(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, const CopyFault& fault,
                              uint64_t* acc, uint32_t* blocks_done, uint64_t* out_hash, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    return cudaErrorInvalidValue;
  uint64_t blocks = (num_bytes / 16 / kUnroll + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  const uint64_t max_blocks = max_resident_blocks<copy_pxh64_kernel, kThreads>();
  if (blocks > max_blocks) blocks = max_blocks;
  copy_pxh64_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(
      dst, src, num_bytes, fault, reinterpret_cast<unsigned long long*>(acc), blocks_done, out_hash);
  return cudaGetLastError();
}

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
  const uint64_t max_blocks = max_resident_blocks<pxh64_kernel, kThreads>();
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
