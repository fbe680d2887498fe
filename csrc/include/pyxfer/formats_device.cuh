// Device helpers shared by the quantized-format kernels (formats_quantize.cu, formats_dequantize.cu):
// the format enum, the tile geometry, the high-precision element types and the FP8 pair decode.
// Device code only (include from .cu files); torch-free. Every conversion and scale rule comes from
// pyxfer/formats.h, so the kernels' results are bit-identical to the CPU reference
// (csrc/cpu/formats_cpu.cpp).
// NOTE: every product that formats.h rounds on its own goes through fmt::mul_rn (no FMA contraction).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/formats.h"

namespace pyxfer {
namespace formats_device {

using fmt::Fp8Kind;

// The quantized format a kernel is specialized for (FP8 block scaling 1x128 / 128x128, MXFP8, NVFP4).
enum class Fmt { kFp8Block1d, kFp8Block2d, kMxfp8, kNvfp4 };

constexpr int kThreads = 256;
constexpr int kTile = 128;  // quantize / transposed-dequantize tiles are 128 x 128 elements

// ---------------------------------------------------------------------------------------------------
// High-precision element types: raw bits travel in 16-byte vectors (uint4).

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

struct F32 {
  using Raw = float;
  static constexpr int kVec = 4;  // elements per 16 bytes
  static constexpr bool kPacked = false;  // no two-values-per-instruction max (see packed_max)
  __device__ static float get(const uint4& v, int j) { return __uint_as_float(word_of(v, j)); }
  __device__ static uint32_t raw_bits(const void* p, int64_t i) {
    return __float_as_uint(static_cast<const float*>(p)[i]);
  }
};

struct Bf16 {
  static constexpr int kVec = 8;
  static constexpr bool kPacked = true;
  __device__ static float from_bits(uint32_t b) { return __uint_as_float(b << 16); }
  __device__ static float get(const uint4& v, int j) { return from_bits((word_of(v, j >> 1) >> (16 * (j & 1))) & 0xFFFFu); }
  __device__ static uint32_t raw_bits(const void* p, int64_t i) { return static_cast<const uint16_t*>(p)[i]; }
  __device__ static uint16_t to_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
  // to_bits(lo) | to_bits(hi) << 16 in one packed conversion (same RNE rounding).
  __device__ static uint32_t to_bits2(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return uint32_t(__bfloat16_as_ushort(h.x)) | uint32_t(__bfloat16_as_ushort(h.y)) << 16;
  }
};

struct F16 {
  static constexpr int kVec = 8;
  static constexpr bool kPacked = true;
  __device__ static float from_bits(uint32_t b) { return __half2float(__ushort_as_half(static_cast<unsigned short>(b))); }
  __device__ static float get(const uint4& v, int j) { return from_bits((word_of(v, j >> 1) >> (16 * (j & 1))) & 0xFFFFu); }
  __device__ static uint32_t raw_bits(const void* p, int64_t i) { return static_cast<const uint16_t*>(p)[i]; }
  __device__ static uint16_t to_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }
  __device__ static uint32_t to_bits2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return uint32_t(__half_as_ushort(h.x)) | uint32_t(__half_as_ushort(h.y)) << 16;
  }
};

// Two FP8 codes (low byte first) to floats. Exact: every E4M3 / E5M2 value is an fp16 value.
__device__ __forceinline__ float2 decode_fp8x2(uint32_t pair, Fp8Kind kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu),
                                                    kind == fmt::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return make_float2(__half2float(__ushort_as_half(h.x)), __half2float(__ushort_as_half(h.y)));
#else
  return make_float2(fmt::decode_fp8(uint8_t(pair), kind), fmt::decode_fp8(uint8_t(pair >> 8), kind));
#endif
}

__device__ __forceinline__ float decode_fp8_one(uint32_t code, Fp8Kind kind) { return decode_fp8x2(code & 0xFFu, kind).x; }

// Swizzle of a transposed shared tile of kUnits units (words or 16-byte units) per row: row c keeps its
// units XOR-permuted by (c / 4) so that lanes reading or writing the same unit of rows 4 apart (quantize:
// words of different rows; transposed dequantize: 16-byte units of 8 rows per quarter warp) hit
// different banks.
template <int kUnits>
__device__ __forceinline__ int swizzle(int c) { return (c >> 2) & (kUnits - 1); }

}  // namespace formats_device
}  // namespace pyxfer
