// Every pyxfer op's schema, in one place (schemas only). Implementations register per dispatch key
// from their own files: csrc/cpu/ (CPU), csrc/cuda/ (CUDA), csrc/transfer/ (the device-generic
// transfer protocol and the ops without tensors), csrc/build_info.cpp; fakes for torch.compile live
// in pyxfer/_fake.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(pyxfer, m) {
  // PXH64 of t's logical row-major bytes, as a 0-dim int64 holding the uint64 bits, on t.device.
  m.def("checksum(Tensor t, int seed=0) -> Tensor");
  // Unfinalized PXH64 sum of t's bytes keyed as words [word_offset, ...): sums of chunks that start
  // on 8-byte boundaries add up (mod 2^64) to the whole buffer's sum. 0-dim int64 on t.device.
  m.def("checksum_partial(Tensor t, int word_offset=0, int seed=0) -> Tensor");
  // PXH64 of a num_bytes buffer from the 1-D int64 partial sums of its chunks (on their device).
  m.def("checksum_combine(Tensor partials, int num_bytes, int seed=0) -> Tensor");
  // Build facts (torch built against, CUDA on/off, architectures) as a JSON object.
  m.def("build_info() -> str");
  // The host hashing pool as a JSON object: worker threads, the PXH64 instruction set in use and those this
  // CPU runs, the bytes of one work item (csrc/cpu/host_pool.h).
  m.def("host_hash_info() -> str");
  // Test support for the host hashing pool: runs num_tasks tasks (each spinning spin_us microseconds), the
  // one numbered fail_at (if >= 0) raising; returns how many ran to completion.
  m.def("_host_pool_selftest(int num_tasks, int fail_at=-1, int spin_us=0) -> int");

  // Verified transfers (csrc/transfer/). Devices in the registries below are coded -1 = CPU,
  // n = cuda:n, -2 = any.
  // Copy of src on `device` (same dtype, shape, bits; contiguous), checked end to end with PXH64.
  // route: auto | direct | staged. verify: sync (wait, repair through the staged path or raise
  // "pyxfer.TransferError"), deferred (compare on the device, latch mismatches for
  // take_transfer_errors), none. pin_memory: a CPU result of a copy from a GPU is page-locked memory from
  // torch's caching host allocator (False: pageable); ignored for other pairs.
  m.def("verified_copy(Tensor src, Device device, str route=\"auto\", str verify=\"sync\", bool pin_memory=True) "
        "-> Tensor");
  // verified_copy of each of srcs to `device`, in order, in one call; a failure (sync raise, deferred latch)
  // records the tensor's index.
  m.def("verified_copy_many(Tensor[] srcs, Device device, str route=\"auto\", str verify=\"sync\", "
        "bool pin_memory=True) -> Tensor[]");
  // Unverified copy through the bounded pool of pinned host buffers, pipelined in chunks.
  m.def("staged_copy(Tensor src, Device device) -> Tensor");
  // Copies src's bytes into dst (both contiguous, the same number of bytes) with a copy kernel: on
  // dst's GPU reading src's memory (pull) or on src's GPU writing dst's (push), on that GPU's current
  // stream, ordered after and before the other GPU's current stream like a copy_ between devices.
  // Unverified; what `pyxfer bench` times as the SM copy modes. On the CPU: a memcpy.
  m.def("sm_copy(Tensor src, Tensor(a!) dst, bool pull=True) -> ()");
  // The node reached after num_hops hops along `ring` (a 1-D int64 tensor; ring[i] is the index of the node
  // after node i) from node 0, walked by one GPU thread with one dependent load per hop, as a 0-dim int64 on
  // `device` (default: the ring's device), the GPU that walks it, which may read a peer GPU's ring. The walk
  // stops at the first index outside [0, ring.numel()), which it returns. What `pyxfer bench` times as the
  // SM pointer-chase latency (nvbandwidth's method). On the CPU: the same walk on the host.
  m.def("pointer_chase(Tensor ring, int num_hops, Device? device=None) -> Tensor");
  // `pyxfer doctor`'s concurrent probe of a GPU pair (pyxfer/peer_exchange.h): one side on a's GPU, one on b's,
  // running at the same time, each writing `rounds` rounds of words into the other's buffer and polling flags
  // in its own, under a wait limit of timeout_s. a and b: 1-D int64, kExchangeHeaderWords + n words each
  // (zeroed by the op). Returns a [2, 5] int64 CPU tensor, a row per side (row 0: what a's side found, the
  // b -> a direction): [wrong words, first bad round, its first bad word, rounds done, timed out]. Test
  // hooks: corrupt_round (side 0 writes one wrong word in that round), stall_side (that side does nothing).
  // On the CPU: the same protocol between two threads.
  m.def("peer_exchange(Tensor(a!) a, Tensor(b!) b, int rounds, int seed, float timeout_s, int corrupt_round=-1, "
        "int stall_side=-1) -> Tensor");
  // Health of the ordered pair (src, dst): 0 unknown, 1 healthy, 2 corrupt.
  m.def("health_status(int src, int dst) -> int");
  m.def("health_mark(int src, int dst, int state) -> ()");
  m.def("health_reset() -> ()");
  // Make the next `times` copies src -> dst on `path` (direct | staged) made by the calling thread
  // (by any thread if process_wide) write wrong bytes of `kind` (zeros | bitflip | stale | truncate |
  // shift), always different from the source's. Returns an id for fault_pop.
  m.def("fault_push(str kind, int src, int dst, str path, int times, int seed, bool process_wide=False) -> int");
  // Remove a fault; returns how many of its copies it had not yet corrupted.
  m.def("fault_pop(int id) -> int");
  // Size of the staging pool for later staged copies: slots of chunk_bytes each.
  m.def("configure_staging(int chunk_bytes, int num_slots) -> ()");
  // The mismatches latched by the calling thread's deferred copies since its last call, after
  // waiting for the devices that ran them, as a transfer error record of the first
  // (csrc/transfer/errors.cpp): [count (all of them), src, dst, num_bytes, src_hash, dst_hash, route
  // (0 not recorded, 1 direct, 2 staged), attempt, retry_dst_hash, index (the tensor's in its
  // verified_copy_many call; -1: none)], then [src, dst] of every other
  // pair with a mismatch; [] if none.
  m.def("take_transfer_errors() -> int[]");
  // The record of the failure this thread's last sync verified_copy raised (then cleared), in the
  // same layout: count 1, the first try's hashes and route, attempt 2; [] if none.
  m.def("take_sync_transfer_error() -> int[]");
  // The pure parts of verified GPU copies, for tests on any machine (csrc/transfer/peer_plan.cpp).
  // The copy-engine schedule of a num_bytes peer copy from the pair's rates (GB/s) and one wave of the
  // hash kernel: [shrink, min_chunk, hash_blocks, src_blocks, end of each chunk...]; with knobs, as
  // PYXFER_PEER_CHUNKS / PYXFER_PEER_HASH_GRID override it.
  m.def("plan_peer_chunks(int num_bytes, float link_gbps, float hash_gbps, int wave_blocks, bool knobs=False) -> int[]");
  // The checker's verdict on published words [src, dst, src_token, dst_token] of call `seq` whose ends
  // are cuda:src_device and cuda:dst_device (pyxfer/verify_words.h): [ok, src_hash, dst_hash].
  m.def("judge_verify_words(int[] words, int seq, int src_device, int dst_device) -> int[]");
  // Sizes (bytes) where verified GPU copies change protocol: [largest two-kernel peer copy run in a row,
  // largest one-kernel pull (PYXFER_PEER_FUSED_MIB; above it the copy engine), largest copy whose sync
  // wait polls the published words].
  m.def("verified_copy_limits() -> int[]");

  // Quantized formats (csrc/include/pyxfer/formats.h; layouts as Transformer Engine's, see
  // docs/specs/quantized-formats.md). M = product of x's leading dims, K = its last dim. Each
  // quantize op returns (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv),
  // a 0-element tensor for a usage not asked for; data is uint8 bytes, scale padding is zero.
  // FP8 block scaling, 1x128 (block_dim=1) or 128x128 (block_dim=2), any M and K (partial blocks).
  m.def("quantize_fp8_block(Tensor x, int block_dim, bool rowwise, bool columnwise, ScalarType fp8_dtype, "
        "bool pow2_scales, float amax_epsilon) -> (Tensor, Tensor, Tensor, Tensor)");
  // Decode stored FP8-block data (rowwise: logical shape; columnwise: (K, d0, ...)) to out_dtype,
  // in the logical shape.
  m.def("dequantize_fp8_block(Tensor data, Tensor scale_inv, int block_dim, bool columnwise, ScalarType fp8_dtype, "
        "ScalarType out_dtype) -> Tensor");
  // MXFP8: 1x32 (rowwise) / 32x1 (columnwise, not transposed) blocks, E8M0 scales (TE's round-up
  // rule), compact layout. M and K multiples of 32.
  m.def("quantize_mxfp8(Tensor x, bool rowwise, bool columnwise, ScalarType fp8_dtype) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dequantize_mxfp8(Tensor data, Tensor scale_inv, bool columnwise, ScalarType fp8_dtype, "
        "ScalarType out_dtype) -> Tensor");
  // NVFP4: E2M1 pairs (even element in the low nibble), 1x16 blocks with E4M3 scales under the
  // per-tensor global_amax (fp32, one element); columnwise data transposed to [K, M/2].
  // M and K multiples of 16.
  m.def("quantize_nvfp4(Tensor x, Tensor global_amax, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor, Tensor)");
  // Rowwise data (..., K/2) decodes to (..., K); columnwise data [K, M/2] decodes to [M, K].
  m.def("dequantize_nvfp4(Tensor data, Tensor scale_inv, Tensor amax, bool columnwise, ScalarType out_dtype) -> Tensor");
  // out[b, a, ...] = src[a, b, ...]: rank-major gathered buffers to the layout the format needs.
  m.def("swap_first_dims(Tensor src) -> Tensor");

  // The all-gather's steady-state call (csrc/gather/; pyxfer/gather/engine.py drives it and documents
  // the protocol). A plan (the layout of one agreed signature's gather) is registered once from its
  // descriptor; a latch is host memory where verdicts land, never freed (graphs may replay into it):
  // gather_latch_new returns it as a CPU tensor for the host to read, and the calls name it by that
  // tensor's data pointer (`latch`: the engine's state, written beside the results, not an argument
  // tensor). `group` is a process group's name (torch's group registry, as its functional collectives
  // take it).
  // The all-gather pyxfer.all_gather runs on gloo for a waiting call's records, from and into the caller's
  // CPU buffers (addresses: num_bytes from `in_address`, world x num_bytes into `out_address`), waited for;
  // gloo is handed views made in C++ (csrc/gather/gloo_bytes.cpp says why).
  m.def("gloo_all_gather_bytes(str group, int out_address, int in_address, int num_bytes) -> ()");
  m.def("gather_plan_new(int[] desc) -> int");
  m.def("gather_plan_free(int plan) -> ()");
  m.def("gather_latch_new(Device device) -> Tensor");
  // Host-time accounting of the calls below, since the last reset (benchmarks/gather_overhead.py):
  // [calls, ns inside the process group's collective call, verdict waits that found the verdict missing
  // (the host was ahead of the device), ns spent in them].
  m.def("gather_stats(bool reset=False) -> int[]");
  // Posts one collective of every part cut from `inputs` (kModeScratch: uninitialized buffers of the
  // plan's layout) and the record `meta` (NVFP4: with the `amax` bits; kModeHashes: with the PXH64 of
  // every sent buffer), after waiting for the verdict of call `wait_seq` (> 0): if that call disagreed,
  // nothing is posted and [] returned. kModeVerdict: the records are compared on the device and the
  // verdict of call `seq` written to the latch. kModeAsync: beside the caller's stream (`flags`: kMode* bits). Returns the
  // results (one per part, then an NVFP4 plan's result amax: rowwise, columnwise; a part without
  // fix-up receives its data there), the rank-major temporaries of the parts with a fix-up, and the
  // gathered records (world x record_len int64).
  m.def("gather_post(str group, int plan, Tensor[] inputs, Tensor meta, "
        "Tensor[] amax, int latch, int seq, int wait_seq, int flags) -> Tensor[]");
  // Completes a posted call's results in place on the caller's stream: fix-ups, a disagreeing result
  // marked invalid (NaN scales / data where the dtype has a NaN), NVFP4 result amax and the
  // renormalisation of shards quantized with different amax.
  m.def("gather_finish(int plan, Tensor(a!)[] results, Tensor[] temps, Tensor meta_recv, int seq, int flags) -> ()");
  // Makes the caller's current stream wait for the collective of posted async call `seq` (whose records
  // `meta_recv` receives): reads of the received buffers before gather_finish (PXH64 checks, injected
  // faults) then follow the data. CPU: nothing to wait for (gloo collectives complete inside the post).
  m.def("gather_join(Tensor meta_recv, int seq) -> ()");
  // gather_post then gather_finish (synchronous calls): the results, then the gathered records.
  m.def("gather_run(str group, int plan, Tensor[] inputs, Tensor meta, "
        "Tensor[] amax, int latch, int seq, int wait_seq, int flags) -> Tensor[]");
}

// `import pyxfer._C` runs the static registrations above; the module itself is empty.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
