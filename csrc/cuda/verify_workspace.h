// Workspaces of verified GPU copies (csrc/cuda/transfer_device.cpp), made once and reused, so a copy
// allocates nothing but its result:
//   scratch  device memory per (device, stream): the running sums and ticket of the guarded kernel in
//            flight on that stream. Stream order hands it from one kernel to the next, and each kernel
//            leaves it zeroed. Only kernels queued on that stream touch it.
//   words    VerifyWords in mapped pinned host memory: per thread for sync copies (the host prefills
//            them, launches, waits, reads), per thread and stream pair for deferred copies (the check
//            kernel on the destination stream consumes them; a copy of the same thread on the same
//            pair comes after that check: it waits for the destination stream at its end).
//   graph    a copy captured in a CUDA graph owns its scratch and words (a replay runs the captured
//            kernels whenever it is launched, beside any eager copy on the stream it was captured
//            from): kept with the graph until it is destroyed.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "pyxfer/launch.h"

namespace pyxfer {

// Sets `device` up for guarded kernels (its canary; once per process) and returns the canary the
// host expects from it. May run while a stream captures a CUDA graph.
uint64_t ready_device(int device);

// The scratch of the kernels queued on `stream` of `device` (made at the stream's first use; never
// freed: streams and graphs outlive any order of teardown).
HashScratch* stream_scratch(int device, cudaStream_t stream);

// The calling thread's words for its sync copies, and the sequence number of its next copy.
VerifyWords* thread_sync_words();
// After an error between the launches and the host's wait: kernels may still write the thread's words,
// so they are never reused (the next call takes fresh ones).
void abandon_thread_sync_words();
// The calling thread's words for deferred copies from stream sa of device da to stream sb of db.
// NOTE: kept when the thread exits (its kernels may still be queued): 32 bytes per stream pair.
VerifyWords* thread_deferred_words(int da, cudaStream_t sa, int db, cudaStream_t sb);
uint64_t next_copy_seq();

// For a copy being captured: a zeroed scratch on `device` (torch's ordinary pool, not the graph's:
// its state must carry from one replay to the next) and prefilled words (*words; the tensor gives
// them back to the pool when dropped). Keep both until the graph is destroyed.
at::Tensor graph_scratch(int device);
at::Tensor graph_words(VerifyWords** words);

}  // namespace pyxfer
