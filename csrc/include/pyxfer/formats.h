// Quantized formats: element encodings, scale rules and buffer layouts
// (docs/specs/quantized-formats.md §1-§5), written once for the CPU reference and the CUDA kernels. Torch-free.
//
// Arithmetic is fp32 with round-to-nearest-even, one operation at a time: every product goes through
// mul_rn() so that nvcc cannot contract it into an FMA (which would round once instead of twice and
// break CPU == GPU bit equality). Divisions are IEEE (nvcc's default -prec-div=true).
#pragma once

#include <stdint.h>
#include <string.h>

#include "pyxfer/host_device.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace pyxfer {
namespace fmt {

// Block lengths (elements sharing one scale).
constexpr int kFp8BlockLen = 128;  // FP8 block scaling: 1x128 segments of a row, or 128x128 tiles
constexpr int kMxfp8BlockLen = 32;
constexpr int kNvfp4BlockLen = 16;

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kE2M1Max = 6.0f;
constexpr float kFloatMax = 3.40282346638528859812e+38f;
constexpr float kBf16Max = 3.38953138925153547590e+38f;  // 0x1.FEp127
constexpr float kHalfMax = 65504.0f;

// Which FP8 encoding a buffer holds (the elements of FP8 block and MXFP8 tensors).
enum Fp8Kind : int { kE4M3 = 0, kE5M2 = 1 };

PYXFER_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

PYXFER_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

PYXFER_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

PYXFER_HOST_DEVICE bool is_nan(float f) { return (float_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
PYXFER_HOST_DEVICE bool is_inf(float f) { return (float_bits(f) & 0x7FFFFFFFu) == 0x7F800000u; }
PYXFER_HOST_DEVICE float abs_f(float f) { return bits_float(float_bits(f) & 0x7FFFFFFFu); }
// NaN-dropping max, like CUDA fmaxf (FP8-block amax ignores NaN elements).
PYXFER_HOST_DEVICE float max_f(float a, float b) { return is_nan(a) ? b : (is_nan(b) ? a : (a > b ? a : b)); }
PYXFER_HOST_DEVICE float min_f(float a, float b) { return a < b ? a : b; }

// Round to the nearest integer, ties to even, for 0 <= v < 2^22 (the FP8 subnormal ranges).
PYXFER_HOST_DEVICE float round_even_small(float v) {
  const float kMagic = 8388608.0f;  // 2^23: adding it drops the fraction with the FPU's RNE
#if defined(__CUDA_ARCH__)
  return __fsub_rn(__fadd_rn(v, kMagic), kMagic);
#else
  volatile float t = v + kMagic;  // volatile: no reassociation by the host compiler
  return t - kMagic;
#endif
}

// ---- FP8 (OFP8 E4M3 / E5M2): round to nearest even, saturating to +-max (also +-Inf); NaN -> 0x7F.
PYXFER_HOST_DEVICE uint8_t encode_fp8_sw(float x, Fp8Kind kind) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  const int mant_bits = kind == kE4M3 ? 3 : 2;
  const int bias = kind == kE4M3 ? 7 : 15;
  const uint8_t max_code = kind == kE4M3 ? 0x7E : 0x7B;
  if (bits_float(a) >= (kind == kE4M3 ? kE4M3Max : kE5M2Max)) return sign | max_code;
  const int min_normal_exp = 1 - bias;  // -6 or -14
  if (a < uint32_t(127 + min_normal_exp) << 23) {
    // Subnormal range: code = round(|x| / 2^(min_normal_exp - mant_bits)), 2^mant_bits = min normal.
    const float steps = mul_rn(bits_float(a), bits_float(uint32_t(127 - min_normal_exp + mant_bits) << 23));
    return sign | uint8_t(round_even_small(steps));
  }
  const int drop = 23 - mant_bits;
  a += ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u);  // round the mantissa to mant_bits, ties to even
  const uint32_t code = ((((a >> 23) - 127u + uint32_t(bias)) << mant_bits) | ((a >> drop) & ((1u << mant_bits) - 1u)));
  return sign | uint8_t(code > max_code ? max_code : code);
}

// The conversion every quantize kernel uses: the hardware's cvt.rn.satfinite on SM 89+ (two per
// instruction in the vector forms), the bit-exact software path elsewhere. NaN is kept out of the
// bit-exact contract (the hardware's NaN sign is not specified).
PYXFER_HOST_DEVICE uint8_t encode_fp8(float x, Fp8Kind kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind == kE4M3 ? __NV_E4M3 : __NV_E5M2));
#else
  return encode_fp8_sw(x, kind);
#endif
}

PYXFER_HOST_DEVICE float decode_fp8(uint8_t code, Fp8Kind kind) {
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  const int mant_bits = kind == kE4M3 ? 3 : 2;
  const int bias = kind == kE4M3 ? 7 : 15;
  const uint32_t e = (code & 0x7Fu) >> mant_bits;
  const uint32_t m = code & ((1u << mant_bits) - 1u);
  if (kind == kE4M3 && (code & 0x7Fu) == 0x7Fu) return bits_float(0x7FC00000u);
  if (kind == kE5M2 && e == 31) return bits_float(sign | (m == 0 ? 0x7F800000u : 0x7FC00000u));
  if (e == 0) {  // subnormal: m * 2^(1 - bias - mant_bits), exact
    const float v = mul_rn(float(m), bits_float(uint32_t(127 + 1 - bias - mant_bits) << 23));
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((e + uint32_t(127 - bias)) << 23) | (m << (23 - mant_bits)));
}

// ---- E2M1 (FP4): codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign. RNE, saturating; NaN -> +6.
PYXFER_HOST_DEVICE uint8_t encode_e2m1(float x) {
  if (is_nan(x)) return 0x7;
  const uint8_t sign = (float_bits(x) >> 31) ? 0x8 : 0x0;
  const float a = abs_f(x);
  // Ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  uint8_t code;
  if (a <= 0.25f) code = 0;
  else if (a < 0.75f) code = 1;
  else if (a <= 1.25f) code = 2;
  else if (a < 1.75f) code = 3;
  else if (a <= 2.5f) code = 4;
  else if (a < 3.5f) code = 5;
  else if (a <= 5.0f) code = 6;
  else code = 7;
  return sign | code;
}

PYXFER_HOST_DEVICE float decode_e2m1(uint8_t code) {
  const uint32_t magnitude = code & 0x7u;
  // 0, .5, 1, 1.5 are m/2; from code 4 on: (1 + m/2) * 2^(e - 1) with e = code >> 1.
  const float v = magnitude < 2 ? 0.5f * float(magnitude)
                                : mul_rn(1.0f + 0.5f * float(magnitude & 1u), float(1u << ((magnitude >> 1) - 1u)));
  return (code & 0x8u) ? -v : v;
}

// ---- E8M0 (MX block scale): a biased exponent, 0x00 = 2^-127, 0xFF = NaN, no zero.
// TE's rule rounds UP (cvt.rp.satfinite.ue8m0): e = clamp(ceil(log2(v)), -127, 127) + 127.
PYXFER_HOST_DEVICE uint8_t e8m0_round_up(float v) {
  if (is_nan(v)) return 0xFF;
  if (is_inf(v)) return 0xFE;
  if (v == 0.0f) return 0x00;
  const uint32_t u = float_bits(v);
  uint32_t exponent = (u >> 23) & 0xFFu;
  const uint32_t mant = u & 0x7FFFFFu;
  if (mant > 0 && exponent != 0xFE && !(exponent == 0 && mant <= 0x400000u)) exponent += 1;
  return uint8_t(exponent);
}

PYXFER_HOST_DEVICE float e8m0_value(uint8_t e) {  // 2^(e - 127), the decode factor
  if (e == 0xFF) return bits_float(0x7FC00000u);
  if (e == 0) return bits_float(0x00400000u);
  return bits_float(uint32_t(e) << 23);
}

PYXFER_HOST_DEVICE float e8m0_reciprocal(uint8_t e) {  // 2^(127 - e), the quantize multiplier
  if (e == 0xFF) return bits_float(0x7FC00000u);
  if (e == 0xFE) return bits_float(0x00400000u);
  return bits_float(uint32_t(254 - e) << 23);
}

// ---- FP8 block scaling (§2.3): scale = fp8_max / amax, optionally rounded down to a power of two.
// `value_for_inf` replaces an overflowing scale: the max finite value of the input dtype.
PYXFER_HOST_DEVICE float fp8_block_scale(float amax, float fp8_max, bool pow2, float epsilon, float value_for_inf) {
  if (amax < epsilon) amax = epsilon;
  if (is_inf(amax) || is_nan(amax) || amax == 0.0f) return 1.0f;
  float scale = fp8_max / amax;
  if (is_inf(scale)) scale = value_for_inf;
  if (pow2) scale = bits_float(float_bits(scale) & 0xFF800000u);
  return scale;
}

// ---- MXFP8 (§3.3): the E8M0 exponent of a 1x32 block from its amax.
PYXFER_HOST_DEVICE uint8_t mxfp8_scale(float amax, float fp8_max) {
  const float rcp = fp8_max == kE4M3Max ? 1.0f / kE4M3Max : 1.0f / kE5M2Max;
  return e8m0_round_up(mul_rn(amax, rcp));
}

// ---- NVFP4 (§4.3): two-level scaling with the per-tensor global amax.
PYXFER_HOST_DEVICE float nvfp4_encode_scale(float global_amax) {  // S_enc
  float s = global_amax == 0.0f ? bits_float(0x7F800000u) : (kE4M3Max * kE2M1Max) / global_amax;
  s = min_f(s, kFloatMax);
  return (global_amax == 0.0f || s == 0.0f) ? 1.0f : s;
}

struct Nvfp4Block {
  uint8_t scale;      // E4M3 byte stored in *_scale_inv
  float multiplier;   // applied to each element before the E2M1 conversion
};

// The multiplier of a block from its decoded E4M3 scale: a function of the scale byte alone (for one
// s_dec), so that the GPU kernels can take it from a table of every byte.
PYXFER_HOST_DEVICE float nvfp4_multiplier(float decoded_scale, float s_dec) {
  const float denom = mul_rn(decoded_scale, s_dec);
  return denom == 0.0f ? kFloatMax : min_f(1.0f / denom, kFloatMax);
}

// s_enc = nvfp4_encode_scale(A), s_dec = fl32(1 / s_enc) computed in double (TE's generic kernel).
PYXFER_HOST_DEVICE Nvfp4Block nvfp4_block(float block_amax, float s_enc, float s_dec) {
  const float kOneSixth = float(1.0 / 6.0);
  const float s_dec_b = min_f(mul_rn(block_amax, mul_rn(s_enc, kOneSixth)), kFloatMax);
  Nvfp4Block b;
  b.scale = encode_fp8_sw(s_dec_b, kE4M3);
  b.multiplier = nvfp4_multiplier(decode_fp8(b.scale, kE4M3), s_dec);
  return b;
}

// Decode factor of an NVFP4 block: RN(RN(s8 * A) * fl32(1 / (6 * 448))).
PYXFER_HOST_DEVICE float nvfp4_decode_factor(uint8_t scale, float global_amax) {
  const float kInvRange = float(1.0 / (6.0 * 448.0));
  return mul_rn(mul_rn(decode_fp8(scale, kE4M3), global_amax), kInvRange);
}

// ---- Layouts (§2.2, §3.2, §4.2). M = product of the leading dims, K = last dim.
PYXFER_HOST_DEVICE int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
PYXFER_HOST_DEVICE int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }

// A scale buffer's shape (rows, cols) and the part a quantize writes, [0, used_rows) x [0, used_cols):
// the rest is padding (zero).
struct ScaleShape {
  int64_t rows, cols, used_rows, used_cols;
};

// FP8 block 1x128: rowwise [cdiv(K,128), rup(M,4)] ("GEMM ready": M is the fast axis),
// columnwise [cdiv(M,128), rup(K,4)]. 128x128: rowwise [cdiv(M,128), rup(cdiv(K,128),4)],
// columnwise [cdiv(K,128), rup(cdiv(M,128),4)]. fp32 entries.
PYXFER_HOST_DEVICE ScaleShape fp8_block_scale_shape(int64_t m, int64_t k, int block_dim, bool columnwise) {
  const int64_t mb = cdiv(m, kFp8BlockLen), kb = cdiv(k, kFp8BlockLen);
  if (block_dim == 1) return columnwise ? ScaleShape{mb, round_up(k, 4), mb, k} : ScaleShape{kb, round_up(m, 4), kb, m};
  return columnwise ? ScaleShape{kb, round_up(mb, 4), kb, mb} : ScaleShape{mb, round_up(kb, 4), mb, kb};
}

// MXFP8 compact: rowwise [rup(M,128), rup(K/32,4)] ([m, kb]); columnwise [rup(M/32,4), rup(K,128)] ([mb, k]).
PYXFER_HOST_DEVICE ScaleShape mxfp8_scale_shape(int64_t m, int64_t k, bool columnwise) {
  return columnwise ? ScaleShape{round_up(m / kMxfp8BlockLen, 4), round_up(k, 128), m / kMxfp8BlockLen, k}
                    : ScaleShape{round_up(m, 128), round_up(k / kMxfp8BlockLen, 4), m, k / kMxfp8BlockLen};
}

// NVFP4 compact: rowwise [rup(M,128), rup(K/16,4)] ([m, kb]); columnwise [rup(K,128), rup(M/16,4)] ([k, mb]).
PYXFER_HOST_DEVICE ScaleShape nvfp4_scale_shape(int64_t m, int64_t k, bool columnwise) {
  return columnwise ? ScaleShape{round_up(k, 128), round_up(m / kNvfp4BlockLen, 4), k, m / kNvfp4BlockLen}
                    : ScaleShape{round_up(m, 128), round_up(k / kNvfp4BlockLen, 4), m, k / kNvfp4BlockLen};
}

}  // namespace fmt
}  // namespace pyxfer
