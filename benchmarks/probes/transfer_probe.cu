// Design probe for the verified-copy engine (issue 34) and the bench's two-way rows (issue 35).
// Standalone (CUDA runtime + pyxfer's torch-free PXH64 header); build on any machine with nvcc:
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc/include benchmarks/probes/transfer_probe.cu -o transfer_probe -lpthread
// Prints GB/s (bytes counted once) and ratios against the raw copy measured in the same run.
#include <cuda_runtime.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "pyxfer/pxh64.h"

using namespace pyxfer;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

constexpr int kThreads = 512;

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ uint64_t block_sum(uint64_t v) {
  __shared__ uint64_t s[kThreads / 32];
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? s[threadIdx.x] : 0;
  if (threadIdx.x < 32) v = warp_sum(v);
  return v;
}
__device__ __forceinline__ uint4 ld_l2(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t terms(uint4 v, uint64_t k) {
  return pxh64::term((uint64_t(v.y) << 32) | v.x, k) + pxh64::term((uint64_t(v.w) << 32) | v.z, k + pxh64::kK);
}

// Plain hash (sum only) of nv 16-byte vectors.
__global__ void __launch_bounds__(kThreads) hash_kernel(const uint4* src, uint64_t nv, unsigned long long* acc) {
  const uint64_t T = uint64_t(gridDim.x) * kThreads, tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  uint64_t s = 0;
  for (uint64_t v = tid; v < nv; v += 4 * T) {
    uint4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = v + u * T < nv ? __ldcs(src + v + u * T) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) if (v + u * T < nv) s += terms(x[u], pxh64::key(0, 2 * (v + u * T)));
  }
  s = block_sum(s);
  if (threadIdx.x == 0) atomicAdd(acc, (unsigned long long)s);
}

// Fused: load src (hash it), store dst, read the store back from L2 (hash it).
template <bool kReadBack>
__global__ void __launch_bounds__(kThreads) fused_kernel(uint4* dst, const uint4* src, uint64_t nv, unsigned long long* acc) {
  const uint64_t T = uint64_t(gridDim.x) * kThreads, tid = uint64_t(blockIdx.x) * kThreads + threadIdx.x;
  uint64_t s = 0, d = 0;
  for (uint64_t v = tid; v < nv; v += 4 * T) {
    uint4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = v + u * T < nv ? __ldcs(src + v + u * T) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) if (v + u * T < nv) { s += terms(x[u], pxh64::key(0, 2 * (v + u * T))); dst[v + u * T] = x[u]; }
    if (kReadBack) {
#pragma unroll
      for (int u = 0; u < 4; ++u) if (v + u * T < nv) d += terms(ld_l2(dst + v + u * T), pxh64::key(0, 2 * (v + u * T)));
    }
  }
  s = block_sum(s);
  d = block_sum(d);
  if (threadIdx.x == 0) { atomicAdd(acc, (unsigned long long)s); atomicAdd(acc + 1, (unsigned long long)d); }
}

static int wave(const void* k) {
  int dev, sms, per;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k, kThreads, 0));
  return sms * per;
}

// Time fn (queues work on s) with events: median ms over reps after warmup.
static double time_ms(cudaStream_t s, const std::function<void()>& fn, int reps = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps + 3; ++i) {
    CK(cudaEventRecord(a, s)); fn(); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(ms);
  }
  return median(t);
}
// Wall-clock ms (host-synchronous fn) median.
static double wall_ms(const std::function<void()>& fn, int reps = 11) {
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) { double t0 = now_s(); fn(); if (i >= 2) t.push_back((now_s() - t0) * 1e3); }
  return median(t);
}

static long long ll(uint64_t v) { long long r; memcpy(&r, &v, 8); return r; }
// ---- host PXH64: scalar and AVX-512 ------------------------------------------------------------
static uint64_t host_sum_scalar(const uint8_t* p, uint64_t nwords, uint64_t word_offset) {
  uint64_t s = 0, k = pxh64::key(0, word_offset);
  for (uint64_t j = 0; j < nwords; ++j, k += pxh64::kK) { uint64_t w; memcpy(&w, p + 8 * j, 8); s += pxh64::term(w, k); }
  return s;
}
__attribute__((target("avx512f,avx512dq"))) static uint64_t host_sum_avx512(const uint8_t* p, uint64_t nwords, uint64_t word_offset) {
  const uint64_t k0 = pxh64::key(0, word_offset);
  __m512i key = _mm512_set_epi64(k0 + 7 * pxh64::kK, k0 + 6 * pxh64::kK, k0 + 5 * pxh64::kK, k0 + 4 * pxh64::kK,
                                 k0 + 3 * pxh64::kK, k0 + 2 * pxh64::kK, k0 + pxh64::kK, k0);
  const __m512i step = _mm512_set1_epi64(ll(8 * pxh64::kK)), m1 = _mm512_set1_epi64(ll(pxh64::kM1)), m2 = _mm512_set1_epi64(ll(pxh64::kM2));
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  uint64_t j = 0;
  for (; j + 16 <= nwords; j += 16) {
    __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(p + 8 * j), key);
    __m512i key1 = _mm512_add_epi64(key, step);
    __m512i z1 = _mm512_xor_si512(_mm512_loadu_si512(p + 8 * j + 64), key1);
    key = _mm512_add_epi64(key1, step);
    z0 = _mm512_mullo_epi64(_mm512_xor_si512(z0, _mm512_srli_epi64(z0, 30)), m1);
    z1 = _mm512_mullo_epi64(_mm512_xor_si512(z1, _mm512_srli_epi64(z1, 30)), m1);
    z0 = _mm512_mullo_epi64(_mm512_xor_si512(z0, _mm512_srli_epi64(z0, 27)), m2);
    z1 = _mm512_mullo_epi64(_mm512_xor_si512(z1, _mm512_srli_epi64(z1, 27)), m2);
    acc0 = _mm512_add_epi64(acc0, _mm512_xor_si512(z0, _mm512_srli_epi64(z0, 31)));
    acc1 = _mm512_add_epi64(acc1, _mm512_xor_si512(z1, _mm512_srli_epi64(z1, 31)));
  }
  uint64_t s = _mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1));
  return s + host_sum_scalar(p + 8 * j, nwords - j, word_offset + j);
}
__attribute__((target("avx2"))) static inline __m256i mul64c(__m256i a, __m256i b, __m256i bhi) {
  __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b), _mm256_mul_epu32(a, bhi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
}
__attribute__((target("avx2"))) static inline __m256i mix4(__m256i z, __m256i m1, __m256i m1h, __m256i m2, __m256i m2h) {
  z = mul64c(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1, m1h);
  z = mul64c(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2, m2h);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}
__attribute__((target("avx2"))) static uint64_t host_sum_avx2(const uint8_t* p, uint64_t nwords, uint64_t word_offset) {
  const uint64_t k0 = pxh64::key(0, word_offset), K = pxh64::kK;
  __m256i key0 = _mm256_set_epi64x(ll(k0 + 3 * K), ll(k0 + 2 * K), ll(k0 + K), ll(k0));
  __m256i key1 = _mm256_add_epi64(key0, _mm256_set1_epi64x(ll(4 * K)));
  const __m256i step = _mm256_set1_epi64x(ll(8 * K));
  const __m256i m1 = _mm256_set1_epi64x(ll(pxh64::kM1)), m1h = _mm256_srli_epi64(m1, 32);
  const __m256i m2 = _mm256_set1_epi64x(ll(pxh64::kM2)), m2h = _mm256_srli_epi64(m2, 32);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  uint64_t j = 0;
  for (; j + 8 <= nwords; j += 8) {
    __m256i z0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 8 * j)), key0);
    __m256i z1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 8 * j + 32)), key1);
    key0 = _mm256_add_epi64(key0, step); key1 = _mm256_add_epi64(key1, step);
    acc0 = _mm256_add_epi64(acc0, mix4(z0, m1, m1h, m2, m2h));
    acc1 = _mm256_add_epi64(acc1, mix4(z1, m1, m1h, m2, m2h));
  }
  alignas(32) uint64_t l[4]; _mm256_store_si256((__m256i*)l, _mm256_add_epi64(acc0, acc1));
  return l[0] + l[1] + l[2] + l[3] + host_sum_scalar(p + 8 * j, nwords - j, word_offset + j);
}
static int g_isa = 0;  // 0 scalar, 1 avx2, 2 avx512
static uint64_t host_sum(const uint8_t* p, uint64_t nwords, uint64_t off) {
  return g_isa == 2 ? host_sum_avx512(p, nwords, off) : g_isa == 1 ? host_sum_avx2(p, nwords, off) : host_sum_scalar(p, nwords, off);
}
// A pool of host threads hashing chunks of pinned memory as their events fire.
struct ChunkJob { const uint8_t* p; uint64_t bytes, off_bytes; cudaEvent_t ev; };
static uint64_t hash_chunks_pool(const std::vector<ChunkJob>& jobs, int nthreads) {
  std::atomic<size_t> next{0};
  std::vector<uint64_t> sums(nthreads, 0);
  std::vector<std::thread> th;
  for (int t = 0; t < nthreads; ++t) th.emplace_back([&, t] {
    for (size_t i; (i = next.fetch_add(1)) < jobs.size();) {
      if (jobs[i].ev) CK(cudaEventSynchronize(jobs[i].ev));
      sums[t] += host_sum(jobs[i].p, jobs[i].bytes / 8, jobs[i].off_bytes / 8);
    }
  });
  for (auto& x : th) x.join();
  uint64_t s = 0; for (auto v : sums) s += v; return s;
}

int main(int argc, char** argv) {
  const uint64_t n = (argc > 1 ? strtoull(argv[1], 0, 10) : 512) << 20;
  int ndev; CK(cudaGetDeviceCount(&ndev));
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2");
  g_isa = avx512 ? 2 : avx2 ? 1 : 0;
  printf("probe: %llu MiB, %d GPUs, host threads %u, avx512 %d\n", (unsigned long long)(n >> 20), ndev,
         std::thread::hardware_concurrency(), g_isa);
  CK(cudaSetDevice(0));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint8_t *a, *b; unsigned long long* acc;
  CK(cudaMalloc(&a, n)); CK(cudaMalloc(&b, n)); CK(cudaMalloc(&acc, 64));
  { std::vector<uint8_t> h(n); for (uint64_t i = 0; i < n; ++i) h[i] = uint8_t(i * 2654435761u >> 13); CK(cudaMemcpy(a, h.data(), n, cudaMemcpyHostToDevice)); }
  const uint64_t nv = n / 16;
  auto gbs = [&](double ms) { return n / ms / 1e6; };

  // ---- GPU-local ----
  const int wh = wave((const void*)hash_kernel), wf = wave((const void*)fused_kernel<true>), wf0 = wave((const void*)fused_kernel<false>);
  double raw = time_ms(s, [&] { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s)); });
  double hash1 = time_ms(s, [&] { hash_kernel<<<wh, kThreads, 0, s>>>((const uint4*)a, nv, acc); });
  double today = time_ms(s, [&] {  // copy, then source hash and destination hash (serial on one stream: upper bound)
    CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
    hash_kernel<<<wh, kThreads, 0, s>>>((const uint4*)a, nv, acc);
    hash_kernel<<<wh, kThreads, 0, s>>>((const uint4*)b, nv, acc); });
  double fused_nrb = time_ms(s, [&] { fused_kernel<false><<<wf0, kThreads, 0, s>>>((uint4*)b, (const uint4*)a, nv, acc); });
  double fused = time_ms(s, [&] { fused_kernel<true><<<wf, kThreads, 0, s>>>((uint4*)b, (const uint4*)a, nv, acc); });
  double fused2 = time_ms(s, [&] { fused_kernel<true><<<2 * wf, kThreads, 0, s>>>((uint4*)b, (const uint4*)a, nv, acc); });
  CK(cudaGetLastError());
  printf("\n[gpu-local] raw ce %.0f GB/s | hash alone %.0f GB/s read | ce+2 hashes serial %.3f | fused(src hash only) %.3f | fused+L2 readback %.3f | fused 2 waves %.3f (ratios to raw ce)\n",
         gbs(raw), gbs(hash1), raw / today, raw / fused_nrb, raw / fused, raw / fused2);

  // ---- host hash rates on pinned memory ----
  uint8_t* hp; CK(cudaHostAlloc(&hp, n, cudaHostAllocDefault));
  CK(cudaMemcpy(hp, a, n, cudaMemcpyDeviceToHost));
  for (int t : {1, 2, 4, 8, 12, 16}) {
    if (t > (int)std::thread::hardware_concurrency()) break;
    const uint64_t c = n / 64;
    std::vector<ChunkJob> jobs; for (uint64_t o = 0; o < n; o += c) jobs.push_back({hp + o, std::min(c, n - o), o, nullptr});
    const int save = g_isa; double r[3] = {0, 0, 0};
    for (int isa = 0; isa <= save; ++isa) { g_isa = isa; double w = wall_ms([&] { hash_chunks_pool(jobs, t); }, 5); r[isa] = n / w / 1e6; }
    g_isa = save;
    printf("[host hash] %2d threads: scalar %.1f GB/s, avx2 %.1f GB/s, avx512 %.1f GB/s\n", t, r[0], r[1], r[2]);
  }
  { uint64_t s1 = host_sum_scalar(hp + 3, n / 8 - 1, 5), s2 = g_isa >= 1 ? host_sum_avx2(hp + 3, n / 8 - 1, 5) : s1,
      s3 = g_isa == 2 ? host_sum_avx512(hp + 3, n / 8 - 1, 5) : s1;
    printf("[host hash] avx2==scalar %d avx512==scalar %d\n", int(s1 == s2), int(s1 == s3)); }

  // ---- GPU -> pinned host ----
  double d2h_raw = time_ms(s, [&] { CK(cudaMemcpyAsync(hp, a, n, cudaMemcpyDeviceToHost, s)); });
  printf("\n[d2h pinned] raw %.1f GB/s\n", gbs(d2h_raw));
  std::vector<cudaEvent_t> evs(1024); for (auto& e : evs) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (uint64_t chunk_mib : {4, 8, 16, 32}) {
    for (int t : {4, 8, 16}) {
      if (t > (int)std::thread::hardware_concurrency()) break;
      const uint64_t c = chunk_mib << 20;
      double w = wall_ms([&] {
        std::vector<ChunkJob> jobs; size_t k = 0;
        hash_kernel<<<wh, kThreads, 0, s>>>((const uint4*)a, nv, acc);  // source hash on the GPU (same stream: worst case)
        for (uint64_t o = 0; o < n; o += c, ++k) {
          CK(cudaMemcpyAsync(hp + o, a + o, std::min(c, n - o), cudaMemcpyDeviceToHost, s));
          CK(cudaEventRecord(evs[k], s));
          jobs.push_back({hp + o, std::min(c, n - o), o, evs[k]});
        }
        hash_chunks_pool(jobs, t);
      }, 7);
      printf("[d2h pinned verified] chunk %2llu MiB, %2d threads: %.1f GB/s = %.3f of raw\n", (unsigned long long)chunk_mib, t, gbs(w), d2h_raw / w);
    }
  }
  // ---- pinned host -> GPU: copy + host source hash in parallel + device dst hash ----
  double h2d_raw = time_ms(s, [&] { CK(cudaMemcpyAsync(b, hp, n, cudaMemcpyHostToDevice, s)); });
  for (int t : {4, 8, 16}) {
    if (t > (int)std::thread::hardware_concurrency()) break;
    double w = wall_ms([&] {
      CK(cudaMemcpyAsync(b, hp, n, cudaMemcpyHostToDevice, s));
      hash_kernel<<<wh, kThreads, 0, s>>>((const uint4*)b, nv, acc);
      std::vector<ChunkJob> jobs; for (uint64_t o = 0; o < n; o += (16 << 20)) jobs.push_back({hp + o, std::min<uint64_t>(16 << 20, n - o), o, nullptr});
      hash_chunks_pool(jobs, t);
      CK(cudaStreamSynchronize(s));
    }, 7);
    printf("[h2d pinned verified] %2d threads: %.1f GB/s = %.3f of raw %.1f\n", t, gbs(w), h2d_raw / w, gbs(h2d_raw));
  }
  // ---- GPU -> pageable host ----
  {
    uint8_t* pg = (uint8_t*)malloc(n); memset(pg, 1, n);
    double reuse = wall_ms([&] { CK(cudaMemcpy(pg, a, n, cudaMemcpyDeviceToHost)); }, 5);
    double fresh = wall_ms([&] { uint8_t* f = (uint8_t*)malloc(n); CK(cudaMemcpy(f, a, n, cudaMemcpyDeviceToHost)); free(f); }, 5);
    // staged: D2H into pinned chunks (ring of 8 x 16 MiB), threads memcpy to pageable + hash the pageable copy
    const uint64_t c = 16 << 20; const int ring = 8;
    for (int t : {4, 8, 16}) {
      if (t > (int)std::thread::hardware_concurrency()) break;
      double w = wall_ms([&] {
        uint8_t* f = (uint8_t*)malloc(n);
        const uint64_t nch = (n + c - 1) / c;
        std::atomic<uint64_t> next{0}; std::vector<std::atomic<int>> done(ring); for (auto& d : done) d = 1;
        std::vector<std::thread> th; std::atomic<uint64_t> total{0};
        std::vector<std::atomic<int>> queued(nch); for (auto& q : queued) q = 0;
        for (int i = 0; i < t; ++i) th.emplace_back([&] {
          for (uint64_t k; (k = next.fetch_add(1)) < nch;) {
            while (!queued[k].load()) std::this_thread::yield();
            CK(cudaEventSynchronize(evs[k % ring]));
            const uint64_t o = k * c, len = std::min(c, n - o);
            memcpy(f + o, hp + (k % ring) * c, len);
            total += host_sum(f + o, len / 8, o / 8);
            done[k % ring] = 1;
          }
        });
        for (uint64_t k = 0; k < nch; ++k) {
          while (!done[k % ring].load()) std::this_thread::yield();
          done[k % ring] = 0;
          CK(cudaMemcpyAsync(hp + (k % ring) * c, a + k * c, std::min(c, n - k * c), cudaMemcpyDeviceToHost, s));
          CK(cudaEventRecord(evs[k % ring], s));
          queued[k] = 1;
        }
        for (auto& x : th) x.join();
        free(f);
      }, 5);
      printf("[d2h pageable] raw reused %.1f GB/s, raw fresh %.1f GB/s | staged+hash fresh, %2d threads: %.1f GB/s = %.3f of fresh raw\n",
             gbs(reuse), gbs(fresh), t, gbs(w), fresh / w);
    }
    free(pg);
  }

  // ---- two-way peer ----
  if (ndev >= 2) {
    int ok01, ok10; CK(cudaDeviceCanAccessPeer(&ok01, 0, 1)); CK(cudaDeviceCanAccessPeer(&ok10, 1, 0));
    CK(cudaSetDevice(0)); if (ok01) cudaDeviceEnablePeerAccess(1, 0); cudaGetLastError();
    CK(cudaSetDevice(1)); if (ok10) cudaDeviceEnablePeerAccess(0, 0); cudaGetLastError();
    uint8_t *x1, *y1; cudaStream_t s1; CK(cudaMalloc(&x1, n)); CK(cudaMalloc(&y1, n)); CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaSetDevice(0));
    double one = time_ms(s, [&] { CK(cudaMemcpyPeerAsync(y1, 1, a, 0, n, s)); });
    // each direction from its own GPU's stream (src side issues), s1 waits for nothing
    cudaEvent_t e0, e1; CK(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming));
    CK(cudaSetDevice(1)); CK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming)); CK(cudaSetDevice(0));
    double both = time_ms(s, [&] {
      CK(cudaEventRecord(e0, s));
      CK(cudaSetDevice(1)); CK(cudaStreamWaitEvent(s1, e0, 0)); CK(cudaMemcpyPeerAsync(b, 0, x1, 1, n, s1)); CK(cudaEventRecord(e1, s1)); CK(cudaSetDevice(0));
      CK(cudaMemcpyPeerAsync(y1, 1, a, 0, n, s));
      CK(cudaStreamWaitEvent(s, e1, 0)); });
    // both directions from device 0's one stream (serialized)
    double serial = time_ms(s, [&] { CK(cudaMemcpyPeerAsync(y1, 1, a, 0, n, s)); CK(cudaMemcpyPeerAsync(b, 0, x1, 1, n, s)); });
    printf("\n[peer 0<->1] one way %.1f GB/s | two-way own streams %.1f GB/s total | one stream %.1f GB/s total\n",
           gbs(one), 2 * gbs(both), 2 * gbs(serial));
  }
  printf("\nprobe done\n");
  return 0;
}
