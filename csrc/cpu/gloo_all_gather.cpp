// The all-gather of bytes that pyxfer.all_gather runs on gloo (pyxfer/gather/exchange.py: the agreement
// records and the data of CPU gathers), posted with tensors made here (declared in csrc/torch_bindings.cpp).
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
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <cstdint>
#include <string>

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.gloo_all_gather_bytes";

// The process group's single-tensor all-gather under either name: torch 2.13 renamed _allgather_base to
// all_gather_single and deprecated the old name, which torch 2.11 and 2.12 still need. The int overload
// wins where the new name exists; the other is instantiated only where it does not.
template <typename PG>
auto all_gather_single(PG& pg, at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& opts, int)
    -> decltype(pg.all_gather_single(out, in, opts)) {
  return pg.all_gather_single(out, in, opts);
}
template <typename PG>
c10::intrusive_ptr<c10d::Work> all_gather_single(PG& pg, at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts, long) {
  return pg._allgather_base(out, in, opts);
}

void gloo_all_gather_bytes(c10::string_view group, int64_t out_address, int64_t in_address, int64_t num_bytes) {
  TORCH_CHECK_VALUE(num_bytes >= 0 && out_address != 0 && in_address != 0, kOp, ": expected two buffer addresses "
                    "and num_bytes >= 0, got out ", out_address, ", in ", in_address, ", num_bytes ", num_bytes);
  const c10::intrusive_ptr<c10d::ProcessGroup> pg = c10d::resolve_process_group(std::string(group));
  const auto bytes = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  at::Tensor in = at::from_blob(reinterpret_cast<void*>(in_address), {num_bytes}, bytes);
  at::Tensor out = at::from_blob(reinterpret_cast<void*>(out_address), {pg->getSize() * num_bytes}, bytes);
  c10d::AllgatherOptions opts;
  c10::intrusive_ptr<c10d::Work> work = all_gather_single(*pg, out, in, opts, 0);
  work->wait();
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CompositeExplicitAutograd, m) { m.impl("gloo_all_gather_bytes", &gloo_all_gather_bytes); }

}  // namespace pyxfer
