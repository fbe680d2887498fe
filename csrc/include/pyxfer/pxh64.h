// PXH64, the transfer checksum (docs/specs/pxh64.md, v1). Torch-free.
//
// The definition lives here once and is used bit-for-bit by the CPU reference and the CUDA kernel:
//   acc = sum_j mix(w_j ^ (seed + (j + 1) * kK))   (mod 2^64), w_j = little-endian word j
//   H   = mix(acc ^ mix(num_bytes ^ seed ^ kM1))
// Because acc is a plain modular sum, partial sums over 8-byte-aligned chunks add up exactly.
// NOTE: this is a stored contract (checksums are compared across devices and kept by callers):
// never change it to gain speed.
#pragma once

#include <stdint.h>

#include "pyxfer/host_device.h"

namespace pyxfer {
namespace pxh64 {

constexpr uint64_t kK = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kM2 = 0x94D049BB133111EBull;
constexpr uint64_t kWordBytes = 8;

// splitmix64 finalizer: a bijection on uint64.
PYXFER_HOST_DEVICE uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// Key of word index j (0-based, absolute within the whole hashed buffer).
PYXFER_HOST_DEVICE uint64_t key(uint64_t seed, uint64_t word_index) {
  return seed + (word_index + 1) * kK;
}

// Contribution of one word whose key is already known.
PYXFER_HOST_DEVICE uint64_t term(uint64_t word, uint64_t word_key) { return mix(word ^ word_key); }

// Final value from the summed terms of all ceil(num_bytes / 8) words.
PYXFER_HOST_DEVICE uint64_t finalize(uint64_t acc, uint64_t num_bytes, uint64_t seed) {
  return mix(acc ^ mix(num_bytes ^ seed ^ kM1));
}

// Little-endian word from 1..8 bytes; bytes past `count` read as zero.
PYXFER_HOST_DEVICE uint64_t load_partial_word(const uint8_t* bytes, uint64_t count) {
  uint64_t w = 0;
  for (uint64_t i = 0; i < count && i < kWordBytes; ++i) w |= uint64_t(bytes[i]) << (8 * i);
  return w;
}

}  // namespace pxh64
}  // namespace pyxfer
