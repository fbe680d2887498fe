// Lifetimes tied to a CUDA graph (declared and documented in cuda/graph_lifetime.h): a CUDA user
// object retained by the graph under capture owns what must outlive the replays.
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/graph_lifetime.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <utility>

namespace pyxfer {
namespace {

struct Kept {
  std::vector<at::Tensor> tensors;
  std::vector<HostHashes*> pairs;
};

std::mutex destroyed_mutex;
std::vector<Kept*> destroyed;  // graphs gone: released by the next call from a thread that may call CUDA
std::atomic<bool> any_destroyed{false};

// Runs on a CUDA-internal thread once the graph and its executable graphs are gone: no CUDA calls
// here (dropping a tensor may record events), only a hand-over.
void on_graph_destroyed(void* p) {
  std::lock_guard<std::mutex> lock(destroyed_mutex);
  destroyed.push_back(static_cast<Kept*>(p));
  any_destroyed.store(true, std::memory_order_release);
}

}  // namespace

void release_destroyed_graph_objects() {
  if (!any_destroyed.load(std::memory_order_acquire)) return;
  std::vector<Kept*> gone;
  {
    std::lock_guard<std::mutex> lock(destroyed_mutex);
    gone.swap(destroyed);
    any_destroyed.store(false, std::memory_order_release);
  }
  for (Kept* k : gone) {
    for (HostHashes* h : k->pairs) give_host_hashes_now(h);
    delete k;
  }
}

void keep_until_graph_destroyed(const c10::cuda::CUDAStream& capturing, std::vector<at::Tensor> tensors,
                                std::vector<HostHashes*> pairs) {
  release_destroyed_graph_objects();
  if (tensors.empty() && pairs.empty()) return;
  const c10::cuda::CUDAGuard guard(capturing.device_index());
  // NOTE: graph and user-object calls, not stream operations: legal in any capture mode this way.
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(capturing.stream(), &status, nullptr, &graph));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(capturing.stream(), &status, nullptr, &graph));
#endif
  TORCH_CHECK(status == cudaStreamCaptureStatusActive && graph != nullptr,
              "pyxfer: internal error: keep_until_graph_destroyed on a stream that is not capturing");
  auto kept = std::make_unique<Kept>(Kept{std::move(tensors), std::move(pairs)});
  cudaUserObject_t object = nullptr;
  C10_CUDA_CHECK(cudaUserObjectCreate(&object, kept.get(), &on_graph_destroyed, 1, cudaUserObjectNoDestructorSync));
  kept.release();  // owned by the user object from here on
  // NOTE: moves our reference to the graph: executable graphs instantiated from it retain it too.
  C10_CUDA_CHECK(cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove));
}

}  // namespace pyxfer
