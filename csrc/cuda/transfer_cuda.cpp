// The CUDA mechanics of verified transfers (any end on a GPU); the protocol itself is in
// csrc/transfer/transfer.cpp. Streams: Sa / Sb are the current streams of the source / destination
// device (the callers' streams, as Tensor.to uses them); side streams from the pool hash the source
// beside the copy (Ha), hash destination chunks as they land (Hb) and run staged legs (Ca, Cb).
// Every side stream starts after an event from a current stream and ends joined back into one, so
// the result is ready on Sb, later work on Sa is ordered after the reads, and CUDA graph capture sees
// a proper fork/join.
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "checks.h"
#include "cuda/pxh64_cuda.h"
#include "pyxfer/launch.h"
#include "transfer/transfer.h"

namespace pyxfer {
namespace {

using c10::cuda::CUDAStream;

constexpr int64_t kOverlapBytes = int64_t(4) << 20;  // from here on, hash beside the copy on side streams
// Pipelined peer copies hash chunk k on the destination while chunk k+1 moves. Chunks are half of
// what is left (down to kMinChunkBytes): few chunks (each costs a gap in the copy engine's stream)
// and a small last chunk (the only hash not hidden behind the copy).
constexpr int64_t kMinChunkBytes = int64_t(8) << 20;

int64_t next_pipeline_end(int64_t begin, int64_t num_bytes) {
  const int64_t half = ((num_bytes - begin) / 2 + 7) / 8 * 8;
  return begin + std::max(kMinChunkBytes, half);
}

// NOTE: every raw call that takes a stream runs with that stream's device current: torch's default
// stream is the legacy stream (handle 0), which means "the current device's".
bool is_capturing(const CUDAStream& s) {
  const c10::cuda::CUDAGuard guard(s.device_index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(s.stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// One reusable event per device and thread: a wait captures the event's state when it is queued, so
// the event can be recorded again right away (no create/destroy per ordering).
cudaEvent_t ordering_event(c10::DeviceIndex device) {
  thread_local std::vector<cudaEvent_t> events;
  if (size_t(device) >= events.size()) events.resize(size_t(device) + 1, nullptr);
  if (events[device] == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&events[device], cudaEventDisableTiming));
  }
  return events[device];
}

// Work queued on `after` from now on runs after everything queued on `before` so far.
void order(const CUDAStream& before, const CUDAStream& after) {
  if (before == after) return;
  const cudaEvent_t event = ordering_event(before.device_index());
  {
    const c10::cuda::CUDAGuard guard(before.device_index());
    C10_CUDA_CHECK(cudaEventRecord(event, before.stream()));
  }
  const c10::cuda::CUDAGuard guard(after.device_index());
  C10_CUDA_CHECK(cudaStreamWaitEvent(after.stream(), event, 0));
}

// The caching allocator must not reuse `t`'s memory before work queued on `stream` finished.
void keep_alive_on(const at::Tensor& t, const CUDAStream& stream) {
  if (t.is_cuda() && t.storage().data_ptr().get() != nullptr)
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
uint64_t* u64_of(const at::Tensor& t) { return reinterpret_cast<uint64_t*>(t.data_ptr<int64_t>()); }

// ---- peer access ----------------------------------------------------------------------------------
std::mutex peer_mutex;
std::map<std::pair<int, int>, bool> peer_possible;  // cudaDeviceCanAccessPeer, asked once per pair
std::set<std::pair<int, int>> peer_enabled;

bool can_access_peer(int from, int to) {
  std::lock_guard<std::mutex> lock(peer_mutex);
  auto it = peer_possible.find({from, to});
  if (it != peer_possible.end()) return it->second;
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);  // may run in capture
  int can = 0;
  C10_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
  return peer_possible[{from, to}] = can != 0;
}

// Enable `from` to read and write `to`'s memory (explicitly: no silent staging by the driver).
void enable_peer_access(int from, int to) {
  std::lock_guard<std::mutex> lock(peer_mutex);
  if (!peer_enabled.insert({from, to}).second) return;
  const c10::cuda::CUDAGuard guard(from);
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);  // may run in capture
  const cudaError_t err = cudaDeviceEnablePeerAccess(to, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // torch may have enabled it already
    return;
  }
  C10_CUDA_CHECK(err);
}

// ---- the bounded pool of pinned staging buffers --------------------------------------------------
// num_slots buffers of chunk_bytes in one portable pinned allocation. A slot is held only while one
// copy enqueues its two legs; its reuse is ordered by the event of its last reader (stream waits, or a
// host wait where the next writer is the host), so the pool never grows with the tensor.
class StagingPool {
 public:
  struct Slot {
    uint8_t* ptr;
    int64_t capacity;
    int64_t index;
    cudaEvent_t prior_reader;  // the writer must wait for it (may be null); the taker destroys it
  };

  Slot acquire() {
    std::unique_lock<std::mutex> lock(mutex_);
    maybe_reallocate();
    const int64_t i = next_++ % int64_t(slots_.size());
    idle_.wait(lock, [&] { return !slots_[i].held; });
    slots_[i].held = true;
    cudaEvent_t prior = slots_[i].last_reader;
    slots_[i].last_reader = nullptr;
    ++num_held_;
    return {base_ + i * config_.chunk_bytes, config_.chunk_bytes, i, prior};
  }

  void release(int64_t index, cudaEvent_t last_reader) {
    std::lock_guard<std::mutex> lock(mutex_);
    slots_[index].held = false;
    slots_[index].last_reader = last_reader;
    --num_held_;
    idle_.notify_all();
  }

  int64_t chunk_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return config_.chunk_bytes != 0 ? config_.chunk_bytes : staging_config().chunk_bytes;
  }

 private:
  struct SlotState {
    bool held = false;
    cudaEvent_t last_reader = nullptr;
  };

  // (Re)allocate when the configuration changed and no copy holds a slot.
  void maybe_reallocate() {
    const StagingConfig want = staging_config();
    if (base_ != nullptr && (num_held_ > 0 || (want.chunk_bytes == config_.chunk_bytes &&
                                               want.num_slots == config_.num_slots)))
      return;
    for (SlotState& s : slots_) {
      if (s.last_reader != nullptr) {
        C10_CUDA_CHECK(cudaEventSynchronize(s.last_reader));
        C10_CUDA_CHECK(cudaEventDestroy(s.last_reader));
      }
    }
    if (base_ != nullptr) C10_CUDA_CHECK(cudaFreeHost(base_));
    // NOTE: allowed while a stream captures a graph (the allocation is not a stream operation).
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&p, size_t(want.chunk_bytes * want.num_slots), cudaHostAllocPortable));
    base_ = static_cast<uint8_t*>(p);
    config_ = want;
    slots_.assign(size_t(want.num_slots), SlotState{});
  }

  std::mutex mutex_;
  std::condition_variable idle_;
  uint8_t* base_ = nullptr;
  StagingConfig config_{0, 0};
  std::vector<SlotState> slots_;
  int64_t next_ = 0;
  int64_t num_held_ = 0;
};

StagingPool& staging_pool() {
  static StagingPool* pool = new StagingPool();  // NOTE: leaked on purpose: outlives CUDA teardown order
  return *pool;
}

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

  at::Device dst_device() const override { return dst_; }
  bool direct_supported() const override { return !peer_ || can_access_peer(src_.index(), dst_.index()); }
  bool capturing() const override { return sa_capturing_ || sb_capturing_; }

  at::Tensor make_dst(at::IntArrayRef sizes, at::ScalarType dtype) override {
    const auto options = at::TensorOptions().dtype(dtype).device(dst_);
    if (!dst_.is_cuda()) return at::empty(sizes, options);
    if (sa_capturing_) order(*sa_, *sb_);  // fork: Sb joins the capture
    const c10::cuda::CUDAStreamGuard on(*sb_);  // allocations belong to Sb (in capture: the graph's pool)
    at::Tensor dst = at::empty(sizes, options);
    // [0] source hash (moved here), [1] destination hash, [2..3] the destination hash's workspace
    hashes_ = at::empty({4}, options.dtype(at::kLong));
    C10_CUDA_CHECK(cudaMemsetAsync(hashes_.data_ptr(), 0, hashes_.nbytes(), sb_->stream()));
    if (peer_) order(*sb_, *sa_);  // Sa writes dst and hashes_ only after their allocation on Sb
    return dst;
  }

  at::Tensor hash_src(const at::Tensor& src, int64_t seed) override {
    if (!src_.is_cuda()) return checksum_op(src, seed);
    const c10::cuda::CUDAGuard guard(src_);
    const bool beside = int64_t(src.nbytes()) >= kOverlapBytes;  // hash beside the copy, not before it
    hash_stream_ = *sa_;
    if (beside) {
      hash_stream_ = c10::cuda::getStreamFromPool(false, src_.index());
      order(*sa_, *hash_stream_);
      keep_alive_on(src, *hash_stream_);
    }
    const c10::cuda::CUDAStreamGuard on(*hash_stream_);
    at::Tensor hash = at::empty({}, src.options().dtype(at::kLong));
    pxh64_into(src, seed, u64_of(hash));
    if (dst_.is_cuda()) {  // next to the destination hash, for one comparison there (Sb waits for it)
      C10_CUDA_CHECK(cudaMemcpyAsync(u64_of(hashes_), hash.data_ptr(), sizeof(int64_t), cudaMemcpyDeviceToDevice,
                                     hash_stream_->stream()));
    }
    return hash;
  }

  at::Tensor copy_and_hash(const at::Tensor& dst, const at::Tensor& src, Route route, const CopyPlan& plan,
                           bool hash, int64_t seed) override {
    num_bytes_ = plan.num_bytes;
    bool hashed = false;
    if (route == Route::kStaged) {
      copy_staged(dst, src, plan);
    } else if (src_.is_cuda() && dst_.is_cuda()) {
      hashed = copy_device_to_device(dst, src, plan, hash, seed);
    } else {
      copy_host_device(dst, src, plan);
    }
    at::Tensor dst_hash;
    if (hash && dst_.is_cuda()) {
      const c10::cuda::CUDAStreamGuard on(*sb_);
      if (!hashed) pxh64_into(dst, seed, u64_of(hashes_) + 1);  // on Sb, after the data landed there
      dst_hash = hashes_.select(0, 1);
    } else if (hash) {
      dst_hash = checksum_op(dst, seed);
    }
    if (hash_stream_ && dst_.is_cuda()) order(*hash_stream_, *sb_);  // the source hash arrived
    if (!hash) join();
    return dst_hash;
  }

  bool compare(const at::Tensor& src_hash, const at::Tensor& dst_hash, bool deferred, uint64_t* src_value,
               uint64_t* dst_value) override {
    if (deferred && dst_.is_cuda()) {
      const c10::cuda::CUDAGuard guard(dst_);
      const uint64_t* src_ptr = src_.is_cuda() ? u64_of(hashes_) : nullptr;
      const uint64_t src_val = src_.is_cuda() ? 0 : u64(src_hash.item<int64_t>());
      C10_CUDA_CHECK(launch_latch_mismatch(src_ptr, src_val, u64_of(hashes_) + 1, device_latch(dst_.index()),
                                           device_code(src_), device_code(dst_), num_bytes_, sb_->stream()));
      join();
      return true;
    }
    if (dst_.is_cuda()) {  // one read of both hashes, waiting for Sb only
      const c10::cuda::CUDAStreamGuard on(*sb_);
      const at::Tensor both = hashes_.narrow(0, 0, 2).cpu();
      *src_value = src_.is_cuda() ? u64(both.data_ptr<int64_t>()[0]) : u64(src_hash.item<int64_t>());
      *dst_value = u64(both.data_ptr<int64_t>()[1]);
    } else {
      const c10::cuda::CUDAStreamGuard on(*hash_stream_);
      *src_value = u64(src_hash.item<int64_t>());
      *dst_value = u64(dst_hash.item<int64_t>());
    }
    const bool match = *src_value == *dst_value;
    if (!match && deferred) {  // device -> host: the comparison ran on the host
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

  // Direct GPU -> GPU (peer copy engine, or a device-local copy), in chunks on Sa. For a large peer
  // copy with hashing, each chunk is hashed on Hb (device B) as soon as it landed, into hashes_[1];
  // returns whether it did.
  bool copy_device_to_device(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan, bool hash,
                             int64_t seed) {
    if (peer_) {
      enable_peer_access(src_.index(), dst_.index());
      enable_peer_access(dst_.index(), src_.index());
    }
    const bool pipelined = hash && peer_ && plan.num_bytes >= kOverlapBytes;
    c10::optional<CUDAStream> hb;
    if (pipelined) {
      hb = c10::cuda::getStreamFromPool(false, dst_.index());
      order(*sb_, *hb);  // after dst and hashes_ (zeroed) were made on Sb
      keep_alive_on(dst, *hb);
      keep_alive_on(hashes_, *hb);
    }
    const c10::cuda::CUDAGuard guard(src_);
    const cudaStream_t sa = sa_->stream();
    uint8_t* d = bytes_of(dst);
    const uint8_t* s = bytes_of(src);
    const int64_t n = plan.num_bytes;
    const auto next_end = [&](int64_t begin) { return pipelined ? next_pipeline_end(begin, n) : n; };
    for_each_range(plan, next_end, [&](const PlanChunk& c) {
      if (c.zero_fill) C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), sa));
      if (c.copy_length > 0) {  // UVA + peer access: the copy engine moves it directly (capturable)
        C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length),
                                       cudaMemcpyDeviceToDevice, sa));
      }
      if (c.flip_byte >= 0) C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, sa));
      if (pipelined) {
        order(*sa_, *hb);
        const c10::cuda::CUDAGuard on_b(dst_);
        C10_CUDA_CHECK(launch_pxh64(d + c.begin, uint64_t(c.end - c.begin), uint64_t(c.begin / 8), u64(seed),
                                    u64_of(hashes_) + 2, nullptr, nullptr, 0, hb->stream()));
      }
    });
    order(*sa_, *sb_);  // the copy landed, for Sb
    if (!pipelined) return false;
    const c10::cuda::CUDAGuard on_b(dst_);
    C10_CUDA_CHECK(launch_pxh64_combine(u64_of(hashes_) + 2, 1, uint64_t(plan.num_bytes), u64(seed),
                                        u64_of(hashes_) + 1, hb->stream()));
    order(*hb, *sb_);
    return true;
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
  c10::optional<CUDAStream> sa_, sb_, hash_stream_;
  at::Tensor hashes_;  // on the destination GPU: [src hash, dst hash, workspace x2]
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

const bool registered = (register_cuda_transfer(&make_cuda_path, &take_cuda_errors), true);

}  // namespace
}  // namespace pyxfer
