// The CUDA mechanics of verified transfers (any end on a GPU); the protocol itself is in
// csrc/transfer/verified_copy.cpp, the legs through host memory (a CPU end, the staged route) in
// cuda/transfer_host.h, the reusable plumbing in cuda/stream_order.h, cuda/peer_access.h and
// cuda/staging_pool.h. Streams: Sa / Sb are the current streams of the source / destination
// device (the callers' streams, as Tensor.to uses them); pyxfer's own side streams
// (cuda/side_streams.h) hash the source beside the copy (Ha), hash destination chunks as they land
// (Hb) and run staged legs (Ca, Cb).
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
#include <utility>
#include <vector>

#include "checks.h"
#include "cpu/host_pool.h"
#include "cuda/deferred_latch.h"
#include "cuda/graph_lifetime.h"
#include "cuda/host_hashes.h"
#include "cuda/peer_access.h"
#include "cuda/pxh64_cuda.h"
#include "cuda/side_streams.h"
#include "cuda/stream_order.h"
#include "cuda/transfer_host.h"
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

// ---- one transfer with at least one CUDA end ------------------------------------------------------

class CudaPath final : public TransferPath {
 public:
  CudaPath(const at::Device& src, const at::Device& dst) : src_(src), dst_(dst) {
    if (src_.is_cuda()) sa_ = c10::cuda::getCurrentCUDAStream(src_.index());
    if (dst_.is_cuda()) sb_ = c10::cuda::getCurrentCUDAStream(dst_.index());
    peer_ = src_.is_cuda() && dst_.is_cuda() && src_.index() != dst_.index();
    sa_capturing_ = sa_ && is_capturing(*sa_);
    sb_capturing_ = sb_ && is_capturing(*sb_);
    // In graph capture the other device's work goes on a side stream that joins the capture (its
    // current stream may be the legacy default stream, which cannot be captured).
    if (peer_ && sa_capturing_ && !sb_capturing_) sb_ = side_.acquire(dst_.index());
    if (peer_ && sb_capturing_ && !sa_capturing_) sa_ = side_.acquire(src_.index());
  }

  ~CudaPath() override {
    if (host_pending_) abandon_thread_host_hashes();  // an error came between the launches and the wait
    // NOTE: a pair_ still held here met an error after its kernels may have been queued: not reused.
  }

  at::Device dst_device() const override { return dst_; }
  // Both ways: a peer copy is pulled by the destination (it reads the source's memory) and the
  // copy engine's pair is enabled both ways.
  bool direct_supported() const override {
    return !peer_ || (can_access_peer(src_.index(), dst_.index()) && can_access_peer(dst_.index(), src_.index()));
  }
  bool capturing() const override { return sa_capturing_ || sb_capturing_; }

  void check_capturable(const char* op, const at::Tensor& src, Verify verify) const override {
    if (!capturing()) return;
    TORCH_CHECK(dst_.is_cuda(), op, ": a CPU destination cannot be captured in a CUDA graph (the result would be a "
                "new host tensor, made once at capture); copy into a GPU tensor in the graph and move it to the host "
                "after the replay");
    if (src_.is_cpu()) {
      TORCH_CHECK(verify != Verify::kDeferred, op, ": verify='deferred' with a CPU source cannot be captured in a CUDA "
                  "graph (the source is hashed on the host, once, at capture: every replay with new data would latch "
                  "a false mismatch); use verify='none' in the graph, or copy outside it");
      TORCH_CHECK(src.is_contiguous() && src.is_pinned(), op, ": a ", src.is_contiguous() ? "pageable" : "non-contiguous",
                  " source on cpu cannot be captured in a CUDA graph (it would be staged or made contiguous once, at "
                  "capture); make it a contiguous pinned tensor before the capture");
    } else {
      TORCH_CHECK(src.is_contiguous() || sa_capturing_, op, ": a non-contiguous source on ", src_, " cannot be "
                  "captured in a CUDA graph while only ", dst_, " captures (its contiguous copy would be made once, at "
                  "capture, and freed); make it contiguous before the capture");
    }
  }

  at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype, Verify verify, bool pin_memory) override {
    verify_ = verify;
    pin_memory_ = pin_memory;
    // Sync results (and any comparison with a CPU destination) land in the thread's mapped host words;
    // deferred ones are compared on the destination GPU by the latch kernel: the destination hash in
    // its memory (in capture: the graph's pool), the source hash of a GPU source in mapped host
    // memory, written there by the source GPU (never over the peer link whose copy it checks).
    on_host_ = verify == Verify::kSync || (verify == Verify::kDeferred && !dst_.is_cuda());
    if (on_host_) {
      host_ = thread_host_hashes();
      host_pending_ = true;
    }
    const auto options = at::TensorOptions().dtype(dtype).device(dst_);
    // A CPU result: pinned from torch's caching host allocator, as t.to("cpu", non_blocking=True) makes it
    // (the GPU writes it directly), unless the caller asked for pageable memory.
    if (!dst_.is_cuda()) return at::empty(sizes, options.pinned_memory(pin_memory));
    if (sa_capturing_) order(*sa_, *sb_);        // fork: Sb joins the capture
    if (sb_capturing_ && sa_) order(*sb_, *sa_);  // fork: Sa joins the capture
    // Allocations belong to Sb (in capture: the graph's pool); every write of them is ordered after
    // Sb: the direct copy runs on Sb, staged legs and hashes on streams forked from it.
    const c10::cuda::CUDAStreamGuard on(*sb_);
    if (verify == Verify::kDeferred) {
      dst_hash_ = at::empty({1}, options.dtype(at::kLong));
      keep_for_graph(dst_hash_);
      if (src_.is_cuda()) pair_ = take_host_hashes();
    }
    at::Tensor dst = at::empty(sizes, options);
    if (!sb_capturing_) keep_for_graph(dst);  // replays write it: never handed to another tensor
    return dst;
  }

  void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) override {
    num_bytes_ = plan.num_bytes;
    if (!src_.is_cuda() || !dst_.is_cuda()) return copy_with_host_end(dst, src, route, plan);
    const bool hash = verify_ != Verify::kNone;
    beside_ = hash && src_.is_cuda() && plan.num_bytes >= kOverlapBytes;
    const bool device_to_device = route != Route::kStaged && src_.is_cuda() && dst_.is_cuda();
    bool dst_hashed = false;
    if (device_to_device) {
      dst_hashed = copy_device_to_device(dst, src, plan);  // also queues the source hash
    } else {
      if (hash) hash_src(src, nullptr);  // beside the copy (a side stream) or before it
      copy_staged(dst, src, plan);
    }
    if (plan.ensure_byte >= 0) {
      make_wrong(dst, src, plan);
      dst_hashed = false;  // the destination may have changed after the copy's own hash
    }
    if (hash && !dst_hashed) hash_on(*sb_, dst, dst_out());  // on Sb, after the data landed there
    if (hs_ && *hs_ != *sa_) order(*hs_, *sa_);  // later work on Sa (writes to src) runs after the hash read it
    if (hs_ && !on_host_) order(*hs_, *sb_);     // deferred: the latch kernel on Sb reads the source hash
    if (device_to_device && *sb_ != *sa_) order(*sb_, *sa_);  // later work on Sa (writes to src) after the copy read it
    if (verify_ == Verify::kNone) {
      join();
      hand_over_to_graph();
    }
  }

  bool compare(uint64_t* src_value, uint64_t* dst_value) override {
    if (!on_host_) {  // deferred with a CUDA destination: compare on Sb, latch a mismatch for this thread
      const c10::cuda::CUDAGuard guard(dst_);
      const uint64_t* src_ptr = src_.is_cuda() ? &pair_->src : nullptr;
      C10_CUDA_CHECK(launch_latch_mismatch(src_ptr, src_value_, u64_of(dst_hash_),
                                           thread_latch(dst_.index(), capturing()), device_code(src_),
                                           device_code(dst_), num_bytes_, sb_->stream()));
      if (pair_ != nullptr) {  // its last reader is the latch kernel
        if (capturing()) graph_pairs_.push_back(pair_);
        else give_host_hashes_after(pair_, *sb_);
        pair_ = nullptr;
      }
      join();
      hand_over_to_graph();
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

  // A copy captured across two GPUs: the graph's private pool exists on the capturing GPU only, so
  // what it allocates on the other GPU comes from that GPU's ordinary pool, and replays keep writing
  // it. Such tensors are kept until the graph is destroyed (hand_over_to_graph).
  void keep_for_graph(const at::Tensor& t) {
    if (peer_ && capturing() && t.defined()) graph_tensors_.push_back(t);
  }

  // Ties what this copy kept to the graph being captured (nothing outside capture).
  void hand_over_to_graph() {
    if (graph_tensors_.empty() && graph_pairs_.empty()) return;
    keep_until_graph_destroyed(sa_capturing_ ? *sa_ : *sb_, std::move(graph_tensors_), std::move(graph_pairs_));
    graph_tensors_.clear();
    graph_pairs_.clear();
  }

  // *out = PXH64(t) on `s` (t's device). Workspaces are allocated on `s` itself (stream-ordered
  // reuse; in capture across two GPUs, kept for the graph).
  void hash_on(const CUDAStream& s, const at::Tensor& t, uint64_t* out) {
    const c10::cuda::CUDAStreamGuard on(s);
    keep_for_graph(pxh64_into(t, 0, out));
  }

  // Where the destination hash goes: the thread's mapped host words, else dst_hash_ on the destination GPU.
  uint64_t* dst_out() { return on_host_ ? &host_->dst : u64_of(dst_hash_); }

  // PXH64 of the source on its device, on Sa before the copy, or (beside_) on a side stream Ha that
  // forks from Sa at `fork` (an event recorded on Sa before the copy was queued; null: now). Sets hs_.
  // The result goes to mapped host memory: the thread's words (sync) or the copy's pair (deferred).
  void hash_src(const at::Tensor& src, cudaEvent_t fork) {
    hs_ = *sa_;
    if (beside_) {
      hs_ = side_.acquire(src_.index());
      if (fork != nullptr) wait(*hs_, fork);
      else order(*sa_, *hs_);
      keep_alive_on(src, *hs_);
    }
    hash_on(*hs_, src, on_host_ ? &host_->src : &pair_->src);
  }

  // Fault injection always writes wrong bytes: where the faulty destination still equals the source,
  // flip one bit of it (plan.ensure_byte) -- decided from the two PXH64s, each computed on its own
  // device, so it holds on every route and in every replay of a captured copy.
  void make_wrong(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
    uint8_t* byte = bytes_of(dst) + plan.ensure_byte;
    HostHashes* words = take_host_hashes();
    if (!dst_.is_cuda()) {  // the copy into host memory has finished: compare on the host
      uint64_t src_value = 0;
      if (src_.is_cuda()) {
        hash_on(*sa_, src, &words->src);
        host_wait(*sa_);
        src_value = words->src;
      }
      give_host_hashes_now(words);
      if ((src_.is_cuda() ? src_value : cpu_hash(src)) == cpu_hash(dst)) *byte ^= 1;
      return;
    }
    const uint64_t* src_word = nullptr;
    uint64_t src_value = 0;
    if (src_.is_cuda()) {
      hash_on(*sa_, src, &words->src);
      order(*sa_, *sb_);
      src_word = &words->src;
    } else {
      src_value = cpu_hash(src);
    }
    hash_on(*sb_, dst, &words->dst);  // after the copy landed on Sb
    const c10::cuda::CUDAGuard guard(dst_);
    C10_CUDA_CHECK(launch_flip_if_equal(src_word, src_value, &words->dst, byte, sb_->stream()));
    if (capturing()) graph_pairs_.push_back(words);
    else give_host_hashes_after(words, *sb_);
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
      keep_for_graph(acc);
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
        const CUDAStream hb = side_.acquire(dst_.index());
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

  // A copy with a CPU end (the legs in cuda/transfer_host.cpp): what lands in host memory is hashed there
  // by the host hashing pool as it lands, a CPU source is hashed by the pool while the copy moves, a GPU
  // end is hashed on its GPU (a source beside the copy, a destination after the data landed).
  // NOTE: a CPU destination is compared on the host: deferred is as synchronous as sync there.
  void copy_with_host_end(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) {
    const bool hash = verify_ != Verify::kNone;
    bool dst_hashed = false;
    if (src_.is_cuda()) {  // GPU -> host
      beside_ = hash && plan.num_bytes >= kOverlapBytes;
      if (hash) hash_src(src, nullptr);
      if (route == Route::kStaged || !pin_memory_) {  // pageable memory: through the pinned slots
        const CUDAStream ca = side_.acquire(src_.index());
        order(*sa_, ca);
        keep_alive_on(src, ca);
        dst_value_ = copy_device_to_host_staged(dst, src, ca, plan, hash);
        order(ca, *sa_);  // later work on the source's stream runs after our reads
      } else {  // straight into the pinned result, chunk by chunk on Sa
        dst_value_ = copy_device_to_pinned(dst, src, *sa_, plan, hash);
      }
      dst_hashed = hash;
    } else {  // host -> GPU
      HostHashJob src_hash;  // NOTE: holds src's bytes' hash tasks: waited for before src can go
      if (hash) src_hash.start(bytes_of(src), plan.num_bytes);
      if (route == Route::kStaged) {
        const CUDAStream cb = side_.acquire(dst_.index());
        order(*sb_, cb);
        keep_alive_on(dst, cb);
        copy_host_to_device_staged(dst, src, cb, plan);
        order(cb, *sb_);  // the result is ready for the destination's stream
      } else {
        copy_host_to_device(dst, src, plan);
      }
      if (hash && plan.ensure_byte < 0) {  // queued before the host waits for the source hash
        hash_on(*sb_, dst, dst_out());
        dst_hashed = true;
      }
      if (hash) src_value_ = src_hash.finish();
    }
    if (plan.ensure_byte >= 0) {
      make_wrong(dst, src, plan);
      dst_hashed = false;  // the destination may have changed after its hash
    }
    if (hash && !dst_hashed) {
      if (dst_.is_cuda()) hash_on(*sb_, dst, dst_out());
      else dst_value_ = cpu_hash(dst);
    }
    if (hs_ && *hs_ != *sa_) order(*hs_, *sa_);  // later work on Sa (writes to src) runs after the hash read it
    if (verify_ == Verify::kNone) {
      join();
      hand_over_to_graph();
    }
  }

  // Staged GPU -> GPU: the D2H of each piece on Ca (the source GPU), its H2D on Cb (the destination GPU)
  // once it landed, so piece k+1 leaves while piece k arrives.
  void copy_staged(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
    const CUDAStream ca = side_.acquire(src_.index()), cb = side_.acquire(dst_.index());
    order(*sa_, ca);
    keep_alive_on(src, ca);
    order(*sb_, cb);
    keep_alive_on(dst, cb);
    copy_device_to_device_staged(dst, src, ca, cb, plan);
    order(ca, *sa_);  // later work on the source's stream runs after our reads
    order(cb, *sb_);  // the result is ready for the destination's stream
  }

  at::Device src_, dst_;
  bool peer_ = false, sa_capturing_ = false, sb_capturing_ = false;
  c10::optional<CUDAStream> sa_, sb_, hs_;  // hs_: the stream that hashed the source (Sa or a side stream)
  Verify verify_ = Verify::kNone;
  bool pin_memory_ = true;  // a CPU destination is pinned
  bool on_host_ = false, host_pending_ = false, beside_ = false;
  bool src_hash_in_sb_ = false;  // the source hash was queued on Sa before Sb waited for Sa
  HostHashes* host_ = nullptr;  // sync results (on_host_)
  HostHashes* pair_ = nullptr;  // deferred: ->src is the source hash, written by the source GPU
  at::Tensor dst_hash_;         // deferred: the destination hash on the destination GPU
  uint64_t src_value_ = 0, dst_value_ = 0;  // hashes of CPU ends
  int64_t num_bytes_ = 0;
  std::vector<at::Tensor> graph_tensors_;  // in capture across two GPUs: kept until the graph is destroyed
  std::vector<HostHashes*> graph_pairs_;   // in capture: read by every replay, back to the pool with the graph
  SideStreams side_;                       // pyxfer's own side streams this copy holds (given back with it)
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

const bool registered = register_path_family({&serves, &make_cuda_path, &take_thread_latches});

}  // namespace
}  // namespace pyxfer
