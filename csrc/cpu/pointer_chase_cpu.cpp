// pointer_chase on the CPU: the same walk as the GPU kernel (csrc/kernels/transfer.cu), on the host. The
// GPU's kernel is what `pyxfer bench` times; this one defines the result bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "checks.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.pointer_chase";

at::Tensor pointer_chase_cpu(const at::Tensor& ring, int64_t num_hops, std::optional<at::Device> device) {
  check_pointer_chase(kOp, ring, num_hops);
  TORCH_CHECK_VALUE(!device.has_value() || device->is_cpu(), kOp, ": device must be cpu for a ring in host memory "
                    "(a GPU walks only a ring in GPU memory), got ", device.has_value() ? device->str() : "");
  const int64_t* next = ring.const_data_ptr<int64_t>();
  const int64_t num_nodes = ring.numel();
  int64_t i = 0;
  for (int64_t h = 0; h < num_hops; ++h) {
    i = next[i];
    if (static_cast<uint64_t>(i) >= static_cast<uint64_t>(num_nodes)) break;
  }
  return at::scalar_tensor(i, ring.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CPU, m) { m.impl("pointer_chase", &pointer_chase_cpu); }

}  // namespace pyxfer
