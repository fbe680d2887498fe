// Kernels of verified GPU copies (driven by csrc/cuda/transfer_device.cpp; the words they publish and
// the guards on them: pyxfer/verify_words.h):
//   copy_verify_local_kernel   GPU-local: each thread hashes what it read (the source hash), stores it,
//                              reads its stores back from L2 and hashes them (the destination hash):
//                              one read and one write of HBM instead of a copy plus two hash passes
//   pull_verify_kernel         GPU -> GPU, on the destination: pulls the source over the peer link,
//                              stores, reads back and hashes (the destination hash)
//   hash_verify_kernel(_small) the source hash of a peer copy; the chunk hashes of the copy-engine pipeline
// Guarded publish: every hash goes out XOR the running device's canary, followed by a run token. Each
// kernel leaves its scratch zeroed (its last block takes the sums with atomicExch and resets the
// ticket): no memset before a launch, and a graph replay finds the scratch as the capture did.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/launch.h"
#include "pyxfer/pxh64.h"
#include "pyxfer/pxh64_device.cuh"
#include "pyxfer/resident_blocks.h"
#include "pyxfer/verify_words.h"

namespace pyxfer {
namespace {

using pxh64_device::kThreads;
using pxh64_device::kUnroll;
using pxh64_device::load_word;
using pxh64_device::Plan;
using pxh64_device::vector_terms;

// This device's canary: a module's __device__ variables exist once per device, so a kernel reads the
// canary of the device it runs on. Set by launch_set_device_canary before any guarded kernel runs
// there; 0 on a device never set up, which is no device's canary.
__device__ unsigned long long g_device_canary;

__global__ void set_canary_kernel(unsigned long long canary) { g_device_canary = canary; }

// NOTE: the read-back must return what the memory holds, not what this thread just stored: an asm
// volatile load with a "memory" clobber is neither dropped nor answered from the register the store
// came from (a plain or __ldcg load of a __restrict__ pointer may be). .cg: from L2, not a stale L1 line.
// What it proves: the store reached the L2 of the device running the kernel, where every later reader
// on that device finds it (L2 is the device's point of coherence; HBM behind it is ECC-protected). It
// does not prove the bytes were written to HBM yet, and it says nothing if the kernel ran on another
// device or not at all: the canary and the run token answer that (pyxfer/verify_words.h).
__device__ __forceinline__ uint4 load_back_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint64_t load_back_u64(const uint8_t* p) {
  uint64_t v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t load_back_u8(const uint8_t* p) {
  unsigned v;
  asm volatile("ld.global.cg.u8 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v & 0xffu;
}

// The first `count` (1..8) bytes at p as a little-endian word, read back (p is 8-byte aligned: a word
// of the destination, which is 16-byte aligned).
__device__ __forceinline__ uint64_t load_back_word(const uint8_t* p, uint64_t count) {
  if (count == 8) return load_back_u64(p);
  uint64_t w = 0;
  for (uint64_t i = 0; i < count; ++i) w |= load_back_u8(p + i) << (8 * i);
  return w;
}

__device__ __forceinline__ void store_word(uint8_t* p, uint64_t w, uint64_t count) {
  if (count == 8) {
    *reinterpret_cast<uint64_t*>(p) = w;
    return;
  }
  for (uint64_t i = 0; i < count; ++i) p[i] = uint8_t(w >> (8 * i));
}

// The destination byte at `pos` of a copy that follows `fault` (pyxfer.testing's plan): zeros, a
// source byte, or the old destination byte where nothing is copied; then the optional bit flip.
__device__ __forceinline__ uint8_t planned_byte(const uint8_t* src, uint8_t old, uint64_t pos, const CopyFault& fault) {
  uint8_t b = old;
  if (fault.zero_fill) b = 0;
  else if (pos >= fault.dst_offset && pos < fault.dst_offset + fault.length) b = src[pos - fault.dst_offset + fault.src_offset];
  return pos == uint64_t(fault.flip_byte) ? uint8_t(b ^ fault.flip_mask) : b;
}

// Destination word r (its `count` bytes) under `fault`, from the source and the destination's old bytes.
__device__ __forceinline__ uint64_t planned_word(const uint8_t* src, const uint8_t* dst, uint64_t r, uint64_t count,
                                                 const CopyFault& fault) {
  uint64_t w = 0;
  for (uint64_t b = 0; b < count; ++b) w |= uint64_t(planned_byte(src, dst[8 * r + b], 8 * r + b, fault)) << (8 * b);
  return w;
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

// Copies take whole 16-byte vectors only with no fault or a fault that keeps positions (zeros, one
// flipped bit); a fault that moves or drops bytes goes word by word through planned_word.
__device__ __forceinline__ bool keeps_positions(const CopyFault& fault, uint64_t n) {
  return fault.zero_fill || (fault.src_offset == 0 && fault.dst_offset == 0 && fault.length == n);
}

__device__ __forceinline__ bool is_identity(const CopyFault& fault, uint64_t n) {
  return !fault.zero_fill && fault.flip_byte < 0 && fault.src_offset == 0 && fault.dst_offset == 0 && fault.length == n;
}

// What vector v of the destination becomes when the fault keeps positions (x: the source's vector).
__device__ __forceinline__ uint4 planned_vector(uint4 x, uint64_t v, const CopyFault& fault) {
  if (fault.zero_fill) x = make_uint4(0, 0, 0, 0);
  if (fault.flip_byte >= 0 && uint64_t(fault.flip_byte) / 16 == v)
    flip_in_vector(x, unsigned(fault.flip_byte % 16), fault.flip_mask);
  return x;
}

// Fault injection's "always wrong": where the destination's hash equals the source's, flip the bit
// the plan chose and return the destination's sum with that word's term replaced. Last block only.
__device__ __forceinline__ uint64_t ensure_wrong(const EnsureWrong& e, uint64_t dst_sum, uint64_t num_bytes,
                                                 uint64_t src_hash) {
  if (e.word == nullptr || pxh64::finalize(dst_sum, num_bytes, 0) != src_hash) return dst_sum;
  const uint64_t old = load_back_word(e.word, e.word_bytes);
  const uint64_t flipped = old ^ (uint64_t(1) << (8 * e.byte_in_word));
  e.word[e.byte_in_word] = uint8_t(flipped >> (8 * e.byte_in_word));
  const uint64_t k = pxh64::key(0, e.word_index);
  return dst_sum - pxh64::term(old, k) + pxh64::term(flipped, k);
}

// The source hash an EnsureWrong compares with: published earlier by the source's kernel (mapped host
// memory, read uncached), its canary removed.
__device__ __forceinline__ uint64_t ensure_source_hash(const EnsureWrong& e) {
  if (e.word == nullptr) return 0;
  return __ldcv(reinterpret_cast<const unsigned long long*>(e.src_word)) ^ e.src_canary;
}

// Guarded publish (pyxfer/verify_words.h): the hash XOR this device's canary, then, ordered after it
// for every observer (the host polling mapped memory included), the run token.
__device__ __forceinline__ void publish(uint64_t* hash_word, uint64_t* token_word, uint64_t hash, uint64_t seq) {
  const uint64_t canary = g_device_canary;
  *reinterpret_cast<volatile uint64_t*>(hash_word) = hash ^ canary;
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(token_word) = verify::run_token(seq, canary);
}

__global__ void __launch_bounds__(kThreads)
    copy_verify_local_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t n, CopyFault fault,
                             EnsureWrong ensure, HashScratch* scratch, VerifyWords* out, uint64_t seq) {
  const uint64_t num_threads = uint64_t(gridDim.x) * kThreads;
  const uint64_t tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  const bool vectors = keeps_positions(fault, n) && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const uint64_t num_vectors = vectors ? n / 16 : 0;
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  uint4* d4 = reinterpret_cast<uint4*>(dst);
  uint64_t src_sum = 0, dst_sum = 0;
  for (uint64_t v = tid; v < num_vectors; v += kUnroll * num_threads) {
    uint4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // kUnroll streaming loads in flight before the first use
      const uint64_t vu = v + u * num_threads;
      x[u] = vu < num_vectors ? __ldcs(s4 + vu) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t vu = v + u * num_threads;
      if (vu < num_vectors) {
        src_sum += vector_terms(x[u], pxh64::key(0, 2 * vu));
        d4[vu] = planned_vector(x[u], vu, fault);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t vu = v + u * num_threads;
      if (vu < num_vectors) dst_sum += vector_terms(load_back_v4(d4 + vu), pxh64::key(0, 2 * vu));
    }
  }
  // The words after the vectors: the 1..15-byte tail, or everything for a misaligned source or a
  // fault that moves bytes.
  const bool identity = is_identity(fault, n);
  const uint64_t num_words = (n + 7) / 8;
  for (uint64_t r = 2 * num_vectors + tid; r < num_words; r += num_threads) {
    const uint64_t count = n - 8 * r < 8 ? n - 8 * r : 8;
    const uint64_t k = pxh64::key(0, r);
    const uint64_t word = load_word(src, n, r);
    src_sum += pxh64::term(word, k);
    store_word(dst + 8 * r, identity ? word : planned_word(src, dst, r, count, fault), count);
    dst_sum += pxh64::term(load_back_word(dst + 8 * r, count), k);
  }
  src_sum = pxh64_device::block_sum(src_sum);
  dst_sum = pxh64_device::block_sum(dst_sum);
  if (threadIdx.x != 0) return;
  atomicAdd(&scratch->acc[0], static_cast<unsigned long long>(src_sum));
  atomicAdd(&scratch->acc[1], static_cast<unsigned long long>(dst_sum));
  if (!pxh64_device::last_block(&scratch->blocks_done)) return;
  const uint64_t src_total = atomicExch(&scratch->acc[0], 0ull);
  uint64_t dst_total = atomicExch(&scratch->acc[1], 0ull);
  atomicExch(&scratch->blocks_done, 0u);
  const uint64_t src_hash = pxh64::finalize(src_total, n, 0);
  dst_total = ensure_wrong(ensure, dst_total, n, src_hash);
  const uint64_t canary = g_device_canary;
  volatile VerifyWords* w = out;
  w->src = src_hash ^ canary;
  w->dst = pxh64::finalize(dst_total, n, 0) ^ canary;
  __threadfence_system();
  w->src_token = verify::run_token(seq, canary);
  w->dst_token = verify::run_token(seq, canary);
}

// The loads of a thread's next kUnroll vectors are issued before it reads back the current ones, so
// the peer link always has requests in flight.
__global__ void __launch_bounds__(kThreads)
    pull_verify_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t n, CopyFault fault,
                       EnsureWrong ensure, HashScratch* scratch, VerifyWords* out, uint64_t seq) {
  const uint64_t num_threads = uint64_t(gridDim.x) * kThreads;
  const uint64_t tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  const bool vectors = keeps_positions(fault, n) && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const uint64_t num_vectors = vectors ? n / 16 : 0;
  const uint64_t step = kUnroll * num_threads;
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  uint4* d4 = reinterpret_cast<uint4*>(dst);
  const auto load = [&](uint64_t v) { return planned_vector(fault.zero_fill ? make_uint4(0, 0, 0, 0) : s4[v], v, fault); };
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
      sum += vector_terms(load_back_v4(d4 + vu), pxh64::key(0, 2 * vu));
      cur[u] = next[u];
    }
  }
  const bool identity = is_identity(fault, n);
  const uint64_t num_words = (n + 7) / 8;
  for (uint64_t r = 2 * num_vectors + tid; r < num_words; r += num_threads) {
    const uint64_t count = n - 8 * r < 8 ? n - 8 * r : 8;
    store_word(dst + 8 * r, identity ? load_word(src, n, r) : planned_word(src, dst, r, count, fault), count);
    sum += pxh64::term(load_back_word(dst + 8 * r, count), pxh64::key(0, r));
  }
  sum = pxh64_device::block_sum(sum);
  if (threadIdx.x != 0) return;
  atomicAdd(&scratch->acc[0], static_cast<unsigned long long>(sum));
  if (!pxh64_device::last_block(&scratch->blocks_done)) return;
  uint64_t total = atomicExch(&scratch->acc[0], 0ull);
  atomicExch(&scratch->blocks_done, 0u);
  total = ensure_wrong(ensure, total, n, ensure_source_hash(ensure));
  publish(&out->dst, &out->dst_token, pxh64::finalize(total, n, 0), seq);
}

// Adds the plan's terms to scratch->acc[0]; with `hash_word` (the last chunk), the last block also
// finalizes everything added so far (the earlier chunks' launches on the same stream included),
// resets the scratch and publishes.
__global__ void __launch_bounds__(kThreads)
    hash_verify_kernel(Plan plan, HashScratch* scratch, uint64_t* hash_word, uint64_t* token_word, uint64_t seq,
                       uint64_t hash_bytes, EnsureWrong ensure) {
  const uint64_t num_threads = uint64_t(gridDim.x) * kThreads;
  const uint64_t tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  const uint64_t sum = pxh64_device::block_sum(pxh64_device::thread_sum(plan, tid, num_threads));
  if (threadIdx.x != 0) return;
  atomicAdd(&scratch->acc[0], static_cast<unsigned long long>(sum));
  if (hash_word == nullptr || !pxh64_device::last_block(&scratch->blocks_done)) return;
  uint64_t total = atomicExch(&scratch->acc[0], 0ull);
  atomicExch(&scratch->blocks_done, 0u);
  total = ensure_wrong(ensure, total, hash_bytes, ensure_source_hash(ensure));
  publish(hash_word, token_word, pxh64::finalize(total, hash_bytes, 0), seq);
}

// The whole of a small buffer from one block (no scratch): the latency path of small peer copies.
__global__ void __launch_bounds__(kThreads)
    hash_verify_small_kernel(const uint8_t* data, uint64_t n, uint64_t* hash_word, uint64_t* token_word, uint64_t seq) {
  uint64_t sum = 0;
  for (uint64_t r = threadIdx.x; r < (n + 7) / 8; r += kThreads) sum += pxh64::term(load_word(data, n, r), pxh64::key(0, r));
  sum = pxh64_device::block_sum(sum);
  if (threadIdx.x == 0) publish(hash_word, token_word, pxh64::finalize(sum, n, 0), seq);
}

template <auto Kernel>
unsigned grid_for(uint64_t work, uint64_t max_blocks) {
  uint64_t blocks = (work + kThreads - 1) / kThreads;
  const uint64_t wave = max_resident_blocks<Kernel, kThreads>();
  if (max_blocks == 0 || max_blocks > wave) max_blocks = wave;
  if (blocks > max_blocks) blocks = max_blocks;
  return unsigned(blocks < 1 ? 1 : blocks);
}

// Work items of a copy kernel: vectors (kUnroll per thread and step) where both ends allow, else words.
uint64_t copy_work(const uint8_t* src, uint64_t n) {
  const uint64_t vectors = reinterpret_cast<uintptr_t>(src) % 16 == 0 ? n / 16 : 0;
  return vectors / kUnroll + ((n + 7) / 8 - 2 * vectors);
}

}  // namespace

cudaError_t launch_set_device_canary(uint64_t canary, cudaStream_t stream) {
  set_canary_kernel<<<1, 1, 0, stream>>>(canary);
  return cudaGetLastError();
}

cudaError_t launch_copy_verify_local(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, const CopyFault& fault,
                                     const EnsureWrong& ensure, HashScratch* scratch, VerifyWords* out, uint64_t seq,
                                     cudaStream_t stream) {
  if (num_bytes == 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0) return cudaErrorInvalidValue;
  const unsigned blocks = grid_for<copy_verify_local_kernel>(copy_work(src, num_bytes), 0);
  copy_verify_local_kernel<<<blocks, kThreads, 0, stream>>>(dst, src, num_bytes, fault, ensure, scratch, out, seq);
  return cudaGetLastError();
}

cudaError_t launch_pull_verify(uint8_t* dst, const uint8_t* src, uint64_t num_bytes, const CopyFault& fault,
                               const EnsureWrong& ensure, HashScratch* scratch, VerifyWords* out, uint64_t seq,
                               cudaStream_t stream) {
  if (num_bytes == 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0) return cudaErrorInvalidValue;
  const unsigned blocks = grid_for<pull_verify_kernel>(copy_work(src, num_bytes), 0);
  pull_verify_kernel<<<blocks, kThreads, 0, stream>>>(dst, src, num_bytes, fault, ensure, scratch, out, seq);
  return cudaGetLastError();
}

cudaError_t launch_hash_verify(const void* data, uint64_t num_bytes, uint64_t word_offset, uint64_t max_blocks,
                               HashScratch* scratch, uint64_t* hash_word, uint64_t* token_word, uint64_t seq,
                               uint64_t hash_bytes, const EnsureWrong& ensure, cudaStream_t stream) {
  if (hash_word != nullptr && word_offset == 0 && num_bytes == hash_bytes && num_bytes <= kSmallHashBytes &&
      ensure.word == nullptr) {
    hash_verify_small_kernel<<<1, kThreads, 0, stream>>>(static_cast<const uint8_t*>(data), num_bytes, hash_word,
                                                         token_word, seq);
    return cudaGetLastError();
  }
  if (scratch == nullptr) return cudaErrorInvalidValue;
  const Plan plan = pxh64_device::make_plan(data, num_bytes, word_offset, 0);
  const uint64_t work = plan.num_vectors / kUnroll + (plan.num_words - plan.tail_begin);
  const unsigned blocks = grid_for<hash_verify_kernel>(work, max_blocks);
  hash_verify_kernel<<<blocks, kThreads, 0, stream>>>(plan, scratch, hash_word, token_word, seq, hash_bytes, ensure);
  return cudaGetLastError();
}

uint64_t hash_wave_blocks() { return max_resident_blocks<hash_verify_kernel, kThreads>(); }

}  // namespace pyxfer
