// PXH64 partial sums on the host with SIMD (AVX-512 / AVX2 / scalar, chosen at run time). The definition
// is csrc/include/pyxfer/pxh64.h (the one reference); every variant here is bit-exact to it.
#pragma once

#include <cstdint>
#include <string>

namespace pyxfer {

enum class HostIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2" or "avx512".
const char* host_isa_name(HostIsa isa);
// Whether this CPU runs `isa` (AVX-512 needs F and DQ: 64-bit multiplies).
bool host_isa_supported(HostIsa isa);
// The variant in use: $PYXFER_HOST_HASH_ISA (scalar | avx2 | avx512; unset or "auto": the best this CPU
// runs), read once. Raises (c10::Error, naming the variable) for an unknown name or one this CPU lacks.
HostIsa host_hash_isa();

// Unfinalized PXH64 sum of data[0, num_bytes) (any alignment; a last partial word reads as zero-padded),
// word j keyed as absolute word `word_offset + j`, with the variant in use. One thread.
uint64_t pxh64_host_sum(const uint8_t* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed);

}  // namespace pyxfer
