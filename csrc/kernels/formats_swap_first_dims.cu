// swap_first_dims (pyxfer/formats_launch.h): dst[b, a, :] = src[a, b, :], which turns the rank-major
// buffers of the quantized all-gather into the layout a format needs. Torch-free. Moved in units of W
// bytes (the widest that divides the row and both addresses); each thread moves kSwapUnroll units
// (loads first, then stores).
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/formats.h"
#include "pyxfer/formats_launch.h"

namespace pyxfer {
namespace {

constexpr int kThreads = 256;
constexpr int kSwapUnroll = 4;

template <typename W, typename Index>
__global__ void __launch_bounds__(kThreads) swap_first_dims_kernel(const W* __restrict__ src, W* __restrict__ dst,
                                                                   Index a_count, Index b_count, Index row_units,
                                                                   Index total) {
  const Index base = Index(blockIdx.x) * (kThreads * kSwapUnroll) + threadIdx.x;
  W value[kSwapUnroll];
#pragma unroll
  for (int u = 0; u < kSwapUnroll; ++u) {
    const Index i = base + Index(u) * kThreads;  // destination unit
    if (i < total) {
      const Index row = i / row_units, r = i - row * row_units;  // destination row = b * A + a
      const Index b = row / a_count, a = row - b * a_count;
      value[u] = src[(a * b_count + b) * row_units + r];
    }
  }
#pragma unroll
  for (int u = 0; u < kSwapUnroll; ++u) {
    const Index i = base + Index(u) * kThreads;
    if (i < total) dst[i] = value[u];
  }
}

template <typename W>
cudaError_t launch_swap_units(const void* src, void* dst, int64_t a_count, int64_t b_count, int64_t row_bytes,
                              cudaStream_t stream) {
  const int64_t row_units = row_bytes / int64_t(sizeof(W));
  const int64_t total = a_count * b_count * row_units;
  const int64_t blocks = fmt::cdiv(total, int64_t(kThreads) * kSwapUnroll);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  const W* s = static_cast<const W*>(src);
  W* d = static_cast<W*>(dst);
  if (total < (int64_t(1) << 31)) {  // 32-bit index math is much cheaper than 64-bit division
    swap_first_dims_kernel<W, uint32_t><<<unsigned(blocks), kThreads, 0, stream>>>(
        s, d, uint32_t(a_count), uint32_t(b_count), uint32_t(row_units), uint32_t(total));
  } else {
    swap_first_dims_kernel<W, uint64_t><<<unsigned(blocks), kThreads, 0, stream>>>(
        s, d, uint64_t(a_count), uint64_t(b_count), uint64_t(row_units), uint64_t(total));
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_swap_first_dims(const void* src, void* dst, int64_t a_count, int64_t b_count, int64_t row_bytes,
                                   cudaStream_t stream) {
  if (a_count == 0 || b_count == 0 || row_bytes == 0) return cudaSuccess;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | uintptr_t(row_bytes);
  if (bits % 16 == 0) return launch_swap_units<uint4>(src, dst, a_count, b_count, row_bytes, stream);
  if (bits % 8 == 0) return launch_swap_units<uint2>(src, dst, a_count, b_count, row_bytes, stream);
  if (bits % 4 == 0) return launch_swap_units<uint32_t>(src, dst, a_count, b_count, row_bytes, stream);
  if (bits % 2 == 0) return launch_swap_units<uint16_t>(src, dst, a_count, b_count, row_bytes, stream);
  return launch_swap_units<uint8_t>(src, dst, a_count, b_count, row_bytes, stream);
}

}  // namespace pyxfer
