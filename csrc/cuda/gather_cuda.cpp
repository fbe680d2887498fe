// The CUDA backend of the steady-state all-gather (csrc/gather/gather.h): one coalesced NCCL launch of
// every part and the record, the verdict kernel writing the latch (mapped host memory), the finish
// kernel marking a disagreeing result invalid, the NVFP4 renormalisation. No host sync, no host read
// of device data, except the wait for an earlier call's verdict (`wait_seq`), which reads host memory.
//
// Streams. Synchronous calls (asyncOp=false) run the collective on the caller's current stream (torch's
// ProcessGroupNCCL does so since 2.7: no side stream, no record_stream, capturable in a CUDA graph);
// the verdict and the finish follow on that stream. Asynchronous calls post with asyncOp=true (NCCL's
// own stream waits for the caller's), then a pyxfer side stream of the device waits for the collective
// (Work::wait with that stream current), every posted buffer is recorded on it (the allocator reuses
// none before the collective completed, whatever the caller does with the handle) and the Work is
// dropped; the verdict runs there, and an event of the call's ring slot marks that point, which
// finish (in the handle's wait()) makes the caller's stream wait for.
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "cuda/stream_order.h"
#include "gather/gather.h"
#include "pyxfer/gather.h"
#include "pyxfer/formats_launch.h"
#include "pyxfer/gather_launch.h"

namespace pyxfer {
namespace gather {
namespace {

using c10::cuda::CUDAStream;

constexpr int kMaxDevices = 64;
constexpr int kEventRing = 64;  // async calls of a device in flight before a wait joins a later point (still correct)

struct DeviceState {
  cudaStream_t side = nullptr;
  std::array<cudaEvent_t, kEventRing> events{};
};

// NOTE: leaked (never destroyed): streams and events outlive CUDA's teardown order at exit.
DeviceState& device_state(c10::DeviceIndex device) {
  static std::mutex mutex;
  static auto* states = new std::array<DeviceState, kMaxDevices>();
  TORCH_CHECK(device >= 0 && device < kMaxDevices, kOp, ": device index ", int(device), " out of range");
  const std::lock_guard<std::mutex> lock(mutex);
  DeviceState& s = (*states)[device];
  if (s.side == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s.side, cudaStreamNonBlocking));
    for (cudaEvent_t& e : s.events) C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  return s;
}

CUDAStream side_stream(c10::DeviceIndex device) {
  return c10::cuda::getStreamFromExternal(device_state(device).side, device);
}

cudaEvent_t ring_event(c10::DeviceIndex device, int64_t seq) {
  return device_state(device).events[size_t(seq % kEventRing)];
}

int64_t* latch_device_pointer(int64_t* latch) {
  void* p = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&p, latch, 0));
  return static_cast<int64_t*>(p);
}

int64_t* new_latch_cuda(c10::Device device) {
  TORCH_CHECK(device.has_index(), kOp, ": the latch's device needs an index, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  void* p = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&p, sizeof(int64_t) * kLatchWords, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(p, 0, sizeof(int64_t) * kLatchWords);
  return static_cast<int64_t*>(p);  // NOTE: never freed: a captured graph may replay into it at any time
}

// Whether call `seq` disagreed, waiting (host memory reads, no CUDA call) until its verdict is there.
// A device that failed never writes it: its error is surfaced from the streams that would.
bool verdict_bad(const int64_t* latch, int64_t seq, const CUDAStream& current, bool capturing) {
  const volatile int64_t* w = latch + latch_slot(seq, false);
  if ((*w >> kSlotShift) == seq) {
    note_verdict_wait(false, 0);
    return (*w & kVerdictBad) != 0;
  }
  const auto started = std::chrono::steady_clock::now();
  for (uint64_t spins = 1; (*w >> kSlotShift) != seq; ++spins) {
    if (spins % 4096 != 0) continue;
    std::this_thread::yield();
    if (capturing) continue;  // (a query of a capturing stream would break the capture)
    // A sticky device error (a failed kernel) is returned by any stream's query.
    const cudaError_t e = cudaStreamQuery(current.stream());
    if (e != cudaSuccess && e != cudaErrorNotReady) C10_CUDA_CHECK(e);
  }
  note_verdict_wait(true, std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                                started).count());
  return (*w & kVerdictBad) != 0;
}

RecordsView view_of(const GatherPlan& plan, const at::Tensor& meta_recv) {
  RecordsView v{};
  v.records = meta_recv.data_ptr<int64_t>();
  v.world = int(plan.world);
  v.rank = int(plan.rank);
  v.record_len = int(plan.record_len);
  v.compare_len = int(plan.compare_len);
  v.nvfp4 = plan.nvfp4.enabled;
  v.amax_row_slot = plan.nvfp4.amax_row_slot;
  v.amax_col_slot = plan.nvfp4.amax_col_slot;
  return v;
}

void check_amax(const at::Tensor& a, const at::Device& device) {
  TORCH_CHECK(a.is_cuda() && a.device() == device && a.scalar_type() == at::kFloat && a.numel() == 1, kOp,
              ": an NVFP4 amax must be one float32 on ", device, ", got ", a.scalar_type(), " ", a.sizes(), " on ",
              a.device());
}

Posted post_cuda(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const GatherPlan& plan,
                 const std::vector<at::Tensor>& inputs, const at::Tensor& meta, const std::vector<at::Tensor>& amax,
                 int64_t* latch, int64_t seq, int64_t wait_seq, int64_t mode) {
  const at::Device device = meta.device();
  const c10::cuda::CUDAGuard guard(device);
  const CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  const bool capturing = is_capturing(current);
  const bool async = (mode & kModeAsync) != 0;
  TORCH_CHECK(!(async && capturing), kOp, ": an async_op=True gather cannot be captured in a CUDA graph "
              "(capture the synchronous call)");
  for (const at::Tensor& t : inputs) {
    TORCH_CHECK(t.device() == device, kOp, ": every buffer must be on ", device, ", got one on ", t.device());
  }
  const at::TensorOptions options = meta.options();
  std::vector<at::Tensor> sends = prepare_sends(plan, inputs, (mode & kModeScratch) != 0, options);
  at::Tensor meta_send = meta;
  if (!amax.empty() || (mode & kModeHashes)) {
    meta_send = at::empty_like(meta);
    if (!amax.empty()) {
      check_amax(amax[0], device);
      check_amax(amax[1], device);
      C10_CUDA_CHECK(launch_gather_pack_record(meta_send.data_ptr<int64_t>(), meta.data_ptr<int64_t>(),
                                               int(plan.record_len), amax[0].data_ptr<float>(),
                                               amax[1].data_ptr<float>(), plan.nvfp4.amax_row_slot,
                                               plan.nvfp4.amax_col_slot, current.stream()));
    } else {
      meta_send.copy_(meta);
    }
    if (mode & kModeHashes) write_hashes(plan, sends, meta_send);
  }
  Posted posted = allocate_receives(plan, options);
  // NOTE: everything that can fail for lack of memory happened above: from here on the call posts.
  if (wait_seq > 0 && verdict_bad(latch, wait_seq, current, capturing)) return Posted{};
  posted.posted = true;
  std::vector<at::Tensor> ins, outs;
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sends[i].numel() == 0) continue;
    ins.push_back(sends[i]);
    outs.push_back(receive_view(plan, i, posted));
  }
  ins.push_back(meta_send);
  outs.push_back(posted.meta_recv);
  c10d::AllgatherOptions opts;
  opts.asyncOp = async;
  const auto launch_started = std::chrono::steady_clock::now();
  c10::intrusive_ptr<c10d::Work> work = all_gather_single_coalesced(*pg, outs, ins, opts, 0);
  note_collective(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                       launch_started).count());
  const RecordsView view = view_of(plan, posted.meta_recv);
  if (!async) {
    // asyncOp=false queues the collective on `current`; waiting for the Work (as torch.distributed's own
    // synchronous calls do) orders `current` after it even where a backend ran it on a stream of its own.
    if (work) work->wait();
    work.reset();
    if (mode & kModeVerdict) {
      C10_CUDA_CHECK(launch_gather_verdict(view, latch_device_pointer(latch), seq, capturing, current.stream()));
    }
    return posted;
  }
  const CUDAStream side = side_stream(device.index());
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    if (work) work->wait();  // the side stream (current here) waits for the collective
  }
  work.reset();  // NOTE: no Work object outlives its use
  // NOTE: the backend may drop its references once waited for: recorded on the side stream, no posted
  // buffer is reused before the collective completed, even if the caller drops the handle.
  for (const at::Tensor& t : ins) keep_alive_on(t, side);
  for (const at::Tensor& t : posted.results) keep_alive_on(t, side);
  for (const at::Tensor& t : posted.temps) keep_alive_on(t, side);
  keep_alive_on(posted.meta_recv, side);
  if (mode & kModeVerdict) {
    C10_CUDA_CHECK(launch_gather_verdict(view, latch_device_pointer(latch), seq, false, side.stream()));
  }
  C10_CUDA_CHECK(cudaEventRecord(ring_event(device.index(), seq), side.stream()));
  return posted;
}

void swap_cuda(const at::Tensor& src, at::Tensor& dst, int64_t a_count, int64_t b_count, int64_t row_bytes) {
  C10_CUDA_CHECK(launch_swap_first_dims(src.data_ptr(), dst.data_ptr(), a_count, b_count, row_bytes,
                                        c10::cuda::getCurrentCUDAStream(src.device().index()).stream()));
}

void join_cuda(c10::Device device, int64_t seq) {
  const c10::cuda::CUDAGuard guard(device);
  wait(c10::cuda::getCurrentCUDAStream(device.index()), ring_event(device.index(), seq));
}

void finish_cuda(const GatherPlan& plan, const std::vector<at::Tensor>& results, const std::vector<at::Tensor>& temps,
                 const at::Tensor& meta_recv, int64_t seq, int64_t mode) {
  const at::Device device = meta_recv.device();
  const c10::cuda::CUDAGuard guard(device);
  const CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  if (mode & kModeAsync) join_cuda(device, seq);
  fix_up(plan, results, temps, &swap_cuda);
  const bool check = (mode & kModeVerdict) != 0;
  FinishArgs args{};
  args.view = view_of(plan, meta_recv);
  args.check = check;
  for (size_t i = 0; i < plan.parts.size() && check; ++i) {
    const PartPlan& p = plan.parts[i];
    if (p.poison_width == 0 || results[i].numel() == 0) continue;
    TORCH_CHECK(args.num_regions < kMaxPoisonRegions, kOp, ": too many buffers to mark");
    args.regions[args.num_regions++] = PoisonRegion{results[i].data_ptr(),
                                                    int64_t(results[i].nbytes()) / p.poison_width, p.poison_width,
                                                    uint64_t(p.poison_pattern)};
  }
  const size_t n = plan.parts.size();
  if (plan.nvfp4.enabled) {
    args.amax_row_out = results[n].data_ptr<float>();
    args.amax_col_out = results[n + 1].data_ptr<float>();
  }
  if (args.num_regions > 0 || plan.nvfp4.enabled) C10_CUDA_CHECK(launch_gather_finish(args, current.stream()));
  if (!plan.nvfp4.enabled) return;
  const Nvfp4Plan& nv = plan.nvfp4;
  Nvfp4Gathered g{};
  g.row_data = nv.rowwise ? results[nv.row_data].data_ptr<uint8_t>() : nullptr;
  g.row_scale = nv.rowwise ? results[nv.row_scale].data_ptr<uint8_t>() : nullptr;
  g.col_data = nv.columnwise ? results[nv.col_data].data_ptr<uint8_t>() : nullptr;
  g.col_scale = nv.columnwise ? results[nv.col_scale].data_ptr<uint8_t>() : nullptr;
  g.shard_m = nv.shard_m;
  g.k = nv.k;
  g.world = plan.world;
  g.row_scale_cols = nv.rowwise ? results[nv.row_scale].size(1) : 0;
  g.col_scale_cols = nv.columnwise ? results[nv.col_scale].size(1) : 0;
  C10_CUDA_CHECK(launch_gather_nvfp4_renormalise(args.view, check, g, nv.nominal, nv.rowwise, nv.columnwise,
                                                 current.stream()));
}

const bool registered = register_cuda_backend({&post_cuda, &finish_cuda, &new_latch_cuda, &join_cuda});

}  // namespace
}  // namespace gather
}  // namespace pyxfer
