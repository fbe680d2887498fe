// The all-gather of bytes that the Python exchange path runs on gloo (a waiting call's agreement
// records), posted with tensors made here (declared in csrc/torch_bindings.cpp).
//
// NOTE (tensor lifetimes on gloo): gloo's worker thread drops its references to a collective's tensors
// after it completed it, often after wait() returned to the caller. A tensor that has a Python object
// holds that object while any other C++ reference to it exists and releases it when the count falls back
// to one (torch's PyObject preservation), on whichever thread drops that reference, which then takes the
// GIL. When that thread is gloo's and the interpreter is finalizing, Python ends the thread inside gloo's
// C++ code and the process aborts after Python finished ("terminate called without an active exception",
// SIGABRT; issue 39 item 1). So gloo is given tensors that never had a Python object: views of the
// caller's memory made here (from_blob, not owning it), waited for before returning, so the caller's
// buffers outlive every use of their bytes; gloo may drop the views whenever and wherever it likes.
// The native calls (gather.cpp, post_cpu) post buffers of their own the same way.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "gather/gather.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.gloo_all_gather_bytes";

void gloo_all_gather_bytes(c10::string_view group, int64_t out_address, int64_t in_address, int64_t num_bytes) {
  TORCH_CHECK_VALUE(num_bytes >= 0 && out_address != 0 && in_address != 0, kOp, ": expected two buffer addresses "
                    "and num_bytes >= 0, got out ", out_address, ", in ", in_address, ", num_bytes ", num_bytes);
  const c10::intrusive_ptr<c10d::ProcessGroup> pg = c10d::resolve_process_group(std::string(group));
  const auto bytes = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  at::Tensor in = at::from_blob(reinterpret_cast<void*>(in_address), {num_bytes}, bytes);
  at::Tensor out = at::from_blob(reinterpret_cast<void*>(out_address), {pg->getSize() * num_bytes}, bytes);
  c10d::AllgatherOptions opts;
  c10::intrusive_ptr<c10d::Work> work = gather::all_gather_single(*pg, out, in, opts, 0);
  work->wait();
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CompositeExplicitAutograd, m) { m.impl("gloo_all_gather_bytes", &gloo_all_gather_bytes); }

}  // namespace pyxfer
