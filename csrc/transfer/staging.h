// Staging settings shared by every staged copy, set by pyxfer.configure_staging.
#pragma once

#include <cstdint>

namespace pyxfer {

// Bytes per slot and number of slots of the staging pool (the host path uses one slot's worth).
struct StagingConfig {
  int64_t chunk_bytes;
  int64_t num_slots;
};
StagingConfig staging_config();

}  // namespace pyxfer
