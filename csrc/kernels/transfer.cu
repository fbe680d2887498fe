// Small kernels of the verified-transfer protocol: the deferred mismatch latch and checker, and the byte
// flips used by fault injection; what `pyxfer bench` times: the plain SM copy (pull and push) and
// the pointer chase (SM load latency, nvbandwidth's method); and `pyxfer doctor`'s concurrent peer exchange.
#include <cuda/atomic>
#include <cuda_runtime.h>
#include <stdint.h>

#include <climits>

#include "pyxfer/launch.h"
#include "pyxfer/peer_exchange.h"
#include "pyxfer/resident_blocks.h"
#include "pyxfer/verify_words.h"

namespace pyxfer {
namespace {

// Counts a mismatch in *latch and records its details (one thread).
__device__ void latch_record(TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                             uint64_t src_hash, uint64_t dst_hash, int64_t index) {
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
  v->index = index;
  __threadfence();
  atomicExch(&r->seq, i + 1);
}

__global__ void latch_mismatch_kernel(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                      TransferLatch* latch, int64_t src_device, int64_t dst_device,
                                      int64_t num_bytes, int64_t index) {
  // NOTE: uncached loads: the hashes may sit in mapped host memory written by another device.
  const uint64_t expected = src_hash != nullptr ? __ldcv(reinterpret_cast<const unsigned long long*>(src_hash))
                                                : src_hash_value;
  const uint64_t got = __ldcv(reinterpret_cast<const unsigned long long*>(dst_hash));
  if (expected != got) latch_record(latch, src_device, dst_device, num_bytes, expected, got, index);
}

// The deferred checker of a guarded verification (pyxfer/verify_words.h): judge the words, latch a
// mismatch, then prefill them again, consuming this call's tokens (a kernel of the next call, or of
// the next replay, that does not run leaves the prefill, which fails the check).
__global__ void check_verify_kernel(VerifyWords* words, uint64_t seq, uint64_t src_canary, uint64_t dst_canary,
                                    TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                    int64_t index) {
  // NOTE: uncached loads: mapped host memory written by kernels on both devices.
  const auto load = [](const uint64_t* p) { return uint64_t(__ldcv(reinterpret_cast<const unsigned long long*>(p))); };
  VerifyWords w;
  w.src = load(&words->src);
  w.dst = load(&words->dst);
  w.src_token = load(&words->src_token);
  w.dst_token = load(&words->dst_token);
  const verify::Verdict v = verify::judge(w, seq, src_canary, dst_canary);
  if (!v.ok) latch_record(latch, src_device, dst_device, num_bytes, v.src_hash, v.dst_hash, index);
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

// One thread walks the ring: each hop is one load whose address depends on the previous load, so the
// hops cannot overlap and the kernel's time over num_hops is the latency of one load from the ring's memory
// (a peer GPU's over the link, or this GPU's). Stops at an index outside [0, num_nodes) (a corrupt ring is
// reported, never read outside the tensor); *out is the last index reached.
__global__ void pointer_chase_kernel(const int64_t* __restrict__ ring, int64_t num_nodes, int64_t num_hops,
                                     int64_t* __restrict__ out) {
  int64_t i = 0;
  for (int64_t h = 0; h < num_hops; ++h) {
    // NOTE: L2-only loads (ld.global.cg): the ring is larger than L1, and a peer's memory is never in this
    // GPU's caches, so every hop reaches the ring's memory system as nvbandwidth's chase does.
    i = static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(ring + i)));
    if (static_cast<uint64_t>(i) >= static_cast<uint64_t>(num_nodes)) break;
  }
  *out = i;
}


// ---- the concurrent peer exchange (pyxfer/peer_exchange.h has the protocol)

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Whether *word reached at_least (an acquire load at system scope: the partner GPU released it) before
// timeout_ns passed. One thread polls.
__device__ bool wait_at_least(int64_t* word, int64_t at_least, uint64_t timeout_ns) {
  cuda::atomic_ref<int64_t, cuda::thread_scope_system> flag(*word);
  const uint64_t start = global_ns();
  while (flag.load(cuda::memory_order_acquire) < at_least) {
    if (global_ns() - start > timeout_ns) return false;
    __nanosleep(256);
  }
  return true;
}

__device__ void release(int64_t* word, int64_t value) {
  cuda::atomic_ref<int64_t, cuda::thread_scope_system>(*word).store(value, cuda::memory_order_release);
}

// One side of the exchange, one block, running while the partner's block runs on the other GPU: `mine` is
// this GPU's buffer, `theirs` the partner's (peer memory). result[kExchangeResultWords] on this GPU.
__global__ void __launch_bounds__(kExchangeThreads)
    peer_exchange_kernel(int64_t* mine, int64_t* theirs, int64_t num_words, int64_t rounds, uint64_t seed, int side,
                         uint64_t timeout_ns, int64_t corrupt_round, int64_t* result) {
  __shared__ int stop;
  __shared__ unsigned long long round_wrong;
  __shared__ long long round_first;
  int64_t wrong = 0, first_round = -1, first_word = -1, done = 0, timed_out = 0;
  int64_t* inbox = mine + kExchangeHeaderWords;
  int64_t* outbox = theirs + kExchangeHeaderWords;
  for (int64_t r = 1; r <= rounds; ++r) {
    if (threadIdx.x == 0) {
      stop = !wait_at_least(mine + kExchangeAck, r - 1, timeout_ns);  // the partner checked the last round
      round_wrong = 0;
      round_first = LLONG_MAX;
    }
    __syncthreads();
    if (stop) {
      timed_out = 1;
      break;
    }
    for (int64_t i = threadIdx.x; i < num_words; i += blockDim.x) {
      uint64_t w = exchange_word(seed, side, r, i);
      if (side == 0 && r == corrupt_round && i == num_words / 2) w ^= 1;  // the test hook: one wrong bit
      outbox[i] = static_cast<int64_t>(w);  // stores into the partner's memory
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();  // every thread's stores of the round (ordered by the barrier) before the flag
      release(theirs + kExchangeReady, r);
      stop = !wait_at_least(mine + kExchangeReady, r, timeout_ns);  // the partner's round landed here
    }
    __syncthreads();
    if (stop) {
      timed_out = 1;
      break;
    }
    unsigned long long my_wrong = 0;
    long long my_first = LLONG_MAX;
    for (int64_t i = threadIdx.x; i < num_words; i += blockDim.x) {
      // NOTE: uncached loads: the partner wrote these words since this SM last read them
      const uint64_t got = __ldcv(reinterpret_cast<const unsigned long long*>(inbox + i));
      if (got != exchange_word(seed, 1 - side, r, i)) {
        ++my_wrong;
        if (i < my_first) my_first = i;
      }
    }
    if (my_wrong) {
      atomicAdd(&round_wrong, my_wrong);
      atomicMin(&round_first, my_first);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // only thread 0 reports, and it resets the round's counts next round
      release(theirs + kExchangeAck, r);  // the partner may overwrite this inbox now
      wrong += static_cast<int64_t>(round_wrong);
      if (round_wrong && first_round < 0) {
        first_round = r;
        first_word = round_first;
      }
      done = r;
    }
  }
  if (threadIdx.x == 0) {
    result[kResultWrong] = wrong;
    result[kResultFirstBadRound] = first_round;
    result[kResultFirstBadWord] = first_word;
    result[kResultRoundsDone] = done;
    result[kResultTimedOut] = timed_out;
  }
}

}  // namespace

cudaError_t launch_latch_mismatch(const uint64_t* src_hash, uint64_t src_hash_value, const uint64_t* dst_hash,
                                  TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                  int64_t index, cudaStream_t stream) {
  latch_mismatch_kernel<<<1, 1, 0, stream>>>(src_hash, src_hash_value, dst_hash, latch, src_device, dst_device,
                                             num_bytes, index);
  return cudaGetLastError();
}

cudaError_t launch_check_verify(VerifyWords* words, uint64_t seq, uint64_t src_canary, uint64_t dst_canary,
                                TransferLatch* latch, int64_t src_device, int64_t dst_device, int64_t num_bytes,
                                int64_t index, cudaStream_t stream) {
  check_verify_kernel<<<1, 1, 0, stream>>>(words, seq, src_canary, dst_canary, latch, src_device, dst_device,
                                           num_bytes, index);
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

cudaError_t launch_pointer_chase(const int64_t* ring, int64_t num_nodes, int64_t num_hops, int64_t* out,
                                 cudaStream_t stream) {
  pointer_chase_kernel<<<1, 1, 0, stream>>>(ring, num_nodes, num_hops, out);
  return cudaGetLastError();
}

cudaError_t load_peer_exchange() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, peer_exchange_kernel);
}

cudaError_t launch_peer_exchange(int64_t* mine, int64_t* theirs, int64_t num_words, int64_t rounds, uint64_t seed,
                                 int side, uint64_t timeout_ns, int64_t corrupt_round, int64_t* result,
                                 cudaStream_t stream) {
  peer_exchange_kernel<<<1, kExchangeThreads, 0, stream>>>(mine, theirs, num_words, rounds, seed, side, timeout_ns,
                                                           corrupt_round, result);
  return cudaGetLastError();
}

}  // namespace pyxfer
