// Build facts compiled into the extension, so that what runs can say what it was built for.
// PYXFER_WITH_CUDA and PYXFER_CUDA_ARCH_LIST are defined by setup.py (the one build definition).
#include <torch/library.h>
#include <torch/version.h>

#include <sstream>
#include <string>

#if PYXFER_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pyxfer {

std::string build_info_json() {
  std::ostringstream s;
  s << "{\"torch\": \"" << TORCH_VERSION << "\", \"cuda\": " << (PYXFER_WITH_CUDA ? "true" : "false");
#if PYXFER_WITH_CUDA
  constexpr int kArchs[] = {PYXFER_CUDA_ARCH_LIST};
  s << ", \"cuda_version\": \"" << CUDART_VERSION / 1000 << "." << (CUDART_VERSION % 1000) / 10 << "\"";
  s << ", \"cuda_archs\": [";
  for (size_t i = 0; i < sizeof(kArchs) / sizeof(kArchs[0]); ++i) s << (i ? ", " : "") << "\"sm_" << kArchs[i] << "\"";
  s << "]";
#else
  s << ", \"cuda_version\": null, \"cuda_archs\": []";
#endif
  s << ", \"compiler\": \"" << __VERSION__ << "\"}";
  return s.str();
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) { m.impl("build_info", &build_info_json); }

}  // namespace pyxfer
