// Hash results in mapped pinned host memory (valid on every device through UVA): hash kernels write
// them, the host or a kernel on another device reads them. A hash that reaches its comparison this way
// never crosses the peer link whose copy it checks (a link that drops writes could leave a stale
// hash beside stale data, and they would match).
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace pyxfer {

struct alignas(64) HostHashes {
  uint64_t src, dst;
};

// The calling thread's pair for sync copies: the host waits for the hashes before the thread's next
// copy can reuse it.
HostHashes* thread_host_hashes();
// After an error between the launches and the host's wait, kernels may still write the thread's
// pair: never reuse it (the next call takes a fresh one).
void abandon_thread_host_hashes();

// A pair for one comparison whose reader is a kernel (deferred verification, fault checks). Give it
// back with give_host_hashes_after, or, when a CUDA graph captured its readers and writers, with
// give_host_hashes_now once that graph is destroyed.
HostHashes* take_host_hashes();
// Back to the pool once the work queued on `s` so far (the pair's last reader) finished.
void give_host_hashes_after(HostHashes* h, const c10::cuda::CUDAStream& s);
// Back to the pool now (no kernel will touch it again). Makes no CUDA call.
void give_host_hashes_now(HostHashes* h);

}  // namespace pyxfer
