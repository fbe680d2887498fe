// Verified copies with both ends on GPUs, direct route (declared in cuda/transfer_device.h).
//
// GPU-local (one device, one stream S): copy_verify_local_kernel copies and hashes both ends in one
// pass (one read and one write of HBM, the destination hashed as read back from L2). Sync: prefill
// the thread's words, one launch, the host polls the tokens. Deferred: the launch, then the check
// kernel on S. NOTE: one device, so no peer mapping is involved in reading back the destination.
//
// GPU A -> GPU B (peer access both ways; Sa / Sb the streams of A / B):
//   n <= kSerialPeerBytes  K1, the source hash on Sa; Sb waits for Sa; K2 on Sb pulls, stores, reads
//                          back and hashes: two kernels, one cross-device wait
//   n <= fused max         Sb waits for Sa's earlier work; K1 on Sa beside K2 on Sb; Sb waits for K1
//   larger                 Sb waits for Sa's earlier work; the copy engine on Sb in chunks (each 1/shrink
//                          of the one before); the source hash on a side stream of A and the chunk
//                          hashes (as chunks land) on a side stream of B, both with throttled grids
//                          (the schedule from the pair's rates, measured once); the last chunk's hash
//                          with a full grid; Sb joins both
// then sync: one event on Sb and one host wait (polling the published tokens up to kSpinWaitBytes);
// deferred: the check kernel on Sb, then Sa waits for Sb (later writes of the source come after the
// copy read it). Sa ends up ordered after the copy's reads either way.
// NOTE: the source hash reaches the checker through mapped host memory written by A, never through
// the peer link whose copy it checks; the destination hash is computed on B from B's memory.
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/transfer_device.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/deferred_latch.h"
#include "cuda/graph_lifetime.h"
#include "cuda/peer_access.h"
#include "cuda/stream_order.h"
#include "cuda/verify_workspace.h"
#include "pyxfer/launch.h"
#include "pyxfer/peer_schedule.h"
#include "transfer/faults.h"
#include "transfer/health.h"
#include "transfer/peer_plan.h"

namespace pyxfer {
namespace {

using c10::cuda::CUDAStream;

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

CopyFault fault_of(const CopyPlan& plan) {
  return {uint64_t(plan.src_offset), uint64_t(plan.dst_offset), uint64_t(plan.length), plan.zero_fill,
          plan.flip_byte, plan.flip_mask};
}

bool is_identity(const CopyPlan& plan) {
  return !plan.zero_fill && plan.flip_byte < 0 && plan.src_offset == 0 && plan.dst_offset == 0 &&
         plan.length == plan.num_bytes && plan.ensure_byte < 0;
}

// The plan's "always wrong" byte, for the kernel that finalizes the destination hash.
EnsureWrong ensure_of(const CopyPlan& plan, uint8_t* dst, const VerifyWords* words, uint64_t src_canary) {
  EnsureWrong e;
  if (plan.ensure_byte < 0) return e;
  const int64_t r = plan.ensure_byte / 8;
  e.word = dst + 8 * r;
  e.word_index = uint64_t(r);
  e.word_bytes = uint32_t(std::min<int64_t>(8, plan.num_bytes - 8 * r));
  e.byte_in_word = uint32_t(plan.ensure_byte % 8);
  e.src_word = &words->src;
  e.src_canary = src_canary;
  return e;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// The event a sync copy's host waits for, per device and thread (stream_order's events are
// re-recorded by every ordering). Destroyed with the thread; errors ignored then.
cudaEvent_t done_event(c10::DeviceIndex device) {
  struct Events {
    std::vector<cudaEvent_t> by_device;
    ~Events() {
      for (cudaEvent_t e : by_device)
        if (e != nullptr && cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
    }
  };
  thread_local Events events;
  if (size_t(device) >= events.by_device.size()) events.by_device.resize(size_t(device) + 1, nullptr);
  cudaEvent_t& e = events.by_device[size_t(device)];
  if (e == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  return e;
}

// ---- the rates of a pair and its copy-engine schedule ---------------------------------------------

struct PairRates {
  double link_gbps, hash_gbps;
};

std::mutex rates_mutex;
std::map<std::pair<int, int>, PairRates>& measured_rates() {
  static auto* rates = new std::map<std::pair<int, int>, PairRates>();  // NOTE: leaked, like every cache here
  return *rates;
}

constexpr int64_t kProbeBytes = int64_t(32) << 20;

// Times, on Sb (after it waited for the source), the copy engine pulling a prefix of the copy into
// dst and a full-grid hash of that prefix on the destination: a warm-up and a timed run of each, then a
// host wait. Once per ordered pair and process; dst is overwritten by the copy that follows.
PairRates probe_rates(uint8_t* d, const uint8_t* s, int64_t num_bytes, const CUDAStream& sb, HashScratch* scratch) {
  const int64_t bytes = std::min(num_bytes, kProbeBytes) / 16 * 16;
  struct Events {
    cudaEvent_t e[4] = {};
    ~Events() {
      for (cudaEvent_t x : e)
        if (x != nullptr && cudaEventDestroy(x) != cudaSuccess) (void)cudaGetLastError();
    }
  } ev;
  const c10::cuda::CUDAGuard guard(sb.device_index());
  const cudaStream_t st = sb.stream();
  for (cudaEvent_t& e : ev.e) C10_CUDA_CHECK(cudaEventCreate(&e));
  const EnsureWrong none;
  for (int run = 0; run < 2; ++run) {  // the first run warms up
    C10_CUDA_CHECK(cudaEventRecord(ev.e[0], st));
    C10_CUDA_CHECK(cudaMemcpyAsync(d, s, size_t(bytes), cudaMemcpyDeviceToDevice, st));
    C10_CUDA_CHECK(cudaEventRecord(ev.e[1], st));
    C10_CUDA_CHECK(launch_hash_verify(d, uint64_t(bytes), 0, 0, scratch, nullptr, nullptr, 0, uint64_t(bytes), none, st));
    C10_CUDA_CHECK(cudaEventRecord(ev.e[2], st));
  }
  C10_CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(HashScratch), st));  // the partial sums added above
  C10_CUDA_CHECK(cudaEventSynchronize(ev.e[2]));
  float copy_ms = 0, hash_ms = 0;
  C10_CUDA_CHECK(cudaEventElapsedTime(&copy_ms, ev.e[0], ev.e[1]));
  C10_CUDA_CHECK(cudaEventElapsedTime(&hash_ms, ev.e[1], ev.e[2]));
  if (copy_ms <= 0 || hash_ms <= 0) return {kDefaultLinkGBps, kDefaultHashGBps};
  return {double(bytes) / (double(copy_ms) * 1e6), double(bytes) / (double(hash_ms) * 1e6)};
}

// The pair's schedule: rates from PYXFER_PEER_RATES, else measured once (by `probe`, when allowed),
// else the defaults; then the knobs' overrides. Runs with the destination current (its wave).
template <typename Probe>
PeerSchedule pair_schedule(int a, int b, bool may_probe, const Probe& probe) {
  const PeerKnobs& knobs = peer_knobs();
  PairRates rates{kDefaultLinkGBps, kDefaultHashGBps};
  if (knobs.link_gbps > 0) {
    rates = {knobs.link_gbps, knobs.hash_gbps};
  } else {
    bool known = false;
    {
      std::lock_guard<std::mutex> lock(rates_mutex);
      auto it = measured_rates().find({a, b});
      if (it != measured_rates().end()) {
        rates = it->second;
        known = true;
      }
    }
    if (!known && may_probe) {
      rates = probe();
      std::lock_guard<std::mutex> lock(rates_mutex);
      measured_rates()[{a, b}] = rates;
    }
  }
  return tuned_schedule(rates.link_gbps, rates.hash_gbps, int64_t(hash_wave_blocks()));
}

}  // namespace

// ---- DeviceCopy -----------------------------------------------------------------------------------

DeviceCopy::DeviceCopy(const DeviceEnds& ends, Verify verify, SideStreams* side)
    : ends_(ends), verify_(verify), side_(side), peer_(ends.src != ends.dst) {}

DeviceCopy::~DeviceCopy() {
  if (sync_pending_) abandon_thread_sync_words();  // an error came between the launches and the wait
}

bool DeviceCopy::needs_side_streams(bool peer, int64_t num_bytes, Verify verify) {
  return peer && verify != Verify::kNone && num_bytes > peer_knobs().fused_max;
}

HashScratch* DeviceCopy::scratch_for(c10::DeviceIndex device, const CUDAStream& s) {
  if (!ends_.capture_origin) return stream_scratch(device, s.stream());
  graph_owned_.push_back(graph_scratch(device));
  return reinterpret_cast<HashScratch*>(graph_owned_.back().data_ptr());
}

void DeviceCopy::copy(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
  num_bytes_ = plan.num_bytes;
  if (peer_) enable_peer_access(ends_.src, ends_.dst);
  uint8_t* d = bytes_of(dst);
  const uint8_t* s = bytes_of(src);
  if (verify_ == Verify::kNone || num_bytes_ == 0) {  // no bytes: both hashes are PXH64 of nothing
    plain_copy(d, s, plan);
    return;
  }
  src_canary_ = ready_device(ends_.src);
  dst_canary_ = ready_device(ends_.dst);
  seq_ = next_copy_seq();
  if (ends_.capture_origin) {
    graph_owned_.push_back(graph_words(&words_));
  } else if (verify_ == Verify::kSync) {
    words_ = thread_sync_words();
    verify::prefill(words_);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // visible before any launch that overwrites them
    sync_pending_ = true;
  } else {
    words_ = thread_deferred_words(ends_.src, ends_.sa.stream(), ends_.dst, ends_.sb.stream());
  }
  skip_ = take_skip_kernel(ends_.src, ends_.dst);
  if (!peer_) copy_local(d, s, plan);
  else if (num_bytes_ <= peer_knobs().fused_max) copy_pull(d, s, plan);
  else copy_pipelined(d, src, plan);
  finish();
  if (ends_.capture_origin && !graph_owned_.empty()) {
    keep_until_graph_destroyed(*ends_.capture_origin, std::move(graph_owned_), {});
    graph_owned_.clear();
  }
}

// Unverified (or empty): the plan on Sb after Sa's earlier work, by the copy engine.
void DeviceCopy::plain_copy(uint8_t* d, const uint8_t* s, const CopyPlan& plan) {
  if (ends_.sb != ends_.sa) wait(ends_.sb, record(ends_.sa));
  const c10::cuda::CUDAGuard guard(ends_.dst);
  const cudaStream_t sb = ends_.sb.stream();
  for_each_range(plan, [&](int64_t) { return plan.num_bytes; }, [&](const PlanChunk& c) {
    if (c.zero_fill) C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), sb));
    if (c.copy_length > 0) {  // UVA + peer access: the copy engine moves it directly (capturable)
      C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length),
                                     cudaMemcpyDeviceToDevice, sb));
    }
    if (c.flip_byte >= 0) C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, sb));
  });
  if (ends_.sb != ends_.sa) order(ends_.sb, ends_.sa);  // later work on Sa (writes to src) after the copy read it
}

void DeviceCopy::copy_local(uint8_t* d, const uint8_t* s, const CopyPlan& plan) {
  const c10::cuda::CUDAGuard guard(ends_.dst);
  HashScratch* scratch = scratch_for(ends_.dst, ends_.sb);
  if (skip_) return;  // pyxfer.testing: the kernel that publishes both hashes does not run
  C10_CUDA_CHECK(launch_copy_verify_local(d, s, uint64_t(num_bytes_), fault_of(plan),
                                          ensure_of(plan, d, words_, src_canary_), scratch, words_, seq_,
                                          ends_.sb.stream()));
}

void DeviceCopy::copy_pull(uint8_t* d, const uint8_t* s, const CopyPlan& plan) {
  const uint64_t n = uint64_t(num_bytes_);
  // Under a fault that must write wrong bytes, K2's last block compares with K1's hash: K1 first.
  const bool serial = num_bytes_ <= kSerialPeerBytes || plan.ensure_byte >= 0;
  HashScratch* scratch_a = n > kSmallHashBytes ? scratch_for(ends_.src, ends_.sa) : nullptr;
  HashScratch* scratch_b = scratch_for(ends_.dst, ends_.sb);
  const auto hash_source = [&] {
    const c10::cuda::CUDAGuard guard(ends_.src);
    C10_CUDA_CHECK(launch_hash_verify(s, n, 0, 0, scratch_a, &words_->src, &words_->src_token, seq_, n, EnsureWrong(),
                                      ends_.sa.stream()));
  };
  if (serial) hash_source();
  wait(ends_.sb, record(ends_.sa));  // the source is ready (and hashed, when serial)
  if (!serial) hash_source();
  if (!skip_) {
    const c10::cuda::CUDAGuard guard(ends_.dst);
    C10_CUDA_CHECK(launch_pull_verify(d, s, n, fault_of(plan), ensure_of(plan, d, words_, src_canary_), scratch_b,
                                      words_, seq_, ends_.sb.stream()));
  }
  if (!serial) wait(ends_.sb, record(ends_.sa));  // the check (or the host's event) also after the source hash
}

void DeviceCopy::copy_pipelined(uint8_t* d, const at::Tensor& src, const CopyPlan& plan) {
  TORCH_CHECK(side_ != nullptr, "pyxfer: internal error: a pipelined peer copy without side streams");
  const uint8_t* s = bytes_of(src);
  const uint64_t n = uint64_t(num_bytes_);
  // Under a fault that must write wrong bytes, the last hash compares with the source hash: that
  // comes first, and the destination is hashed in one piece after the copy.
  const bool ensure = plan.ensure_byte >= 0;
  c10::optional<CUDAStream> ha;
  const cudaEvent_t source_ready = record(ends_.sa);
  wait(ends_.sb, source_ready);
  if (!ensure) {  // the source hash beside the copy, from the same point of Sa
    ha = side_->acquire(ends_.src);
    wait(*ha, source_ready);
    keep_alive_on(src, *ha);
  }
  const c10::cuda::CUDAGuard guard(ends_.dst);
  const cudaStream_t sb = ends_.sb.stream();
  // Measured on a copy of at least kProbeBytes, eagerly, without a fault (which would find the prefix right).
  const bool may_probe = !ends_.capture_origin && is_identity(plan) && num_bytes_ >= kProbeBytes;
  const PeerSchedule sched = pair_schedule(ends_.src, ends_.dst, may_probe, [&] {
    return probe_rates(d, s, num_bytes_, ends_.sb, scratch_for(ends_.dst, ends_.sb));
  });
  {
    const c10::cuda::CUDAGuard on_src(ends_.src);
    const CUDAStream& hs = ensure ? ends_.sa : *ha;
    C10_CUDA_CHECK(launch_hash_verify(s, n, 0, ensure ? 0 : uint64_t(sched.src_blocks), scratch_for(ends_.src, hs),
                                      &words_->src, &words_->src_token, seq_, n, EnsureWrong(), hs.stream()));
  }
  if (ensure) wait(ends_.sb, record(ends_.sa));
  std::vector<std::pair<int64_t, int64_t>> landed;  // [begin, end) of the chunks before the last
  int64_t last_begin = 0;
  const auto next_end = [&](int64_t begin) {
    return ensure ? num_bytes_ : next_chunk_end(begin, num_bytes_, sched.shrink, sched.min_chunk);
  };
  for_each_range(plan, next_end, [&](const PlanChunk& c) {
    if (c.zero_fill) C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), sb));
    if (c.copy_length > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length),
                                     cudaMemcpyDeviceToDevice, sb));
    }
    if (c.flip_byte >= 0) C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, sb));
    if (c.end < num_bytes_) {  // every chunk is queued first: the copy engine never waits for the host
      C10_CUDA_CHECK(cudaEventRecord(device_event(ends_.dst, landed.size() + 1), sb));
      landed.emplace_back(c.begin, c.end);
    }
    last_begin = c.begin;
  });
  if (!skip_) {  // Hb hashes chunk k once it landed, while k + 1 moves; the last one after the copy
    const CUDAStream hb = side_->acquire(ends_.dst);
    HashScratch* scratch = scratch_for(ends_.dst, hb);
    for (size_t k = 0; k < landed.size(); ++k) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(hb.stream(), device_event(ends_.dst, k + 1), 0));
      const auto [begin, end] = landed[k];
      C10_CUDA_CHECK(launch_hash_verify(d + begin, uint64_t(end - begin), uint64_t(begin / 8),
                                        uint64_t(sched.hash_blocks), scratch, nullptr, nullptr, 0, n, EnsureWrong(),
                                        hb.stream()));
    }
    wait(hb, record(ends_.sb));
    C10_CUDA_CHECK(launch_hash_verify(d + last_begin, n - uint64_t(last_begin), uint64_t(last_begin / 8), 0, scratch,
                                      &words_->dst, &words_->dst_token, seq_, n,
                                      ensure_of(plan, d, words_, src_canary_), hb.stream()));
    wait(ends_.sb, record(hb));  // NOTE: also keeps dst alive for Hb's reads (later Sb work comes after)
  }
  if (ha) wait(ends_.sb, record(*ha));  // the check (or the host's event) also after the source hash
}

void DeviceCopy::finish() {
  const c10::cuda::CUDAGuard guard(ends_.dst);
  if (verify_ == Verify::kSync) {
    done_ = done_event(ends_.dst);
    C10_CUDA_CHECK(cudaEventRecord(done_, ends_.sb.stream()));
    return;
  }
  C10_CUDA_CHECK(launch_check_verify(words_, seq_, src_canary_, dst_canary_,
                                     thread_latch(ends_.dst, ends_.capture_origin.has_value()), ends_.src, ends_.dst,
                                     num_bytes_, ends_.sb.stream()));
  if (peer_) order(ends_.sb, ends_.sa);  // later work on Sa (writes to src) after the copy read it
}

// The host's one wait. Small copies poll the tokens the kernels publish last (no event wake-up on the
// way back); the event on Sb ends the wait when they never come (a kernel that did not run), when the
// copy is large, or when the stream is busy for longer than a short spin.
void DeviceCopy::wait_for_words() {
  constexpr uint32_t kMaxSpins = uint32_t(1) << 16;  // ~ms of pauses: then the event's blocking wait
  if (num_bytes_ <= kSpinWaitBytes) {
    const volatile VerifyWords* w = words_;
    const uint64_t want_src = verify::run_token(seq_, src_canary_), want_dst = verify::run_token(seq_, dst_canary_);
    for (uint32_t i = 1; i < kMaxSpins; ++i) {
      if (w->src_token == want_src && w->dst_token == want_dst) {
        std::atomic_thread_fence(std::memory_order_acquire);  // the hashes were published before the tokens
        return;
      }
      if (i % 64 == 0) {
        const cudaError_t err = cudaEventQuery(done_);
        if (err == cudaSuccess) break;  // all ran and a token is missing: the judge says no
        if (err != cudaErrorNotReady) C10_CUDA_CHECK(err);
        (void)cudaGetLastError();
      }
      cpu_relax();
    }
  }
  C10_CUDA_CHECK(cudaEventSynchronize(done_));
}

bool DeviceCopy::compare(uint64_t* src_value, uint64_t* dst_value) {
  if (verify_ != Verify::kSync) return true;
  if (num_bytes_ == 0) {
    *src_value = *dst_value = pxh64::finalize(0, 0, 0);
    return true;
  }
  wait_for_words();
  sync_pending_ = false;
  const volatile VerifyWords* w = words_;
  const VerifyWords snapshot{w->src, w->dst, w->src_token, w->dst_token};
  const verify::Verdict v = verify::judge(snapshot, seq_, src_canary_, dst_canary_);
  *src_value = v.src_hash;
  *dst_value = v.dst_hash;
  return v.ok;
}

// ---- the fast first attempt -------------------------------------------------------------------------

bool device_fast_attempt(const at::Tensor& src, at::Device device, Route requested, Verify verify,
                         FastAttempt* out) {
  if (verify == Verify::kNone || requested == Route::kStaged || !src.is_cuda() || !device.is_cuda() ||
      !src.is_contiguous())
    return false;
  const c10::DeviceIndex a = src.device().index();
  const c10::DeviceIndex b = device.has_index() ? device.index() : c10::cuda::current_device();
  if (b < 0 || b >= c10::cuda::device_count()) return false;  // the general path names the error
  const int64_t n = int64_t(src.nbytes());
  const bool peer = a != b;
  if (DeviceCopy::needs_side_streams(peer, n, verify)) return false;
  if (peer && !(can_access_peer(a, b) && can_access_peer(b, a))) return false;
  if (requested == Route::kAuto && health_get(a, b) == kCorrupt) return false;
  const CUDAStream sa = c10::cuda::getCurrentCUDAStream(a);
  const CUDAStream sb = peer ? c10::cuda::getCurrentCUDAStream(b) : sa;
  if (is_capturing(sa) || (peer && is_capturing(sb))) return false;
  // The copy is this path's from here on: the result is allocated on Sb, the fault plan drawn.
  out->dst_device = at::Device(at::kCUDA, b);
  {
    const c10::cuda::CUDAStreamGuard on(sb);
    out->dst = at::empty(src.sizes(), at::TensorOptions().dtype(src.scalar_type()).device(out->dst_device));
  }
  const CopyPlan plan = plan_copy(a, b, Route::kDirect, n);
  DeviceCopy copy(DeviceEnds{a, b, sa, sb, c10::nullopt}, verify, nullptr);
  copy.copy(out->dst, src, plan);
  out->ok = copy.compare(&out->src_hash, &out->dst_hash);
  return true;
}

}  // namespace pyxfer
