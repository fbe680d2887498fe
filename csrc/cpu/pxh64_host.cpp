// PXH64 partial sums on the host with SIMD (declared and documented in cpu/pxh64_host.h).
// NOTE: no -march flags: each SIMD variant is a function compiled for its instruction set with
// __attribute__((target(...))) and called only where __builtin_cpu_supports says the CPU runs it, so one
// build runs on every x86-64 CPU. Measured per thread on the H100 hosts (Xeon, pinned memory): scalar
// 3.2 GB/s, AVX2 4.8, AVX-512 6.6 (benchmarks/probes/transfer_probe.cu).
#include "cpu/pxh64_host.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "pyxfer/pxh64.h"

#if defined(__x86_64__) || defined(__i386__)
#define PXH64_HOST_X86 1
// NOTE: GCC 12's AVX-512 headers seed results with _mm512_undefined_*() (`__Y = __Y`), which -Wall reports
// as uninitialized once inlined (GCC bug 105593): not a defect of this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define PXH64_HOST_X86 0
#endif

namespace pyxfer {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "PXH64 words are read as little-endian");

// The reference loop: full words, then the zero-padded tail.
uint64_t sum_scalar(const uint8_t* p, uint64_t num_bytes, uint64_t word_offset, uint64_t seed) {
  const uint64_t full = num_bytes / pxh64::kWordBytes;
  uint64_t s = 0, key = pxh64::key(seed, word_offset);
  for (uint64_t j = 0; j < full; ++j, key += pxh64::kK) {
    uint64_t w;
    std::memcpy(&w, p + j * pxh64::kWordBytes, sizeof(w));  // any alignment
    s += pxh64::term(w, key);
  }
  const uint64_t tail = num_bytes % pxh64::kWordBytes;
  if (tail != 0) s += pxh64::term(pxh64::load_partial_word(p + full * pxh64::kWordBytes, tail), key);
  return s;
}

#if PXH64_HOST_X86
long long ll(uint64_t v) {
  long long r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

// AVX2 has no 64-bit multiply: the low 64 bits of a * b from 32-bit halves (bhi = b >> 32 per lane).
__attribute__((target("avx2"))) inline __m256i mul64(__m256i a, __m256i b, __m256i bhi) {
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b), _mm256_mul_epu32(a, bhi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
}

__attribute__((target("avx2"))) inline __m256i mix4(__m256i z, __m256i m1, __m256i m1h, __m256i m2, __m256i m2h) {
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1, m1h);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2, m2h);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// 8 words per step in two independent 4-lane chains; the rest by the reference loop.
__attribute__((target("avx2"))) uint64_t sum_avx2(const uint8_t* p, uint64_t num_bytes, uint64_t word_offset,
                                                  uint64_t seed) {
  const uint64_t words = num_bytes / pxh64::kWordBytes, k0 = pxh64::key(seed, word_offset), K = pxh64::kK;
  __m256i key0 = _mm256_set_epi64x(ll(k0 + 3 * K), ll(k0 + 2 * K), ll(k0 + K), ll(k0));
  __m256i key1 = _mm256_add_epi64(key0, _mm256_set1_epi64x(ll(4 * K)));
  const __m256i step = _mm256_set1_epi64x(ll(8 * K));
  const __m256i m1 = _mm256_set1_epi64x(ll(pxh64::kM1)), m1h = _mm256_srli_epi64(m1, 32);
  const __m256i m2 = _mm256_set1_epi64x(ll(pxh64::kM2)), m2h = _mm256_srli_epi64(m2, 32);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  uint64_t j = 0;
  for (; j + 8 <= words; j += 8) {
    const __m256i z0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * j)), key0);
    const __m256i z1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * j + 32)), key1);
    key0 = _mm256_add_epi64(key0, step);
    key1 = _mm256_add_epi64(key1, step);
    acc0 = _mm256_add_epi64(acc0, mix4(z0, m1, m1h, m2, m2h));
    acc1 = _mm256_add_epi64(acc1, mix4(z1, m1, m1h, m2, m2h));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_scalar(p + 8 * j, num_bytes - 8 * j, word_offset + j, seed);
}

// 16 words per step in two independent 8-lane chains (vpmullq needs AVX-512 DQ).
__attribute__((target("avx512f,avx512dq"))) uint64_t sum_avx512(const uint8_t* p, uint64_t num_bytes,
                                                                uint64_t word_offset, uint64_t seed) {
  const uint64_t words = num_bytes / pxh64::kWordBytes, k0 = pxh64::key(seed, word_offset), K = pxh64::kK;
  __m512i key0 = _mm512_set_epi64(ll(k0 + 7 * K), ll(k0 + 6 * K), ll(k0 + 5 * K), ll(k0 + 4 * K), ll(k0 + 3 * K),
                                  ll(k0 + 2 * K), ll(k0 + K), ll(k0));
  const __m512i half = _mm512_set1_epi64(ll(8 * K)), step = _mm512_set1_epi64(ll(16 * K));
  __m512i key1 = _mm512_add_epi64(key0, half);
  const __m512i m1 = _mm512_set1_epi64(ll(pxh64::kM1)), m2 = _mm512_set1_epi64(ll(pxh64::kM2));
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  uint64_t j = 0;
  for (; j + 16 <= words; j += 16) {
    __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(p + 8 * j), key0);
    __m512i z1 = _mm512_xor_si512(_mm512_loadu_si512(p + 8 * j + 64), key1);
    key0 = _mm512_add_epi64(key0, step);
    key1 = _mm512_add_epi64(key1, step);
    z0 = _mm512_mullo_epi64(_mm512_xor_si512(z0, _mm512_srli_epi64(z0, 30)), m1);
    z1 = _mm512_mullo_epi64(_mm512_xor_si512(z1, _mm512_srli_epi64(z1, 30)), m1);
    z0 = _mm512_mullo_epi64(_mm512_xor_si512(z0, _mm512_srli_epi64(z0, 27)), m2);
    z1 = _mm512_mullo_epi64(_mm512_xor_si512(z1, _mm512_srli_epi64(z1, 27)), m2);
    acc0 = _mm512_add_epi64(acc0, _mm512_xor_si512(z0, _mm512_srli_epi64(z0, 31)));
    acc1 = _mm512_add_epi64(acc1, _mm512_xor_si512(z1, _mm512_srli_epi64(z1, 31)));
  }
  const uint64_t s = uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1)));
  return s + sum_scalar(p + 8 * j, num_bytes - 8 * j, word_offset + j, seed);
}
#endif  // PXH64_HOST_X86

HostIsa best_supported() {
  if (host_isa_supported(HostIsa::kAvx512)) return HostIsa::kAvx512;
  if (host_isa_supported(HostIsa::kAvx2)) return HostIsa::kAvx2;
  return HostIsa::kScalar;
}

HostIsa read_isa() {
  const char* text = std::getenv("PYXFER_HOST_HASH_ISA");
  if (text == nullptr || *text == '\0' || std::string(text) == "auto") return best_supported();
  for (HostIsa isa : {HostIsa::kScalar, HostIsa::kAvx2, HostIsa::kAvx512}) {
    if (std::string(text) != host_isa_name(isa)) continue;
    TORCH_CHECK(host_isa_supported(isa), "PYXFER_HOST_HASH_ISA is '", text, "', which this CPU does not run; it runs ",
                host_isa_supported(HostIsa::kAvx2) ? "scalar and avx2" : "scalar only",
                " (unset it or say 'auto' for the best)");
    return isa;
  }
  TORCH_CHECK(false, "PYXFER_HOST_HASH_ISA must be 'auto', 'scalar', 'avx2' or 'avx512', got '", text, "'");
}

}  // namespace

const char* host_isa_name(HostIsa isa) {
  switch (isa) {
    case HostIsa::kAvx512: return "avx512";
    case HostIsa::kAvx2: return "avx2";
    case HostIsa::kScalar: break;
  }
  return "scalar";
}

bool host_isa_supported(HostIsa isa) {
#if PXH64_HOST_X86
  __builtin_cpu_init();  // NOTE: may run before the library's static initializers
  switch (isa) {
    case HostIsa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    case HostIsa::kAvx2: return __builtin_cpu_supports("avx2");
    case HostIsa::kScalar: return true;
  }
  return false;
#else
  return isa == HostIsa::kScalar;
#endif
}

HostIsa host_hash_isa() {
  static const HostIsa isa = read_isa();  // a throwing initializer is tried again by the next call
  return isa;
}

uint64_t pxh64_host_sum(const uint8_t* data, uint64_t num_bytes, uint64_t word_offset, uint64_t seed) {
#if PXH64_HOST_X86
  const HostIsa isa = host_hash_isa();
  if (isa == HostIsa::kAvx512) return sum_avx512(data, num_bytes, word_offset, seed);
  if (isa == HostIsa::kAvx2) return sum_avx2(data, num_bytes, word_offset, seed);
#endif
  return sum_scalar(data, num_bytes, word_offset, seed);
}

}  // namespace pyxfer
