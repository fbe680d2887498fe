// Every pyxfer op's schema, in one place. Implementations register per dispatch key in
// csrc/cpu/ (CPU) and csrc/cuda/ (CUDA); fakes for torch.compile live in pyxfer/_fake.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

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
}

// `import pyxfer._C` runs the static registrations above; the module itself is empty.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
