// The CUDA mechanics of verified transfers (any end on a GPU); the protocol itself is in
// csrc/transfer/verified_copy.cpp; direct copies with both ends on GPUs (and this family's fast first
// attempt) in cuda/transfer_device.h; the legs through host memory (a CPU end, the staged route) in
// cuda/transfer_host.h; the reusable plumbing in cuda/stream_order.h, cuda/peer_access.h and
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
#include <cstring>
#include <optional>
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
#include "cuda/transfer_device.h"
#include "cuda/transfer_host.h"
#include "pyxfer/launch.h"
#include "transfer/errors.h"
#include "transfer/transfer.h"

namespace pyxfer {
namespace {

using c10::cuda::CUDAStream;

constexpr int64_t kOverlapBytes = int64_t(4) << 20;  // from here on, hash beside the copy on side streams

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
    const auto options = at::TensorOptions().dtype(dtype).device(dst_);
    if (!dst_.is_cuda()) {
      prepare_compare();
      // A CPU result: pinned from torch's caching host allocator, as t.to("cpu", non_blocking=True) makes
      // it (the GPU writes it directly), unless the caller asked for pageable memory.
      return at::empty(sizes, options.pinned_memory(pin_memory));
    }
    if (sa_capturing_) order(*sa_, *sb_);        // fork: Sb joins the capture
    if (sb_capturing_ && sa_) order(*sb_, *sa_);  // fork: Sa joins the capture
    // GPU -> GPU: a direct copy's DeviceCopy brings its own words; a staged one prepares in copy().
    if (!src_.is_cuda()) prepare_compare();
    // Allocations belong to Sb (in capture: the graph's pool); every write of them is ordered after
    // Sb: the direct copy runs on Sb, staged legs and hashes on streams forked from it.
    const c10::cuda::CUDAStreamGuard on(*sb_);
    at::Tensor dst = at::empty(sizes, options);
    if (!sb_capturing_) keep_for_graph(dst);  // replays write it: never handed to another tensor
    return dst;
  }

  void copy(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan) override {
    num_bytes_ = plan.num_bytes;
    if (route != Route::kStaged && src_.is_cuda() && dst_.is_cuda()) {
      copy_device_to_device(dst, src, plan);
      return;
    }
    if (!src_.is_cuda() || !dst_.is_cuda()) return copy_with_host_end(dst, src, route, plan);
    prepare_compare();  // GPU -> GPU staged
    const bool hash = verify_ != Verify::kNone;
    beside_ = hash && plan.num_bytes >= kOverlapBytes;
    if (hash) hash_src(src, nullptr);  // beside the copy (a side stream) or before it
    copy_staged(dst, src, plan);
    if (plan.ensure_byte >= 0) make_wrong(dst, src, plan);
    if (hash) hash_on(*sb_, dst, dst_out());  // on Sb, after the data landed there
    if (hs_ && *hs_ != *sa_) order(*hs_, *sa_);  // later work on Sa (writes to src) runs after the hash read it
    if (hs_ && !on_host_) order(*hs_, *sb_);     // deferred: the latch kernel on Sb reads the source hash
    if (verify_ == Verify::kNone) {
      join();
      hand_over_to_graph();
    }
  }

  bool compare(uint64_t* src_value, uint64_t* dst_value) override {
    if (device_copy_) {  // GPU -> GPU direct: its one wait (sync) or nothing (its check is queued)
      const bool match = device_copy_->compare(src_value, dst_value);
      join();
      hand_over_to_graph();
      return match;
    }
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
    if (hs_) host_wait(*hs_);  // a CUDA source's hash
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

  // Direct GPU -> GPU (cuda/transfer_device.h). An unverified copy under a fault that must write
  // wrong bytes is made wrong here; a verified one's kernels see to it themselves.
  void copy_device_to_device(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
    c10::optional<CUDAStream> origin;
    if (sa_capturing_) origin = *sa_;
    else if (sb_capturing_) origin = *sb_;
    device_copy_.emplace(DeviceEnds{src_.index(), dst_.index(), *sa_, *sb_, origin}, verify_, &side_);
    device_copy_->copy(dst, src, plan);
    if (verify_ != Verify::kNone) return;  // compare() joins
    if (plan.ensure_byte >= 0) make_wrong(dst, src, plan);
    join();
    hand_over_to_graph();
  }

  // What compare() needs beside the destination, for every copy but a GPU -> GPU direct one (whose
  // DeviceCopy brings its own). Sync results (and any comparison with a CPU destination) land in the
  // thread's mapped host words; deferred ones are compared on the destination GPU by the latch kernel:
  // the destination hash in its memory (in capture: the graph's pool), the source hash of a GPU source
  // in mapped host memory, written there by the source GPU (never over the peer link whose copy it checks).
  void prepare_compare() {
    on_host_ = verify_ == Verify::kSync || (verify_ == Verify::kDeferred && !dst_.is_cuda());
    if (on_host_) {
      host_ = thread_host_hashes();
      host_pending_ = true;
    }
    if (verify_ != Verify::kDeferred || !dst_.is_cuda()) return;
    const c10::cuda::CUDAStreamGuard on(*sb_);
    dst_hash_ = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(dst_));
    keep_for_graph(dst_hash_);
    if (src_.is_cuda()) pair_ = take_host_hashes();
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
  HostHashes* host_ = nullptr;  // sync results (on_host_)
  HostHashes* pair_ = nullptr;  // deferred: ->src is the source hash, written by the source GPU
  at::Tensor dst_hash_;         // deferred: the destination hash on the destination GPU
  uint64_t src_value_ = 0, dst_value_ = 0;  // hashes of CPU ends
  int64_t num_bytes_ = 0;
  std::vector<at::Tensor> graph_tensors_;  // in capture across two GPUs: kept until the graph is destroyed
  std::vector<HostHashes*> graph_pairs_;   // in capture: read by every replay, back to the pool with the graph
  SideStreams side_;                       // pyxfer's own side streams this copy holds (given back with it)
  // GPU -> GPU direct. NOTE: declared after side_, so destroyed before it (it holds side_'s streams).
  std::optional<DeviceCopy> device_copy_;
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

const bool registered = register_path_family({&serves, &make_cuda_path, &take_thread_latches, &device_fast_attempt});

}  // namespace
}  // namespace pyxfer
