// The launch seam of the steady-state all-gather's kernels (csrc/kernels/gather_post.cu): plain
// pointers, sizes and a stream in, the launch's cudaGetLastError() out. Rules: pyxfer/gather.h.
// NOTE: every launcher runs on the current device, which must hold the pointers (the latch is mapped
// host memory, given by its device pointer). Nothing here synchronizes.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/gather.h"

namespace pyxfer {
namespace gather {

// The records a verdict reads: world rows of record_len int64 (rank-major); this rank's own row is the
// expected one.
struct RecordsView {
  const int64_t* records;
  int world, rank, record_len, compare_len;
  int amax_row_slot, amax_col_slot;  // NVFP4 plans; ignored otherwise
  bool nvfp4;
};

// One thread: compares the records and writes the verdict of call `seq` into the latch (the graph slot
// when `captured`), the sticky words first, then the slot's flags, a system-scope fence, the slot's seq.
cudaError_t launch_gather_verdict(const RecordsView& v, int64_t* latch, int64_t seq, bool captured,
                                  cudaStream_t stream);

// What a disagreement overwrites: `count` elements of `width` bytes (1, 2, 4 or 8) at `ptr`, each set
// to the low `width` bytes of `pattern` (a NaN of the buffer's dtype).
struct PoisonRegion {
  void* ptr;
  int64_t count;
  int width;
  uint64_t pattern;
};
constexpr int kMaxPoisonRegions = 8;

// Marks the result invalid when the records disagree (every region filled with its pattern; every
// block compares the records itself, so no verdict word is passed between kernels) and, for NVFP4
// plans, writes the result's amax (NaN on a disagreement): amax_row_out / amax_col_out (fp32).
struct FinishArgs {
  RecordsView view;
  bool check;  // compare the records (the kModeVerdict calls); false: never poison
  PoisonRegion regions[kMaxPoisonRegions];
  int num_regions;
  float* amax_row_out;
  float* amax_col_out;
};
cudaError_t launch_gather_finish(const FinishArgs& args, cudaStream_t stream);

// NVFP4: when the records agree and the shards' amax differ (nvfp4_amaxes), requantizes the gathered
// buffers in place with the group's amax (pyxfer/gather.h nvfp4_renormalise_block): the columnwise
// pass, then the rowwise pass. `nominal`: 0 fp32, 1 bf16, 2 fp16. Launches that find nothing to do
// return at once (the host does not know).
cudaError_t launch_gather_nvfp4_renormalise(const RecordsView& v, bool check, const Nvfp4Gathered& g, int nominal,
                                            bool rowwise, bool columnwise, cudaStream_t stream);

// dst[0, n) = tmpl[0, n), then dst[row_slot] / dst[col_slot] = the fp32 bits of *amax_row / *amax_col
// as int32 sign-extended to int64 (the record's amax slots). One tiny launch.
cudaError_t launch_gather_pack_record(int64_t* dst, const int64_t* tmpl, int n, const float* amax_row,
                                      const float* amax_col, int row_slot, int col_slot, cudaStream_t stream);

}  // namespace gather
}  // namespace pyxfer
