// Kernels of the steady-state all-gather (pyxfer/gather_launch.h): the verdict into the latch, the
// result marked invalid on a disagreement (and the NVFP4 result amax), the NVFP4 renormalisation, the
// record packed with this rank's amax. Torch-free; every rule comes from pyxfer/gather.h, which the CPU
// path (csrc/gather/gather.cpp) runs too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/gather.h"
#include "pyxfer/gather_launch.h"

namespace pyxfer {
namespace gather {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // grid-stride loops: enough blocks to fill any GPU, few to launch

__device__ __forceinline__ const int64_t* own_record(const RecordsView& v) {
  return v.records + int64_t(v.rank) * v.record_len;
}

__device__ __forceinline__ bool disagree(const RecordsView& v) {
  return records_disagree(v.records, v.world, v.record_len, own_record(v), v.compare_len);
}

__global__ void verdict_kernel(RecordsView v, int64_t* latch, int64_t seq, bool captured) {
  const bool bad = disagree(v);
  const bool renorm =
      v.nvfp4 && !bad && nvfp4_amaxes(v.records, v.world, v.record_len, v.amax_row_slot, v.amax_col_slot).renormalise;
  // NOTE: plain volatile stores to mapped host memory, ordered by a system-scope fence: the sticky words
  // first, then the slot (one 8-byte store the host reads whole).
  volatile int64_t* w = latch;
  if (bad) {
    w[kLatchStickyBadSeq] = seq;
    w[kLatchStickyBad] = 1;
  }
  if (renorm) {
    w[kLatchStickyRenormSeq] = seq;
    w[kLatchStickyRenorm] = 1;
  }
  __threadfence_system();
  w[latch_slot(seq, captured)] = slot_word(seq, bad, renorm);
  __threadfence_system();
}

template <int W>
struct Word;
template <>
struct Word<1> {
  using T = uint8_t;
};
template <>
struct Word<2> {
  using T = uint16_t;
};
template <>
struct Word<4> {
  using T = uint32_t;
};
template <>
struct Word<8> {
  using T = uint64_t;
};

template <int W>
__device__ void fill(const PoisonRegion& r) {
  using T = typename Word<W>::T;
  T* p = static_cast<T*>(r.ptr);
  const T value = T(r.pattern);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < r.count; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void finish_kernel(FinishArgs a) {
  __shared__ bool bad;
  if (threadIdx.x == 0) bad = a.check && disagree(a.view);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.view.nvfp4) {
    uint32_t row = 0x7FC00000u, col = 0x7FC00000u;  // NaN: the result is invalid
    if (!bad) {
      const Nvfp4Amaxes m =
          nvfp4_amaxes(a.view.records, a.view.world, a.view.record_len, a.view.amax_row_slot, a.view.amax_col_slot);
      row = m.row_bits;
      col = m.col_bits;
    }
    if (a.amax_row_out != nullptr) *a.amax_row_out = __uint_as_float(row);
    if (a.amax_col_out != nullptr) *a.amax_col_out = __uint_as_float(col);
  }
  if (!bad) return;
  for (int i = 0; i < a.num_regions; ++i) {
    const PoisonRegion& r = a.regions[i];
    if (r.width == 1) fill<1>(r);
    else if (r.width == 2) fill<2>(r);
    else if (r.width == 4) fill<4>(r);
    else fill<8>(r);
  }
}

struct RoundF32 {
  __device__ float operator()(float v) const { return v; }
};
struct RoundBf16 {
  __device__ float operator()(float v) const { return __bfloat162float(__float2bfloat16_rn(v)); }
};
struct RoundF16 {
  __device__ float operator()(float v) const { return __half2float(__float2half_rn(v)); }
};

struct ShardAmax {
  const int64_t* records;
  int record_len, slot;
  __device__ float operator()(int64_t r) const { return __uint_as_float(uint32_t(records[r * record_len + slot])); }
};

template <typename Round>
__global__ void renormalise_kernel(RecordsView v, bool check, Nvfp4Gathered g, bool rowwise_out, bool from_rowwise) {
  __shared__ bool skip;
  __shared__ float s_enc, s_dec;
  if (threadIdx.x == 0) {
    const Nvfp4Amaxes m = nvfp4_amaxes(v.records, v.world, v.record_len, v.amax_row_slot, v.amax_col_slot);
    skip = !m.renormalise || (check && disagree(v));
    s_enc = fmt::nvfp4_encode_scale(m.group_max);
    s_dec = static_cast<float>(1.0 / static_cast<double>(s_enc));
  }
  __syncthreads();
  if (skip) return;
  const int64_t wm = g.world * g.shard_m, bl = fmt::kNvfp4BlockLen;
  const int64_t lines = rowwise_out ? wm : g.k, per_line = rowwise_out ? g.k / bl : wm / bl;
  const ShardAmax amax{v.records, v.record_len, from_rowwise ? v.amax_row_slot : v.amax_col_slot};
  const Round round;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < lines * per_line;
       i += int64_t(gridDim.x) * blockDim.x) {
    nvfp4_renormalise_block(g, rowwise_out, from_rowwise, i / per_line, i % per_line, s_enc, s_dec, round, amax);
  }
}

__global__ void pack_record_kernel(int64_t* dst, const int64_t* tmpl, int n, const float* amax_row,
                                   const float* amax_col, int row_slot, int col_slot) {
  const int i = threadIdx.x;
  if (i >= n) return;
  int64_t value = tmpl[i];
  if (i == row_slot) value = int64_t(int32_t(__float_as_uint(*amax_row)));
  if (i == col_slot) value = int64_t(int32_t(__float_as_uint(*amax_col)));
  dst[i] = value;
}

unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return unsigned(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

template <typename Round>
cudaError_t launch_renormalise(const RecordsView& v, bool check, const Nvfp4Gathered& g, bool rowwise,
                               bool columnwise, cudaStream_t stream) {
  const int64_t blocks = g.world * g.shard_m * g.k / fmt::kNvfp4BlockLen;  // NVFP4 blocks of either usage
  // The columnwise pass first: it may read the rowwise bytes that the rowwise pass rewrites in place.
  if (columnwise) renormalise_kernel<Round><<<grid_for(blocks), kThreads, 0, stream>>>(v, check, g, false, rowwise);
  if (rowwise) renormalise_kernel<Round><<<grid_for(blocks), kThreads, 0, stream>>>(v, check, g, true, true);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gather_verdict(const RecordsView& v, int64_t* latch, int64_t seq, bool captured,
                                  cudaStream_t stream) {
  verdict_kernel<<<1, 1, 0, stream>>>(v, latch, seq, captured);
  return cudaGetLastError();
}

cudaError_t launch_gather_finish(const FinishArgs& args, cudaStream_t stream) {
  int64_t most = 0;
  for (int i = 0; i < args.num_regions; ++i) most = args.regions[i].count > most ? args.regions[i].count : most;
  finish_kernel<<<grid_for(most), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_gather_nvfp4_renormalise(const RecordsView& v, bool check, const Nvfp4Gathered& g, int nominal,
                                            bool rowwise, bool columnwise, cudaStream_t stream) {
  if (g.world * g.shard_m == 0 || g.k == 0) return cudaSuccess;
  if (nominal == 1) return launch_renormalise<RoundBf16>(v, check, g, rowwise, columnwise, stream);
  if (nominal == 2) return launch_renormalise<RoundF16>(v, check, g, rowwise, columnwise, stream);
  return launch_renormalise<RoundF32>(v, check, g, rowwise, columnwise, stream);
}

cudaError_t launch_gather_pack_record(int64_t* dst, const int64_t* tmpl, int n, const float* amax_row,
                                      const float* amax_col, int row_slot, int col_slot, cudaStream_t stream) {
  if (n <= 0 || n > 1024) return cudaErrorInvalidValue;
  pack_record_kernel<<<1, n, 0, stream>>>(dst, tmpl, n, amax_row, amax_col, row_slot, col_slot);
  return cudaGetLastError();
}

}  // namespace gather
}  // namespace pyxfer
