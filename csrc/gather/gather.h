// The all-gather's steady-state call (pyxfer/gather/engine.py drives it): plans registered once, then
// per call one collective that carries the data parts and every rank's agreement record, a verdict
// (records compared on the device, the result marked invalid on a disagreement, the latch written),
// the layout fix-ups and the NVFP4 renormalisation. Written once over what is device-generic (ATen
// ops); a backend (CPU here, CUDA in csrc/cuda/gather_cuda.cpp) supplies streams and kernels.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

namespace pyxfer {
namespace gather {

// The process group's single-tensor all-gather and its coalesced form under either name: torch 2.13
// renamed _allgather_base / allgather_into_tensor_coalesced to all_gather_single(_coalesced) and deprecated
// the old names, which torch 2.11 and 2.12 still need. The int overloads win where the new names exist;
// the others are instantiated only where they do not.
template <typename PG>
auto all_gather_single(PG& pg, at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& opts, int)
    -> decltype(pg.all_gather_single(out, in, opts)) {
  return pg.all_gather_single(out, in, opts);
}
template <typename PG>
c10::intrusive_ptr<c10d::Work> all_gather_single(PG& pg, at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts, long) {
  return pg._allgather_base(out, in, opts);
}
template <typename PG>
auto all_gather_single_coalesced(PG& pg, std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                 const c10d::AllgatherOptions& opts, int)
    -> decltype(pg.all_gather_single_coalesced(outs, ins, opts)) {
  return pg.all_gather_single_coalesced(outs, ins, opts);
}
template <typename PG>
c10::intrusive_ptr<c10d::Work> all_gather_single_coalesced(PG& pg, std::vector<at::Tensor>& outs,
                                                           std::vector<at::Tensor>& ins,
                                                           const c10d::AllgatherOptions& opts, long) {
  return pg.allgather_into_tensor_coalesced(outs, ins, opts);
}

constexpr const char* kOp = "pyxfer.all_gather";

// Descriptor layout (pyxfer/gather/engine.py writes it; the version word guards the two sides).
constexpr int64_t kPlanVersion = 1;
constexpr int kMaxDims = 8;
constexpr int kHeaderWords = 20;
constexpr int kPartWords = 30;

enum class Fixup : int { kDirect = 0, kPrefix = 1, kSwap = 2 };

// One gathered buffer: how this rank's send is cut from input `src`, and what its result is.
struct PartPlan {
  int src;                       // index of the input tensor it is cut from
  at::ScalarType send_dtype;     // as posted (uint8 for dtypes the backends lack)
  bool as_bytes;                 // the input's bytes are posted (its dtype is not a native one)
  int64_t trim_rows, trim_cols;  // the 2-D input's [0, rows) x [0, cols) is sent; -1: all of it
  std::vector<int64_t> send_shape;
  Fixup fixup;
  at::ScalarType out_dtype;
  std::vector<int64_t> out_shape;  // the result buffer (kSwap with padding: the unpadded [A, W*B...])
  int64_t pad_rows, pad_cols;      // kSwap: the zero-padded 2-D result, -1: none
  int poison_width;                // bytes of the NaN pattern written over the result on a disagreement; 0: none
  int64_t poison_pattern;
  int64_t send_numel() const;
};

struct Nvfp4Plan {
  bool enabled = false;  // an NVFP4 QuantizedTensor: amax slots, result amax, renormalisation
  int64_t shard_m = 0, k = 0;
  int nominal = 0;       // HighPrecision code of the nominal dtype (0 fp32, 1 bf16, 2 fp16)
  bool rowwise = false, columnwise = false;
  int amax_row_slot = 0, amax_col_slot = 0;
  int row_data = -1, row_scale = -1, col_data = -1, col_scale = -1;  // part indices
};

struct GatherPlan {
  int64_t world, rank;  // the group's size and this process's rank in it
  int64_t record_len, compare_len, hash_slot;  // record slots; the verdict compares [0, compare_len)
  std::vector<PartPlan> parts;
  Nvfp4Plan nvfp4;
};

// The registry: descriptors parsed once (gather_plan_new), looked up by id on every call.
std::shared_ptr<const GatherPlan> find_plan(int64_t id);

// Modes of gather_post / gather_run (bit flags; engine.py names them alike).
constexpr int64_t kModeAsync = 1;    // the collective runs beside the caller's stream (finish joins it)
constexpr int64_t kModeScratch = 2;  // post uninitialized buffers of the plan's layout, not the inputs
constexpr int64_t kModeVerdict = 4;  // compare the records (latch the verdict; finish marks the result)
constexpr int64_t kModeHashes = 8;   // write the PXH64 of every sent buffer into the record's hash slots

// What post hands to finish (and gather_post returns, in this order: results, temps, meta_recv).
struct Posted {
  std::vector<at::Tensor> results;  // per part its result buffer, then (NVFP4 plans) the result's amax
                                    // (rowwise, columnwise); kDirect / kPrefix results receive the data
  std::vector<at::Tensor> temps;    // per kSwap part, in part order: its rank-major receive buffer
  at::Tensor meta_recv;             // world x record_len int64, rank-major
  bool posted = false;              // false: the verdict of wait_seq said its call disagreed; nothing was posted
};

// ---- device-generic steps (gather.cpp) ----
// The contiguous, flat send tensors of every part (cut from `inputs`, or scratch).
std::vector<at::Tensor> prepare_sends(const GatherPlan& plan, const std::vector<at::Tensor>& inputs, bool scratch,
                                      const at::TensorOptions& device_options);
// Every result, temporary and the records' receive buffer; padding zeroed (on the current stream).
Posted allocate_receives(const GatherPlan& plan, const at::TensorOptions& device_options);
// The rank-major receive view of part i (flat; bytes where the part travels as bytes).
at::Tensor receive_view(const GatherPlan& plan, size_t i, const Posted& posted);
// dst (contiguous, [B, A, row]) = src ([A, B, row]) swapped; row_bytes bytes per row.
using SwapFn = void (*)(const at::Tensor& src, at::Tensor& dst, int64_t a_count, int64_t b_count, int64_t row_bytes);
// The layout fix-ups: every kSwap part's temporary into its result.
void fix_up(const GatherPlan& plan, const std::vector<at::Tensor>& results, const std::vector<at::Tensor>& temps,
            SwapFn swap);
// PXH64 of every send, into meta[hash_slot + i] (the checksum op, on the current stream).
void write_hashes(const GatherPlan& plan, const std::vector<at::Tensor>& sends, at::Tensor& meta);
// Whether some rank's record (rank-major rows of `records`) differs from this rank's own row.
bool records_disagree_host(const GatherPlan& plan, const int64_t* records);

// ---- a backend (CUDA registers one from csrc/cuda/gather_cuda.cpp) ----
struct Backend {
  // Posts the collective (and the verdict with kModeVerdict); `posted` false when the verdict of
  // `wait_seq` (> 0) says its call disagreed: then nothing was posted.
  Posted (*post)(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const GatherPlan& plan,
                 const std::vector<at::Tensor>& inputs, const at::Tensor& meta, const std::vector<at::Tensor>& amax,
                 int64_t* latch, int64_t seq, int64_t wait_seq, int64_t mode);
  // Fills the results: fix-ups, the result marked invalid on a disagreement (kModeVerdict), NVFP4 amax
  // and renormalisation.
  void (*finish)(const GatherPlan& plan, const std::vector<at::Tensor>& results, const std::vector<at::Tensor>& temps,
                 const at::Tensor& meta_recv, int64_t seq, int64_t mode);
  // A new latch for `device` (kLatchWords int64 of host memory the device writes), never freed: a
  // captured graph may replay into it at any time.
  int64_t* (*new_latch)(c10::Device device);
  // Makes the current stream wait for async call `seq`'s collective (nullptr: collectives complete in post).
  void (*join)(c10::Device device, int64_t seq);
};
bool register_cuda_backend(const Backend& backend);

// Host-time accounting of the native calls (gather_stats; benchmarks/gather_overhead.py): time inside
// the process group's collective call, and waits for an earlier call's verdict that found it missing.
void note_collective(int64_t ns);
void note_verdict_wait(bool waited, int64_t ns);

}  // namespace gather
}  // namespace pyxfer
