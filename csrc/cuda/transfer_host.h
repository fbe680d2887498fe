// The legs of verified copies that pass through host memory (a CPU end, or the staged route), for
// csrc/cuda/transfer_cuda.cpp's CudaPath, which forks and joins the streams, hashes the GPU ends and
// compares. Host work -- hashing what landed in host memory, copying between host buffers -- runs on the
// host hashing pool (cpu/host_pool.h) in kHostItemBytes items, so a chunk that just landed is spread
// over all its threads while the next one moves. Every function applies a fault plan (pyxfer.testing)
// chunk by chunk (transfer.h's for_each_range) and runs with no CUDA graph capture (a CPU end or the
// staged route is refused there), except copy_host_to_device (torch's copy, capturable from pinned memory).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "transfer/transfer.h"

namespace pyxfer {

// Bytes of one device -> host chunk with its own event: the host starts on a chunk once it landed
// (8 MiB: best of 4-32 MiB in benchmarks/probes/transfer_probe.cu on H100s).
constexpr int64_t kLandingChunkBytes = int64_t(8) << 20;

// GPU -> pinned host memory: src's bytes move straight into dst (page-locked, same size) in chunks on
// `stream` (the source's current stream), an event after each; as each chunk's event fires, the pool
// applies the plan's host-side part (zeros, a flipped bit) to its items and, if `hash`, hashes them.
// Returns PXH64 (seed 0) of dst's bytes after all that (0 without `hash`). The host waits for the copy.
// Without `hash`, or up to one item: one copy, one wait, the host's part on the calling thread.
uint64_t copy_device_to_pinned(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& stream,
                               const CopyPlan& plan, bool hash);

// GPU -> host memory of any kind through the staging pool's pinned slots: the D2H of each piece is queued
// on `legs` (a stream of the source's GPU) as soon as a slot is free, and the pool copies a landed piece
// out of its slot into dst and hashes it there (what landed in the final destination), while the next
// pieces move. Returns PXH64 of dst (0 without `hash`). The host waits for everything.
uint64_t copy_device_to_host_staged(const at::Tensor& dst, const at::Tensor& src,
                                    const c10::cuda::CUDAStream& legs, const CopyPlan& plan, bool hash);

// Host -> GPU, direct: torch's copy on dst's current stream (asynchronous from pinned memory, which it
// keeps alive; from pageable memory it returns once the source was read). Faults act on the GPU.
void copy_host_to_device(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan);

// Host -> GPU through the staging pool: the pool copies each piece into a slot (the calling thread helps),
// then its H2D is queued on `legs` (a stream of dst's GPU) and the next piece's host leg starts while it
// moves. Faults act on the GPU, on `legs`.
void copy_host_to_device_staged(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& legs,
                                const CopyPlan& plan);

// GPU -> GPU through the staging pool: each piece leaves on `ca` (the source's GPU) into a slot and
// arrives on `cb` (the destination's GPU) after it landed; no host wait but for a free slot.
void copy_device_to_device_staged(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& ca,
                                  const c10::cuda::CUDAStream& cb, const CopyPlan& plan);

}  // namespace pyxfer
