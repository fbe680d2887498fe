// The legs of verified copies through host memory (declared and documented in cuda/transfer_host.h).
// NOTE: c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE headers).
#include "cuda/transfer_host.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include "cpu/host_pool.h"
#include "cuda/staging_pool.h"
#include "cuda/stream_order.h"
#include "pyxfer/launch.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace {

using c10::cuda::CUDAStream;

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// The host waits for `event` (recorded on `device`). NOTE: on a pool thread the guard makes the event's
// device current first, so the runtime never creates a context on the thread's default device.
void host_wait_event(c10::DeviceIndex device, cudaEvent_t event) {
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaEventSynchronize(event));
}

// Unfinalized PXH64 of dst bytes [c.begin, c.end) into *out (if out is not null).
void hash_item(const uint8_t* d, const PlanChunk& c, uint64_t* out) {
  if (out != nullptr) *out = pxh64_range_sum(d, c.begin, c.end);
}

// The host-side part of a fault plan on item `c` of host memory: zeros, then the flipped bit.
void apply_host_fault(uint8_t* d, const PlanChunk& c, uint8_t flip_mask) {
  if (c.zero_fill) std::memset(d + c.begin, 0, size_t(c.end - c.begin));
  if (c.flip_byte >= 0) d[c.flip_byte] ^= flip_mask;
}

// Calls fn(item) for the kHostItemBytes items of [c.begin, c.end) (chunk-relative: items start on words
// wherever chunks do).
template <typename Fn>
void for_each_item(const PlanChunk& c, const Fn& fn) {
  for (int64_t b = c.begin; b < c.end; b += kHostItemBytes) fn(narrow_chunk(c, b, std::min(c.end, b + kHostItemBytes)));
}

uint64_t finalize_sums(const std::deque<uint64_t>& sums, int64_t num_bytes) {
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return pxh64::finalize(total, uint64_t(num_bytes), 0);
}

// On an error after DMAs into dst were queued on `stream`: the caller frees dst on the way out, and torch's
// caching host allocator may hand the block to another tensor at once, so wait for what was queued first.
// Errors are swallowed: another one is on its way (and after a sticky error nothing lands any more).
void settle_after_error(const CUDAStream& stream) {
  const c10::cuda::CUDAGuard guard(stream.device_index());
  if (cudaStreamSynchronize(stream.stream()) != cudaSuccess) (void)cudaGetLastError();
}

// What a slot's taker does with its prior users, and what it leaves for the next, on an error.
void release_after_error(StagingPool& pool, StagingPool::Slot& slot, cudaEvent_t last_queued,
                         HostTasksIdle host_reader) {
  // The slot's next user must still wait for what touched it last: the last leg queued here (its event,
  // if it got one), else the prior user this copy did not get to wait for.
  const cudaEvent_t last = last_queued != nullptr ? last_queued : slot.prior_reader;
  if (slot.prior_reader != nullptr && slot.prior_reader != last && cudaEventDestroy(slot.prior_reader) != cudaSuccess)
    (void)cudaGetLastError();
  pool.release(slot.index, last, host_reader ? std::move(host_reader) : std::move(slot.prior_host));
}

cudaEvent_t new_event() {
  cudaEvent_t e = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

}  // namespace

uint64_t copy_device_to_pinned(const at::Tensor& dst, const at::Tensor& src, const CUDAStream& stream,
                               const CopyPlan& plan, bool hash) {
  const c10::DeviceIndex device = stream.device_index();
  const c10::cuda::CUDAGuard guard(device);
  uint8_t* d = bytes_of(dst);
  const uint8_t* s = bytes_of(src);
  const cudaStream_t raw = stream.stream();
  const auto queue_copy = [&](const PlanChunk& c) {
    if (c.copy_length > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst, s + c.copy_src, size_t(c.copy_length), cudaMemcpyDeviceToHost,
                                     raw));
    }
  };
  if (!hash || plan.num_bytes <= kHostItemBytes) {  // one copy, one wait, the host's part on this thread
    const int64_t whole = std::max<int64_t>(8, plan.num_bytes);
    try {
      for_each_chunk(plan, whole, queue_copy);
      host_wait(stream);
    } catch (...) {
      settle_after_error(stream);  // the copy may still be landing
      throw;
    }
    uint64_t sum = 0;
    for_each_chunk(plan, whole, [&](const PlanChunk& c) {
      apply_host_fault(d, c, plan.flip_mask);
      hash_item(d, c, hash ? &sum : nullptr);
    });
    return hash ? pxh64::finalize(sum, uint64_t(plan.num_bytes), 0) : 0;
  }
  std::deque<uint64_t> sums;  // one per item (a deque: stable addresses)
  HostTasks tasks;            // NOTE: declared after what its tasks use (destroyed, and waited for, first)
  try {
    size_t k = 0;
    for_each_chunk(plan, kLandingChunkBytes, [&](const PlanChunk& c) {
      queue_copy(c);
      // NOTE: the thread's chunk events: all recorded before any wait on them, none recorded again before
      // this copy's tasks finished (tasks.wait() below, or the destructor on an error)
      const cudaEvent_t landed = device_event(device, ++k);
      C10_CUDA_CHECK(cudaEventRecord(landed, raw));
      for_each_item(c, [&](const PlanChunk& item) {
        uint64_t* out = &sums.emplace_back(0);
        tasks.run([=, mask = plan.flip_mask] {
          host_wait_event(device, landed);
          apply_host_fault(d, item, mask);  // the copy itself was the DMA
          hash_item(d, item, out);
        });
      });
    });
    tasks.wait();
  } catch (...) {
    settle_after_error(stream);  // chunks may still be landing
    throw;
  }
  return finalize_sums(sums, plan.num_bytes);
}

uint64_t copy_device_to_host_staged(const at::Tensor& dst, const at::Tensor& src, const CUDAStream& legs,
                                    const CopyPlan& plan, bool hash) {
  StagingPool& pool = staging_pool();
  const c10::DeviceIndex device = legs.device_index();
  const c10::cuda::CUDAGuard guard(device);
  uint8_t* d = bytes_of(dst);
  const uint8_t* s = bytes_of(src);
  std::deque<uint64_t> sums;                     // one per item (a deque: stable addresses)
  std::vector<std::unique_ptr<HostTasks>> pieces;  // the host legs of each slot's load, in order
  // NOTE: pieces after what their tasks use: destroyed (dropping queued tasks, waiting for running ones) first
  for_each_chunk(plan, pool.chunk_bytes(), [&](const PlanChunk& chunk) {
    for (int64_t begin = chunk.begin; begin < chunk.end;) {
      StagingPool::Slot slot = pool.acquire();
      const int64_t end = std::min(chunk.end, begin + slot.capacity);  // the pool may have been resized meanwhile
      const PlanChunk piece = narrow_chunk(chunk, begin, end);
      uint8_t* const slot_ptr = slot.ptr;  // destination offset x of this piece lands at slot_ptr[x - begin]
      cudaEvent_t landed = nullptr;
      HostTasksIdle readers;
      try {
        slot.prior_host.wait();  // host legs of an earlier load still reading the slot
        if (slot.prior_reader) C10_CUDA_CHECK(cudaStreamWaitEvent(legs.stream(), slot.prior_reader, 0));
        if (piece.copy_length > 0) {
          C10_CUDA_CHECK(cudaMemcpyAsync(slot_ptr + (piece.copy_dst - begin), s + piece.copy_src,
                                         size_t(piece.copy_length), cudaMemcpyDeviceToHost, legs.stream()));
        }
        landed = new_event();
        C10_CUDA_CHECK(cudaEventRecord(landed, legs.stream()));
        pieces.push_back(std::make_unique<HostTasks>());
        readers = pieces.back()->idle();  // before any task is queued: an error below still leaves them waited for
        for_each_item(piece, [&](const PlanChunk& item) {
          uint64_t* out = hash ? &sums.emplace_back(0) : nullptr;
          pieces.back()->run([=, mask = plan.flip_mask, piece_begin = begin] {
            host_wait_event(device, landed);
            if (item.copy_length > 0) {
              std::memcpy(d + item.copy_dst, slot_ptr + (item.copy_dst - piece_begin), size_t(item.copy_length));
            }
            apply_host_fault(d, item, mask);
            hash_item(d, item, out);  // what landed in the destination, not in the slot
          });
        });
      } catch (...) {
        release_after_error(pool, slot, landed, std::move(readers));
        throw;
      }
      // The slot's next user waits for the load (its last device use) and for the host legs reading it.
      pool.release(slot.index, landed, std::move(readers));
      if (slot.prior_reader) C10_CUDA_CHECK(cudaEventDestroy(slot.prior_reader));
      begin = end;
    }
  });
  for (const std::unique_ptr<HostTasks>& p : pieces) p->wait();
  return hash ? finalize_sums(sums, plan.num_bytes) : 0;
}

void copy_host_to_device(const at::Tensor& dst, const at::Tensor& src, const CopyPlan& plan) {
  const c10::cuda::CUDAGuard guard(dst.device());
  const at::Tensor d = dst.reshape({-1}).view(at::kByte), s = src.reshape({-1}).view(at::kByte);
  if (plan.zero_fill) {
    d.zero_();
  } else if (plan.length > 0) {
    d.narrow(0, plan.dst_offset, plan.length).copy_(s.narrow(0, plan.src_offset, plan.length), /*non_blocking=*/true);
  }
  if (plan.flip_byte >= 0) {
    at::Tensor b = d.narrow(0, plan.flip_byte, 1);
    b.bitwise_xor_(plan.flip_mask);
  }
}

void copy_host_to_device_staged(const at::Tensor& dst, const at::Tensor& src, const CUDAStream& legs,
                                const CopyPlan& plan) {
  StagingPool& pool = staging_pool();
  const c10::cuda::CUDAGuard guard(legs.device_index());
  uint8_t* d = bytes_of(dst);
  const uint8_t* s = bytes_of(src);
  for_each_chunk(plan, pool.chunk_bytes(), [&](const PlanChunk& c) {
    if (c.zero_fill) C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), legs.stream()));
    for (int64_t done = 0; done < c.copy_length;) {
      StagingPool::Slot slot = pool.acquire();
      const int64_t n = std::min(c.copy_length - done, slot.capacity);
      cudaEvent_t read = nullptr;
      try {
        slot.prior_host.wait();
        if (slot.prior_reader) C10_CUDA_CHECK(cudaEventSynchronize(slot.prior_reader));  // the host writes it
        // The host leg on the pool (the calling thread helps); the previous piece's H2D moves meanwhile.
        const uint8_t* from = s + c.copy_src + done;
        host_parallel_for(n, kHostItemBytes, [&](int64_t b, int64_t e) {
          std::memcpy(slot.ptr + b, from + b, size_t(e - b));
        });
        C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst + done, slot.ptr, size_t(n), cudaMemcpyHostToDevice,
                                       legs.stream()));
        read = new_event();
        C10_CUDA_CHECK(cudaEventRecord(read, legs.stream()));
      } catch (...) {
        release_after_error(pool, slot, read, {});
        throw;
      }
      pool.release(slot.index, read);
      if (slot.prior_reader) C10_CUDA_CHECK(cudaEventDestroy(slot.prior_reader));
      done += n;
    }
    if (c.flip_byte >= 0) C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, legs.stream()));
  });
}

void copy_device_to_device_staged(const at::Tensor& dst, const at::Tensor& src, const CUDAStream& ca,
                                  const CUDAStream& cb, const CopyPlan& plan) {
  StagingPool& pool = staging_pool();
  uint8_t* d = bytes_of(dst);
  const uint8_t* s = bytes_of(src);
  for_each_chunk(plan, pool.chunk_bytes(), [&](const PlanChunk& c) {
    if (c.zero_fill) {
      const c10::cuda::CUDAGuard guard(cb.device_index());
      C10_CUDA_CHECK(cudaMemsetAsync(d + c.begin, 0, size_t(c.end - c.begin), cb.stream()));
    }
    for (int64_t done = 0; done < c.copy_length;) {
      StagingPool::Slot slot = pool.acquire();
      const int64_t n = std::min(c.copy_length - done, slot.capacity);
      cudaEvent_t landed = nullptr, read = nullptr;
      try {
        slot.prior_host.wait();
        {  // source leg on the source GPU: D2H into the slot
          const c10::cuda::CUDAGuard guard(ca.device_index());
          if (slot.prior_reader) C10_CUDA_CHECK(cudaStreamWaitEvent(ca.stream(), slot.prior_reader, 0));
          C10_CUDA_CHECK(cudaMemcpyAsync(slot.ptr, s + c.copy_src + done, size_t(n), cudaMemcpyDeviceToHost,
                                         ca.stream()));
          landed = new_event();
          C10_CUDA_CHECK(cudaEventRecord(landed, ca.stream()));
        }
        {  // destination leg on the destination GPU: H2D out of the slot once it landed
          const c10::cuda::CUDAGuard guard(cb.device_index());
          C10_CUDA_CHECK(cudaStreamWaitEvent(cb.stream(), landed, 0));
          C10_CUDA_CHECK(cudaMemcpyAsync(d + c.copy_dst + done, slot.ptr, size_t(n), cudaMemcpyHostToDevice,
                                         cb.stream()));
          read = new_event();
          C10_CUDA_CHECK(cudaEventRecord(read, cb.stream()));
        }
      } catch (...) {
        if (landed != nullptr && read != nullptr && cudaEventDestroy(landed) != cudaSuccess) (void)cudaGetLastError();
        release_after_error(pool, slot, read != nullptr ? read : landed, {});
        throw;
      }
      pool.release(slot.index, read);
      if (slot.prior_reader) C10_CUDA_CHECK(cudaEventDestroy(slot.prior_reader));
      C10_CUDA_CHECK(cudaEventDestroy(landed));  // NOTE: the waits queued on it stay valid
      done += n;
    }
    if (c.flip_byte >= 0) {
      const c10::cuda::CUDAGuard guard(cb.device_index());
      C10_CUDA_CHECK(launch_xor_byte(d + c.flip_byte, plan.flip_mask, cb.stream()));
    }
  });
}

}  // namespace pyxfer
