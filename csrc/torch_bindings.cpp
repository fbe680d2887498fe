// Every pyxfer op's schema, in one place. Implementations register per dispatch key in
// csrc/cpu/ (CPU) and csrc/cuda/ (CUDA); fakes for torch.compile live in pyxfer/_fake.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "transfer/transfer.h"

namespace pyxfer {
std::string build_info_json();  // csrc/build_info.cpp
}

TORCH_LIBRARY(pyxfer, m) {
  // PXH64 of t's logical row-major bytes, as a 0-dim int64 holding the uint64 bits, on t.device.
  m.def("checksum(Tensor t, int seed=0) -> Tensor");
  // Unfinalized PXH64 sum of t's bytes keyed as words [word_offset, ...): sums of chunks that start
  // on 8-byte boundaries add up (mod 2^64) to the whole buffer's sum. 0-dim int64 on t.device.
  m.def("checksum_partial(Tensor t, int word_offset=0, int seed=0) -> Tensor");
  // PXH64 of a num_bytes buffer from the 1-D int64 partial sums of its chunks (on their device).
  m.def("checksum_combine(Tensor partials, int num_bytes, int seed=0) -> Tensor");
  // Build facts (torch built against, CUDA on/off, architectures) as a JSON object.
  m.def("build_info() -> str", &pyxfer::build_info_json);

  // Verified transfers (csrc/transfer/). Devices in the registries below are coded -1 = CPU,
  // n = cuda:n, -2 = any.
  // Copy of src on `device` (same dtype, shape, bits; contiguous), checked end to end with PXH64.
  // route: auto | direct | staged. verify: sync (wait, repair through the staged path or raise
  // "pyxfer.TransferError"), deferred (compare on the device, latch mismatches for
  // take_transfer_errors), none.
  m.def("verified_copy(Tensor src, Device device, str route=\"auto\", str verify=\"sync\") -> Tensor");
  // Unverified copy through the bounded pool of pinned host buffers, pipelined in chunks.
  m.def("staged_copy(Tensor src, Device device) -> Tensor");
  // Health of the ordered pair (src, dst): 0 unknown, 1 healthy, 2 corrupt.
  m.def("health_status(int src, int dst) -> int", &pyxfer::health_status_op);
  m.def("health_mark(int src, int dst, int state) -> ()", &pyxfer::health_mark_op);
  m.def("health_reset() -> ()", &pyxfer::health_reset_op);
  // Make the next `times` copies src -> dst on `path` (direct | staged) write wrong bytes of `kind`
  // (zeros | bitflip | stale | truncate | shift). Returns an id for fault_pop.
  m.def("fault_push(str kind, int src, int dst, str path, int times, int seed) -> int", &pyxfer::fault_push_op);
  // Remove a fault; returns how many of its copies it had not yet corrupted.
  m.def("fault_pop(int id) -> int", &pyxfer::fault_pop_op);
  // Size of the staging pool for later staged copies: slots of chunk_bytes each.
  m.def("configure_staging(int chunk_bytes, int num_slots) -> ()", &pyxfer::configure_staging_op);
  // The first mismatch latched by deferred copies since the last call, after waiting for the
  // devices that ran them: [count, src, dst, num_bytes, src_hash, dst_hash], or [] if none.
  m.def("take_transfer_errors() -> int[]", &pyxfer::take_transfer_errors_op);
}

// `import pyxfer._C` runs the static registrations above; the module itself is empty.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
