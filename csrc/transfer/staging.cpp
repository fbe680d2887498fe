// Staging settings and the configure_staging op (schema in csrc/torch_bindings.cpp).
#include "transfer/staging.h"

#include <torch/library.h>

#include <mutex>

namespace pyxfer {
namespace {

std::mutex config_mutex;
StagingConfig config{int64_t(8) << 20, 4};  // 4 slots of 8 MiB

void configure_staging_op(int64_t chunk_bytes, int64_t num_slots) {
  constexpr const char* op = "pyxfer.configure_staging";
  TORCH_CHECK(chunk_bytes >= 4096 && chunk_bytes % 4096 == 0, op,
              ": chunk_bytes must be a positive multiple of 4096, got ", chunk_bytes);
  TORCH_CHECK(num_slots >= 2 && num_slots <= 64, op, ": num_slots must be in [2, 64], got ", num_slots);
  std::lock_guard<std::mutex> lock(config_mutex);
  config = {chunk_bytes, num_slots};
}

}  // namespace

StagingConfig staging_config() {
  std::lock_guard<std::mutex> lock(config_mutex);
  return config;
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) { m.impl("configure_staging", &configure_staging_op); }

}  // namespace pyxfer
