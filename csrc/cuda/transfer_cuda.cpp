// The CUDA mechanics of verified transfers (any end on a GPU); the protocol itself is in
// csrc/transfer/verified_copy.cpp, the reusable plumbing in cuda/stream_order.h, cuda/peer_access.h
// and cuda/staging_pool.h. Streams: Sa / Sb are the current streams of the source / destination
// device (the callers' streams, as Tensor.to uses them); side streams from the pool hash the source
// beside the copy (Ha), hash destination chunks as they land (Hb) and run staged legs (Ca, Cb).
// Every side stream starts after an event from a current stream and ends joined back into one, so
// the result is ready on Sb, later work on Sa is ordered after the reads, and CUDA graph capture sees
// a proper fork/join.
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

#include "checks.h"
#include "cuda/peer_access.h"
#include "cuda/pxh64_cuda.h"
#include "cuda/staging_pool.h"
#include "cuda/stream_order.h"
#include "pyxfer/launch.h"
#include "transfer/errors.h"
#include "transfer/transfer.h"

namespace pyxfer {
namespace {

using c10::cuda::CUDAStream;

constexpr int64_t kOverlapBytes = int64_t(4) << 20;  // from here on, hash beside the copy on side streams

// Hashed peer copies up to fused_max bytes run as one kernel on the destination GPU that pulls the
// bytes over NVLink and hashes each piece as read back after it landed (launch_copy_pxh64): no
// copy-engine step and nothing in the tail but the kernel's last blocks. Larger ones use the copy
// engine, pipelined: they hash chunk k on the destination while chunk k+1 moves. Each chunk is
// (shrink - 1) / shrink of what is left, so it is 1/shrink of the one before: few chunks (each costs
// a gap in the copy engine's stream) and a small last chunk (the only hash not hidden behind the
// copy). The hash of chunk k (~4 TB/s) stays hidden behind the copy of chunk k+1 (~0.4 TB/s over
// NVLink) while shrink < ~10. No chunk is smaller than min_chunk. 9 and 4 MiB give 256 MiB two chunks
// (227.6 + 28.4 MiB), 1 GiB three; on 2x H200 that beat 6 and 2 MiB (three chunks at 256 MiB) by 1-2
// points of raw bandwidth at 256 MiB in the same run (benchmarks/RESULTS.md, run G).
struct PipelineSchedule {
  int64_t fused_max = int64_t(64) << 20;  // bytes; 0: never fused
  int64_t shrink = 9;                     // <= 1: one chunk (the destination hash after the copy)
  int64_t min_chunk = int64_t(4) << 20;   // bytes, a multiple of 8
};

// Benchmark/tuning knobs, read once (benchmarks/peer_overlap.py --schedules compares them):
// PYXFER_PEER_FUSED_MIB="<fused max MiB>" (0: always the copy engine) and
// PYXFER_PEER_CHUNKS="<shrink>,<min chunk MiB>", e.g. "2,8" for halving chunks of at least 8 MiB.
PipelineSchedule read_schedule() {
  PipelineSchedule s;
  if (const char* fused = std::getenv("PYXFER_PEER_FUSED_MIB"); fused != nullptr && *fused != '\0') {
    double mib = -1;
    TORCH_CHECK(std::sscanf(fused, "%lf", &mib) == 1 && mib >= 0, "PYXFER_PEER_FUSED_MIB must be a size in MiB "
                "such as '64' (0: never), got '", fused, "'");
    s.fused_max = int64_t(mib * double(1 << 20));
  }
  const char* text = std::getenv("PYXFER_PEER_CHUNKS");
  if (text == nullptr || *text == '\0') return s;
  long long shrink = 0;
  double min_mib = 0;
  TORCH_CHECK(std::sscanf(text, "%lld,%lf", &shrink, &min_mib) == 2 && min_mib > 0, "PYXFER_PEER_CHUNKS must be "
              "'<shrink>,<min chunk MiB>' such as '6,2', got '", text, "'");
  s.shrink = shrink;
  s.min_chunk = std::max<int64_t>(8, int64_t(min_mib * double(1 << 20)) / 8 * 8);
  return s;
}

const PipelineSchedule& pipeline_schedule() {
  static const PipelineSchedule schedule = read_schedule();
  return schedule;
}

int64_t next_pipeline_end(int64_t begin, int64_t num_bytes) {
  const PipelineSchedule& s = pipeline_schedule();
  const int64_t left = num_bytes - begin;
  if (s.shrink <= 1) return num_bytes;
  int64_t chunk = std::max(s.min_chunk, (left - left / s.shrink + 7) / 8 * 8);
  if (left - chunk < s.min_chunk) chunk = left;  // no last chunk below the minimum
  return begin + chunk;
}

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
uint64_t* u64_of(const at::Tensor& t) { return reinterpret_cast<uint64_t*>(t.data_ptr<int64_t>()); }

// ---- sync-mode hash results -----------------------------------------------------------------------
// A per-thread pair of words in mapped pinned memory (valid on every device through UVA): the hash
// kernels write their results there and the host reads them after its wait, with no device -> host
// copy and no allocation per call. Only sync copies use it (the host waits before the next copy of
// the thread can reuse it; never inside a CUDA graph, whose replays would write it later).
struct alignas(64) HostHashes {
  uint64_t src, dst;
};

class HostHashPool {
 public:
  HostHashes* take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) {
      constexpr int kPerBlock = 64;
      const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
      void* p = nullptr;
      C10_CUDA_CHECK(cudaHostAlloc(&p, sizeof(HostHashes) * kPerBlock, cudaHostAllocMapped | cudaHostAllocPortable));
      for (int i = 0; i < kPerBlock; ++i) free_.push_back(static_cast<HostHashes*>(p) + i);
    }
    HostHashes* h = free_.back();
    free_.pop_back();
    return h;
  }
  void give(HostHashes* h) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(h);
  }

 private:
  std::mutex mutex_;
  std::vector<HostHashes*> free_;
};

HostHashPool& host_hash_pool() {
  static HostHashPool* pool = new HostHashPool();  // NOTE: leaked on purpose: outlives CUDA teardown order
  return *pool;
}

struct ThreadHostHashes {
  HostHashes* slot = nullptr;
  ~ThreadHostHashes() {
    if (slot != nullptr) host_hash_pool().give(slot);
  }
};
thread_local ThreadHostHashes thread_host_hashes;

HostHashes* host_hashes() {
  if (thread_host_hashes.slot == nullptr) thread_host_hashes.slot = host_hash_pool().take();
  return thread_host_hashes.slot;
}

// After an error between launch and wait, kernels may still write the slot: never reuse it.
void abandon_host_hashes() { thread_host_hashes.slot = nullptr; }

// ---- the deferred-verification latch --------------------------------------------------------------
std::mutex latch_mutex;
TransferLatch* latch = nullptr;  // mapped pinned memory, valid on every device (UVA)
std::set<int> latch_devices;     // devices that queued a latch check since the last take

TransferLatch* device_latch(int device) {
  std::lock_guard<std::mutex> lock(latch_mutex);
  if (latch == nullptr) {
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&p, sizeof(TransferLatch), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, sizeof(TransferLatch));
    latch = static_cast<TransferLatch*>(p);
  }
  latch_devices.insert(device);
  return latch;
}

TransferErrorRecord take_cuda_errors() {
  std::set<int> devices;
  {
    std::lock_guard<std::mutex> lock(latch_mutex);
    if (latch == nullptr) return {};
    devices.swap(latch_devices);
  }
  for (int d : devices) {  // the latch is written by kernels: wait for those devices
    const c10::cuda::CUDAGuard guard(d);
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::lock_guard<std::mutex> lock(latch_mutex);
  volatile TransferLatch* l = latch;
  TransferErrorRecord r;
  r.count = int64_t(l->count);
  if (r.count > 0) {
    r.src = l->src_device;
    r.dst = l->dst_device;
    r.num_bytes = l->num_bytes;
    r.src_hash = l->src_hash;
    r.dst_hash = l->dst_hash;
  }
  std::memset(const_cast<TransferLatch*>(latch), 0, sizeof(TransferLatch));
  return r;
}

// ---- one transfer with at least one CUDA end ------------------------------------------------------

// *out = PXH64(t) on `s` (t's device). Workspaces are allocated on `s` itself (stream-ordered reuse).
void hash_on(const CUDAStream& s, const at::Tensor& t, uint64_t* out) {
  const c10::cuda::CUDAStreamGuard on(s);
  pxh64_into(t, 0, out);
}

class CudaPath final : public TransferPath {
 public:
  CudaPath(const at::Device& src, const at::Device& dst) : src_(src), dst_(dst) {
    if (src_.is_cuda()) sa_ = c10::cuda::getCurrentCUDAStream(src_.index());
    if (dst_.is_cuda()) sb_ = c10::cuda::getCurrentCUDAStream(dst_.index());
    peer_ = src_.is_cuda() && dst_.is_cuda() && src_.index() != dst_.index();
    sa_capturing_ = sa_ && is_capturing(*sa_);
    sb_capturing_ = sb_ && is_capturing(*sb_);
    // In graph capture the other device's work goes on a pool stream that joins the capture (its
    // current stream may be the legacy default stream, which cannot be captured).
    if (peer_ && sa_capturing_ && !sb_capturing_) sb_ = c10::cuda::getStreamFromPool(false, dst_.index());
    if (peer_ && sb_capturing_ && !sa_capturing_) sa_ = c10::cuda::getStreamFromPool(false, src_.index());
  }

  ~CudaPath() override {
    if (host_pending_) abandon_host_hashes();  // an error came between the launches and the wait
  }

  at::Device dst_device() const override { return dst_; }
  bool direct_supported() const override { return !peer_ || can_access_peer(src_.index(), dst_.index()); }
  bool capturing() const override { return sa_capturing_ || sb_capturing_; }

  at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype, Verify verify) override {
    verify_ = verify;
    // Sync results (and any comparison with a CPU destination) land in the thread's mapped host words;
    // deferred ones stay on the destination GPU for the latch kernel (in capture: the graph's pool).
    on_host_ = verify == Verify::kSync || (verify == Verify::kDeferred && !dst_.is_cuda());
    if (on_host_) {
      host_ = host_hashes();
      host_pending_ = true;
    }
    const auto options = at::TensorOptions().dtype(dtype).device(dst_);
    if (!dst_.is_cuda()) return at::empty(sizes, options);
    if (sa_capturing_) order(*sa_, *sb_);        // fork: Sb joins the capture
    if (sb_capturing_ && sa_) order(*sb_, *sa_);  // fork: Sa joins the capture
    // Allocations belong to Sb (in capture: the graph's pool); every write of them is ordered after
    // Sb: the direct copy runs on Sb, staged legs and hashes on streams forked from it.
    const c10::cuda::CUDAStreamGuard on(*sb_);
    if (verify == Verify::kDeferred) hashes_ = at::empty({2}, options.dtype(at::kLong));  // [source, destination]
    return at::empty(sizes, options);
  }

  void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) override {
    num_bytes_ = plan.num_bytes;
    const bool hash = verify_ != Verify::kNone;
    beside_ = hash && src_.is_cuda() && plan.num_bytes >= kOverlapBytes;
    const bool device_to_device = route != Route::kStaged && src_.is_cuda() && dst_.is_cuda();
    bool dst_hashed = false;
    if (device_to_device) {
      dst_hashed = copy_device_to_device(dst, src, plan);  // also queues the source hash
    } else {
      if (hash && src_.is_cuda()) hash_src(src, nullptr);  // beside the copy (a side stream) or before it
      if (route == Route::kStaged) copy_staged(dst, src, plan);
      else copy_host_device(dst, src, plan);
    }
    if (hash && src_.is_cpu()) src_value_ = cpu_hash(src);  // after queuing the copy: overlaps a pinned one
    if (hash && !dst_hashed) {
      if (dst_.is_cuda()) hash_on(*sb_, dst, dst_out());  // on Sb, after the data landed there
      else dst_value_ = cpu_hash(dst);                     // torch's copy into host memory has finished
    }
    if (hs_ && *hs_ != *sa_) order(*hs_, *sa_);  // later work on Sa (writes to src) runs after the hash read it
    if (hs_ && !on_host_) {  // deferred: the latch kernel on Sb compares a copy of the source hash
      order(*hs_, *sb_);
      const c10::cuda::CUDAGuard guard(dst_);
      keep_alive_on(src_hash_, *sb_);
      C10_CUDA_CHECK(cudaMemcpyAsync(u64_of(hashes_), src_hash_.data_ptr(), sizeof(int64_t), cudaMemcpyDeviceToDevice,
                                     sb_->stream()));
    }
    if (device_to_device && *sb_ != *sa_) order(*sb_, *sa_);  // later work on Sa (writes to src) after the copy read it
    if (verify_ == Verify::kNone) join();
  }

  bool compare(uint64_t* src_value, uint64_t* dst_value) override {
    if (!on_host_) {  // deferred with a CUDA destination: compare on Sb, latch a mismatch
      const c10::cuda::CUDAGuard guard(dst_);
      const uint64_t* src_ptr = src_.is_cuda() ? u64_of(hashes_) : nullptr;
      C10_CUDA_CHECK(launch_latch_mismatch(src_ptr, src_value_, u64_of(hashes_) + 1, device_latch(dst_.index()),
                                           device_code(src_), device_code(dst_), num_bytes_, sb_->stream()));
      join();
      return true;
    }
    // The source hash's stream first (it finished during the copy), then the one that wrote the
    // destination hash: the host waits for both instead of one stream waiting on the other's device.
    if (hs_ && !src_hash_in_sb_) host_wait(*hs_);  // a CUDA source's hash, unless Sb's work came after it
    if (dst_.is_cuda()) host_wait(*sb_);
    host_pending_ = false;
    const volatile HostHashes* h = host_;
    *src_value = src_.is_cuda() ? h->src : src_value_;
    *dst_value = dst_.is_cuda() ? h->dst : dst_value_;
    const bool match = *src_value == *dst_value;
    if (!match && verify_ == Verify::kDeferred) {  // device -> host: the comparison ran on the host
      latch_host_error(device_code(src_), device_code(dst_), num_bytes_, *src_value, *dst_value);
      return true;
    }
    return match;
  }

 private:
  // In graph capture, the capturing (origin) stream must rejoin what was forked from it.
  void join() {
    if (!peer_) return;
    if (sa_capturing_) order(*sb_, *sa_);
    else if (sb_capturing_) order(*sa_, *sb_);
  }

  // Where the destination hash goes: the thread's mapped host words, else hashes_[1] on the destination GPU.
  uint64_t* dst_out() { return on_host_ ? &host_->dst : u64_of(hashes_) + 1; }

  // PXH64 of the source on its device, on Sa before the copy, or (beside_) on a side stream Ha that
  // forks from Sa at `fork` (an event recorded on Sa before the copy was queued; null: now). Sets hs_.
  void hash_src(const at::Tensor& src, cudaEvent_t fork) {
    hs_ = *sa_;
    if (beside_) {
      hs_ = c10::cuda::getStreamFromPool(false, src_.index());
      if (fork != nullptr) wait(*hs_, fork);
      else order(*sa_, *hs_);
      keep_alive_on(src, *hs_);
    }
    if (on_host_) {
      hash_on(*hs_, src, &host_->src);
      return;
    }
    const c10::cuda::CUDAStreamGuard on(*hs_);
    src_hash_ = at::empty({}, src.options().dtype(at::kLong));  // copied next to the destination hash by copy()
    hash_on(*hs_, src, u64_of(src_hash_));
  }

  // Direct GPU -> GPU, on Sb in chunks: for a peer pair the destination's copy engine pulls the bytes,
  // so the chunk hashes, the final hash and the host's wait all order against the destination device
  // and the critical path crosses devices once (Sb waits for the source on Sa). The source hash is
  // queued on Sa before the copy (small) or beside it on a side stream once the copy is queued.
  // A large hashed peer copy is pipelined: every chunk is queued first, each but the last followed by
  // an event (the copy engine never waits for the host queuing hashes); then Hb (device B) hashes
  // chunk k once its event fired, while chunk k+1 moves, and Sb hashes the last chunk after them, its
  // last block finalizing the whole destination hash. Returns whether the destination was hashed.
  bool copy_device_to_device(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
    if (peer_) enable_peer_access(src_.index(), dst_.index());
    uint8_t* d = bytes_of(dst);
    const uint8_t* s = bytes_of(src);
    const int64_t n = plan.num_bytes;
    const bool hash = verify_ != Verify::kNone;
    const bool fused = hash && peer_ && n <= pipeline_schedule().fused_max &&
                       reinterpret_cast<uintptr_t>(d) % 16 == 0 && reinterpret_cast<uintptr_t>(s) % 16 == 0;
    const bool pipelined = hash && peer_ && !fused && n >= kOverlapBytes;
    if (hash && !beside_) hash_src(src, nullptr);
    // NOTE: Sa's device event is not recorded again before hash_src waits on it
    const cudaEvent_t source_ready = record(*sa_);
    if (*sb_ != *sa_) wait(*sb_, source_ready);
    src_hash_in_sb_ = hash && !beside_;
    const c10::cuda::CUDAGuard guard(dst_);
    const cudaStream_t sb = sb_->stream();
    at::Tensor acc;  // [0] the running sum of the destination's hash terms, [1] finished blocks of its last kernel
    if (fused || pipelined) {
      const c10::cuda::CUDAStreamGuard on(*sb_);
      acc = at::empty({2}, dst.options().dtype(at::kLong));
    }
    if (fused) {
      C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, acc.nbytes(), sb));
      const CopyFault fault{uint64_t(plan.src_offset), uint64_t(plan.dst_offset), uint64_t(plan.length),
                            plan.zero_fill, plan.flip_byte, plan.flip_mask};
      C10_CUDA_CHECK(launch_copy_pxh64(d, s, uint64_t(n), fault, u64_of(acc), reinterpret_cast<uint32_t*>(u64_of(acc) + 1),
                                       dst_out(), sb));
      if (beside_) hash_src(src, source_ready);
      return true;
    }
    std::vector<std::pair<int64_t, int64_t>> landed;  // [begin, end) of the chunks before the last
    int64_t last_begin = 0;
    const auto next_end = [&](int64_t begin) { return pipelined ? next_pipeline_end(begin, n) : n; };
    for_each_range(plan, next_end, [&](const PlanChunk& c) {
      if (c.zero_fill) C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), sb));
      if (c.copy_length > 0) {  // UVA + peer access: the copy engine moves it directly (capturable)
        C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length),
                                       cudaMemcpyDeviceToDevice, sb));
      }
      if (c.flip_byte >= 0) C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, sb));
      if (pipelined && c.end < n) {
        C10_CUDA_CHECK(cudaEventRecord(device_event(dst_.index(), landed.size() + 1), sb));
        landed.emplace_back(c.begin, c.end);
      }
      last_begin = c.begin;
    });
    if (pipelined) {
      uint64_t* sum = u64_of(acc);
      if (landed.empty()) {  // one chunk
        C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, acc.nbytes(), sb));
      } else {
        const CUDAStream hb = c10::cuda::getStreamFromPool(false, dst_.index());
        for (size_t k = 0; k < landed.size(); ++k) {
          C10_CUDA_CHECK(cudaStreamWaitEvent(hb.stream(), device_event(dst_.index(), k + 1), 0));
          if (k == 0) C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, acc.nbytes(), hb.stream()));
          const auto [begin, end] = landed[k];
          C10_CUDA_CHECK(launch_pxh64(d + begin, uint64_t(end - begin), uint64_t(begin / 8), 0, sum, nullptr, nullptr,
                                      0, hb.stream()));
        }
        wait(*sb_, record(hb));  // NOTE: also keeps dst and acc alive for Hb's reads (later Sb work comes after)
      }
      C10_CUDA_CHECK(launch_pxh64(d + last_begin, uint64_t(n - last_begin), uint64_t(last_begin / 8), 0, sum,
                                  reinterpret_cast<uint32_t*>(sum + 1), dst_out(), uint64_t(n), sb));
    }
    if (beside_) hash_src(src, source_ready);  // after the destination's work: the copy needs that first
    return pipelined;
  }

  // Direct host <-> device: torch's copy (cudaMemcpyAsync on the device's current stream; it keeps
  // pinned sources alive and waits where the host memory is pageable). Faults act on the device side.
  void copy_host_device(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
    const at::Device gpu = dst_.is_cuda() ? dst_ : src_;
    const c10::cuda::CUDAGuard guard(gpu);
    const at::Tensor d = dst.reshape({-1}).view(at::kByte), s = src.reshape({-1}).view(at::kByte);
    if (plan.zero_fill) {
      d.zero_();
    } else if (plan.length > 0) {
      d.narrow(0, plan.dst_offset, plan.length).copy_(s.narrow(0, plan.src_offset, plan.length),
                                                      /*non_blocking=*/dst_.is_cuda());
    }
    if (plan.flip_byte >= 0) {
      at::Tensor b = d.narrow(0, plan.flip_byte, 1);
      b.bitwise_xor_(plan.flip_mask);
    }
  }

  // Staged: each chunk goes source -> pinned slot -> destination. Device legs run on side streams
  // (Ca on the source GPU, Cb on the destination GPU) so the D2H of chunk k+1 overlaps the H2D of
  // chunk k; host legs are memcpy after waiting for the slot.
  void copy_staged(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
    StagingPool& pool = staging_pool();
    c10::optional<CUDAStream> ca, cb;
    if (src_.is_cuda()) {
      ca = c10::cuda::getStreamFromPool(false, src_.index());
      order(*sa_, *ca);
      keep_alive_on(src, *ca);
    }
    if (dst_.is_cuda()) {
      cb = c10::cuda::getStreamFromPool(false, dst_.index());
      order(*sb_, *cb);
      keep_alive_on(dst, *cb);
    }
    uint8_t* d = bytes_of(dst);
    const uint8_t* s = bytes_of(src);
    for_each_chunk(plan, pool.chunk_bytes(), [&](const PlanChunk& c) {
      if (c.zero_fill) {
        if (cb) {
          const c10::cuda::CUDAGuard guard(dst_);
          C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), cb->stream()));
        } else {
          std::memset(d + c.begin, 0, size_t(c.end - c.begin));
        }
      }
      if (c.copy_length > 0) stage_chunk(pool, d + c.copy_dst, s + c.copy_src, c.copy_length, ca, cb);
      if (c.flip_byte >= 0) {
        if (cb) {
          const c10::cuda::CUDAGuard guard(dst_);
          C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, cb->stream()));
        } else {
          d[c.flip_byte] ^= plan.flip_mask;
        }
      }
    });
    if (ca) order(*ca, *sa_);  // later work on the source's stream runs after our reads
    if (cb) order(*cb, *sb_);  // the result is ready for the destination's stream
  }

  void stage_chunk(StagingPool& pool, uint8_t* d, const uint8_t* s, int64_t length,
                   const c10::optional<CUDAStream>& ca, const c10::optional<CUDAStream>& cb) {
    while (length > 0) {
      StagingPool::Slot slot = pool.acquire();
      const int64_t n = std::min(length, slot.capacity);
      cudaEvent_t landed = nullptr, read = nullptr;
      try {
        if (ca) {  // source leg on the source GPU: D2H into the slot
          const c10::cuda::CUDAGuard guard(src_);
          if (slot.prior_reader) C10_CUDA_CHECK(cudaStreamWaitEvent(ca->stream(), slot.prior_reader, 0));
          C10_CUDA_CHECK(cudaMemcpyAsync(slot.ptr, s, size_t(n), cudaMemcpyDeviceToHost, ca->stream()));
          C10_CUDA_CHECK(cudaEventCreateWithFlags(&landed, cudaEventDisableTiming));
          C10_CUDA_CHECK(cudaEventRecord(landed, ca->stream()));
        } else {  // the host writes the slot: wait for its last reader first
          if (slot.prior_reader) C10_CUDA_CHECK(cudaEventSynchronize(slot.prior_reader));
          std::memcpy(slot.ptr, s, size_t(n));
        }
        if (cb) {  // destination leg on the destination GPU: H2D out of the slot
          const c10::cuda::CUDAGuard guard(dst_);
          if (landed) C10_CUDA_CHECK(cudaStreamWaitEvent(cb->stream(), landed, 0));
          C10_CUDA_CHECK(cudaMemcpyAsync(d, slot.ptr, size_t(n), cudaMemcpyHostToDevice, cb->stream()));
          C10_CUDA_CHECK(cudaEventCreateWithFlags(&read, cudaEventDisableTiming));
          C10_CUDA_CHECK(cudaEventRecord(read, cb->stream()));
        } else {
          C10_CUDA_CHECK(cudaEventSynchronize(landed));
          std::memcpy(d, slot.ptr, size_t(n));
        }
      } catch (...) {
        pool.release(slot.index, nullptr);
        throw;
      }
      if (slot.prior_reader) C10_CUDA_CHECK(cudaEventDestroy(slot.prior_reader));
      if (landed) C10_CUDA_CHECK(cudaEventDestroy(landed));
      pool.release(slot.index, read);
      d += n;
      s += n;
      length -= n;
    }
  }

  at::Device src_, dst_;
  bool peer_ = false, sa_capturing_ = false, sb_capturing_ = false;
  c10::optional<CUDAStream> sa_, sb_, hs_;  // hs_: the stream that hashed the source (Sa or a side stream)
  Verify verify_ = Verify::kNone;
  bool on_host_ = false, host_pending_ = false, beside_ = false;
  bool src_hash_in_sb_ = false;  // the source hash was queued on Sa before Sb waited for Sa
  HostHashes* host_ = nullptr;  // sync results (on_host_)
  at::Tensor hashes_;           // deferred results on the destination GPU: [src hash (a copy), dst hash]
  at::Tensor src_hash_;         // deferred: the source hash on the source GPU
  uint64_t src_value_ = 0, dst_value_ = 0;  // hashes of CPU ends
  int64_t num_bytes_ = 0;
};

std::unique_ptr<TransferPath> make_cuda_path(const char* op, const at::Tensor& src, at::Device dst) {
  const int64_t count = c10::cuda::device_count();
  auto resolve = [&](const char* arg, const at::Device& d) {
    if (!d.is_cuda()) return d;
    const int64_t index = d.has_index() ? d.index() : c10::cuda::current_device();
    TORCH_CHECK(index >= 0 && index < count, op, ": ", arg, " is cuda:", index, ", which does not exist (", count,
                " CUDA devices visible)");
    return at::Device(at::kCUDA, c10::DeviceIndex(index));
  };
  return std::make_unique<CudaPath>(resolve("src.device", src.device()), resolve("device", dst));
}

// Any pair with a CUDA end (the CPU <-> CPU pair is csrc/cpu/transfer_cpu.cpp's).
bool serves(at::DeviceType src, at::DeviceType dst) { return src == at::kCUDA || dst == at::kCUDA; }

const bool registered = register_path_family({&serves, &make_cuda_path, &take_cuda_errors});

}  // namespace
}  // namespace pyxfer
