// PXH64 on the CPU: the reference definition (pyxfer/pxh64.h) in SIMD (cpu/pxh64_host.h), split over the
// host hashing pool for large inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/host_pool.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace {

// Unfinalized sum of the words of data[0, num_bytes), keyed from absolute word `word_offset`: SIMD, split over
// the host hashing pool for large inputs (cpu/host_pool.h).
uint64_t partial_sum(const uint8_t* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed) {
  return host_pxh64_sum(data, int64_t(num_bytes), word_offset, seed);
}

at::Tensor scalar_u64(uint64_t value) {
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kLong));
  out.data_ptr<int64_t>()[0] = static_cast<int64_t>(value);
  return out;
}

uint64_t partial_sum_of(const char* op, const at::Tensor& t, int64_t word_offset, int64_t seed) {
  check_dense(op, "t", t);
  check_non_negative(op, "word_offset", word_offset);
  const at::Tensor c = t.contiguous();  // hash the logical row-major bytes
  return partial_sum(static_cast<const uint8_t*>(c.data_ptr()), c.nbytes(), u64(word_offset), u64(seed));
}

at::Tensor checksum_cpu(const at::Tensor& t, int64_t seed) {
  const uint64_t sum = partial_sum_of("pyxfer.checksum", t, 0, seed);
  return scalar_u64(pxh64::finalize(sum, t.nbytes(), u64(seed)));
}

at::Tensor checksum_partial_cpu(const at::Tensor& t, int64_t word_offset, int64_t seed) {
  return scalar_u64(partial_sum_of("pyxfer.checksum_partial", t, word_offset, seed));
}

at::Tensor checksum_combine_cpu(const at::Tensor& partials, int64_t num_bytes, int64_t seed) {
  check_partials("pyxfer.checksum_combine", partials);
  check_non_negative("pyxfer.checksum_combine", "num_bytes", num_bytes);
  const at::Tensor c = partials.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  uint64_t sum = 0;
  for (int64_t i = 0; i < c.numel(); ++i) sum += u64(p[i]);
  return scalar_u64(pxh64::finalize(sum, u64(num_bytes), u64(seed)));
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CPU, m) {
  m.impl("checksum", &checksum_cpu);
  m.impl("checksum_partial", &checksum_partial_cpu);
  m.impl("checksum_combine", &checksum_combine_cpu);
}

}  // namespace pyxfer
