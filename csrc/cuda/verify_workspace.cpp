// Workspaces of verified GPU copies (declared and documented in cuda/verify_workspace.h).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/verify_workspace.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "pyxfer/verify_words.h"

namespace pyxfer {
namespace {

constexpr int kMaxDevices = 256;

std::mutex setup_mutex;  // guards what follows and every one-time set-up

// A private non-blocking stream per device for set-up work: never part of a capture and (unlike the
// legacy stream) never implicitly ordered with a stream that is capturing.
cudaStream_t setup_stream(int device) {
  static auto* streams = new std::map<int, cudaStream_t>();  // NOTE: leaked: outlives CUDA teardown order
  cudaStream_t& s = (*streams)[device];
  if (s == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

std::array<std::atomic<bool>, kMaxDevices> device_ready{};

// Scratch: cudaMalloc'd slabs per device, handed out one per stream.
constexpr int kScratchPerSlab = 128;
struct Slab {
  HashScratch* base = nullptr;
  int used = kScratchPerSlab;
};
std::map<int, Slab>& slabs() {
  static auto* s = new std::map<int, Slab>();
  return *s;
}
std::map<std::pair<int, cudaStream_t>, HashScratch*>& scratches() {
  static auto* s = new std::map<std::pair<int, cudaStream_t>, HashScratch*>();
  return *s;
}

// Words: mapped, portable pinned host memory in blocks, a free list of slots.
class WordsPool {
 public:
  VerifyWords* take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) {
      constexpr int kPerBlock = 128;
      // NOTE: not a stream operation: allowed while a stream captures (relaxed mode for this thread).
      const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
      void* p = nullptr;
      C10_CUDA_CHECK(cudaHostAlloc(&p, sizeof(VerifyWords) * kPerBlock, cudaHostAllocMapped | cudaHostAllocPortable));
      for (int i = 0; i < kPerBlock; ++i) free_.push_back(static_cast<VerifyWords*>(p) + i);
    }
    VerifyWords* w = free_.back();
    free_.pop_back();
    verify::prefill(w);
    return w;
  }

  void give(VerifyWords* w) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(w);
  }

 private:
  std::mutex mutex_;
  std::vector<VerifyWords*> free_;
};

WordsPool& words_pool() {
  static auto* pool = new WordsPool();  // NOTE: leaked on purpose: outlives CUDA teardown order
  return *pool;
}

struct ThreadWords {
  struct Deferred {
    int da, db;
    cudaStream_t sa, sb;
    VerifyWords* words;
  };
  VerifyWords* sync = nullptr;
  uint64_t seq = 0;
  std::vector<Deferred> deferred;  // grows at a thread's first deferred copy on a stream pair
  ~ThreadWords() {
    if (sync != nullptr) words_pool().give(sync);  // the host waited for their last writer
  }
};
thread_local ThreadWords thread_words;

// The last streams this thread asked about, so repeated copies take no lock.
struct ScratchCache {
  static constexpr int kEntries = 4;
  int device[kEntries] = {-1, -1, -1, -1};
  cudaStream_t stream[kEntries] = {};
  HashScratch* scratch[kEntries] = {};
  int next = 0;
};
thread_local ScratchCache scratch_cache;

}  // namespace

uint64_t ready_device(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "pyxfer: verified copies support CUDA devices 0..",
              kMaxDevices - 1, ", got cuda:", device);
  if (!device_ready[device].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(setup_mutex);
    if (!device_ready[device].load(std::memory_order_relaxed)) {
      const c10::cuda::CUDAGuard guard(device);
      // NOTE: a kernel on a stream no capture can see, then a wait for it: legal during a capture.
      const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
      const cudaStream_t s = setup_stream(device);
      C10_CUDA_CHECK(launch_set_device_canary(verify::device_canary(device), s));
      C10_CUDA_CHECK(cudaStreamSynchronize(s));  // set before any guarded kernel, on any stream
      device_ready[device].store(true, std::memory_order_release);
    }
  }
  return verify::device_canary(device);
}

HashScratch* stream_scratch(int device, cudaStream_t stream) {
  ScratchCache& cache = scratch_cache;
  for (int i = 0; i < ScratchCache::kEntries; ++i)
    if (cache.device[i] == device && cache.stream[i] == stream) return cache.scratch[i];
  ready_device(device);
  HashScratch* found = nullptr;
  {
    std::lock_guard<std::mutex> lock(setup_mutex);
    HashScratch*& slot = scratches()[{device, stream}];
    if (slot == nullptr) {
      Slab& slab = slabs()[device];
      if (slab.used == kScratchPerSlab) {
        const c10::cuda::CUDAGuard guard(device);
        const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
        void* p = nullptr;
        C10_CUDA_CHECK(cudaMalloc(&p, sizeof(HashScratch) * kScratchPerSlab));
        const cudaStream_t s = setup_stream(device);
        C10_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(HashScratch) * kScratchPerSlab, s));
        C10_CUDA_CHECK(cudaStreamSynchronize(s));  // zero before any kernel, on any stream, uses it
        slab = {static_cast<HashScratch*>(p), 0};
      }
      slot = slab.base + slab.used++;
    }
    found = slot;
  }
  const int i = cache.next;
  cache.next = (i + 1) % ScratchCache::kEntries;
  cache.device[i] = device;
  cache.stream[i] = stream;
  cache.scratch[i] = found;
  return found;
}

VerifyWords* thread_sync_words() {
  if (thread_words.sync == nullptr) thread_words.sync = words_pool().take();
  return thread_words.sync;
}

void abandon_thread_sync_words() { thread_words.sync = nullptr; }

VerifyWords* thread_deferred_words(int da, cudaStream_t sa, int db, cudaStream_t sb) {
  for (const ThreadWords::Deferred& d : thread_words.deferred)
    if (d.da == da && d.db == db && d.sa == sa && d.sb == sb) return d.words;
  thread_words.deferred.push_back({da, db, sa, sb, words_pool().take()});
  return thread_words.deferred.back().words;
}

uint64_t next_copy_seq() { return ++thread_words.seq; }

at::Tensor graph_scratch(int device) {
  ready_device(device);
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  cudaStream_t s = nullptr;
  {
    std::lock_guard<std::mutex> lock(setup_mutex);
    s = setup_stream(device);
  }
  // Allocated on the set-up stream, which is not capturing: from the ordinary pool, not the graph's
  // (whose blocks other captured work may reuse in every replay).
  const c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromExternal(s, c10::DeviceIndex(device)));
  at::Tensor t = at::empty({int64_t(sizeof(HashScratch))}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), s));
  C10_CUDA_CHECK(cudaStreamSynchronize(s));
  return t;
}

at::Tensor graph_words(VerifyWords** words) {
  VerifyWords* w = words_pool().take();
  *words = w;
  return at::from_blob(w, {int64_t(sizeof(VerifyWords))}, [](void* p) { words_pool().give(static_cast<VerifyWords*>(p)); },
                       at::TensorOptions().dtype(at::kByte));
}

}  // namespace pyxfer
