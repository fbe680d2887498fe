// Peer access between GPUs (declared in cuda/peer_access.h).
#include "cuda/peer_access.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace pyxfer {
namespace {

std::mutex peer_mutex;
std::map<std::pair<int, int>, bool> peer_possible;  // cudaDeviceCanAccessPeer, asked once per pair
std::set<std::pair<int, int>> peer_enabled;

// Enable `from` to read and write `to`'s memory (explicitly: no silent staging by the driver), through
// PyTorch's caching allocator: besides cudaDeviceEnablePeerAccess it maps `to`'s expandable segments
// (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) into `from`, now and as they grow. The pair is
// recorded once that succeeded: after a failure the next copy tries again. Caller holds peer_mutex.
void enable_peer_access_locked(int from, int to) {
  if (peer_enabled.count({from, to}) != 0) return;
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);  // may run in capture
  // NOTE: already enabled (by torch or anyone) is not an error there.
  c10::cuda::CUDACachingAllocator::enablePeerAccess(c10::DeviceIndex(from), c10::DeviceIndex(to));
  peer_enabled.insert({from, to});
}

}  // namespace

bool can_access_peer(int from, int to) {
  std::lock_guard<std::mutex> lock(peer_mutex);
  auto it = peer_possible.find({from, to});
  if (it != peer_possible.end()) return it->second;
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);  // may run in capture
  int can = 0;
  C10_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
  return peer_possible[{from, to}] = can != 0;
}

void enable_peer_access(int a, int b) {
  thread_local std::pair<int, int> enabled{-1, -1};  // the last pair: no lock on repeated copies
  if (enabled == std::make_pair(a, b)) return;
  std::lock_guard<std::mutex> lock(peer_mutex);
  enable_peer_access_locked(a, b);
  enable_peer_access_locked(b, a);
  enabled = {a, b};
}

}  // namespace pyxfer
