// Grid sizing for persistent kernels (csrc/kernels/*.cu). Torch-free; CUDA runtime only.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

namespace pyxfer {

// The number of blocks of Kernel (kBlockThreads threads, kDynamicSmem bytes of dynamic shared memory)
// that fit on the current device at once: a grid of exactly one wave. Cached per kernel and device
// ordinal; the first call on a device also lets Kernel launch with more than 48 KB of dynamic shared
// memory where kDynamicSmem asks for it (a per-device attribute). On a runtime error it returns 1 and
// leaves the error for the caller's cudaGetLastError().
template <auto Kernel, int kBlockThreads, int kDynamicSmem = 0>
uint64_t max_resident_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 1;
  int blocks = cache[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    if ((kDynamicSmem > (48 << 10) &&
         cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynamicSmem) != cudaSuccess) ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kBlockThreads, kDynamicSmem) != cudaSuccess)
      return 1;
    blocks = sms * (per_sm > 0 ? per_sm : 1);
    cache[device].store(blocks, std::memory_order_relaxed);
  }
  return uint64_t(blocks);
}

}  // namespace pyxfer
