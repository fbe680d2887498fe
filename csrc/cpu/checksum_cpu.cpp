// PXH64 on the CPU: the reference implementation, split over threads for large inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "checks.h"
#include "cpu/parallel.h"
#include "pyxfer/pxh64.h"

namespace pyxfer {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "PXH64 words are read as little-endian");

constexpr int64_t kMinWordsPerThread = int64_t(1) << 19;  // 4 MiB: below that a thread costs more than it saves

// Unfinalized sum of the words of data[0, num_bytes), keyed from absolute word `word_offset`.
uint64_t partial_sum(const uint8_t* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed) {
  const int64_t full_words = static_cast<int64_t>(num_bytes / pxh64::kWordBytes);
  uint64_t sum = parallel_sum(full_words, kMinWordsPerThread, [&](int64_t begin, int64_t end) {
    uint64_t s = 0, key = pxh64::key(seed, word_offset + begin);
    for (int64_t j = begin; j < end; ++j, key += pxh64::kK) {
      uint64_t w;
      std::memcpy(&w, data + j * pxh64::kWordBytes, sizeof(w));  // any alignment
      s += pxh64::term(w, key);
    }
    return s;
  });
  const uint64_t tail_bytes = num_bytes % pxh64::kWordBytes;
  if (tail_bytes != 0) {
    const uint64_t w = pxh64::load_partial_word(data + full_words * pxh64::kWordBytes, tail_bytes);
    sum += pxh64::term(w, pxh64::key(seed, word_offset + full_words));
  }
  return sum;
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
