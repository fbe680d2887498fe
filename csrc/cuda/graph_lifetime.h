// Lifetimes tied to a CUDA graph. A graph's private memory pool exists on the device that captures
// it; what a captured copy allocates on another device comes from that device's ordinary pool and
// would be handed to other tensors when the copy returns, while every replay still writes it.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "cuda/host_hashes.h"

namespace pyxfer {

// Keeps `tensors` and `pairs` until the CUDA graph being captured on `capturing` (and every
// executable graph instantiated from it) is destroyed; then the tensors are dropped and the pairs go
// back to their pool (at a later call of this function or of release_destroyed_graph_objects: the
// graph's destructor runs on a CUDA thread, which must not call CUDA).
void keep_until_graph_destroyed(const c10::cuda::CUDAStream& capturing, std::vector<at::Tensor> tensors,
                                std::vector<HostHashes*> pairs);

// Releases what graphs destroyed since the last call kept. Cheap when there is nothing.
void release_destroyed_graph_objects();

}  // namespace pyxfer
