// Quantize kernels of the quantized formats (FP8 block 1x128 and 128x128, MXFP8, NVFP4) and their
// launchers (pyxfer/formats_launch.h). Shared device helpers: pyxfer/formats_device.cuh.
//
// Quantize: one CTA (256 threads) per 128x128 tile of the [M, K] input, read once with 16-byte loads
// into registers (64 values per thread), producing the rowwise and the columnwise outputs in the same
// pass; the tiles wholly inside the input launch apart from the edge tiles, without bounds checks.
// Thread layout of a tile: warp w owns rows [16w, 16w+16); a 16-byte vector holds V = 4 (fp32) or 8
// (bf16/fp16) consecutive columns, so 128/V lanes cover a row; with V = 8 the two half-warps take
// rows [16w, 16w+8) and [16w+8, 16w+16). Each thread therefore holds NI = 64/V consecutive rows of V
// consecutive columns: row blocks (along K) reduce over lanes with shuffles, column blocks (along M)
// over NI rows in registers and then over row groups through shared memory (16-bit inputs take their
// |x| maxima on the packed words, two per instruction: packed_max). Transposed
// columnwise outputs (FP8 block, NVFP4) go through a byte tile in shared memory and leave as coalesced
// rows; row-major FP8 codes leave as words (encode_fp8_words).
// NVFP4 has no E2M1 conversion instruction below SM 100, so its per-element work is kept small: the
// code comes from three rounded lines (e2m1_code_bits), and each block's scale is derived once (the
// lanes of a rowwise block split that work; column blocks are derived once per CTA in shared memory,
// their multipliers looked up in a per-CTA table of the 256 scale bytes); the clamp to 6 is skipped
// where no block can reach 7 (kUnclampedBound).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "pyxfer/formats.h"
#include "pyxfer/formats_device.cuh"
#include "pyxfer/formats_launch.h"

namespace pyxfer {
namespace {

using formats_device::Bf16;
using formats_device::decode_fp8_one;
using formats_device::F16;
using formats_device::F32;
using formats_device::Fmt;
using formats_device::Fp8Kind;
using formats_device::kThreads;
using formats_device::kTile;
using formats_device::swizzle;
using formats_device::word_of;

constexpr int kWarps = kThreads / 32;

// 16-bit inputs (In::kPacked): |x| maxima are taken on the packed words, two values per instruction
// (abs2: the sign bits cleared; packed_max: max.bf16x2 / max.f16x2, which drop a NaN operand as fmaxf
// does and give a NaN only when both are; kAbs: max.xorsign.abs, |a| and |b| taken by the instruction,
// the sign the XOR of theirs, SM 86+). The max of two values converts to fp32 exactly, so the amax is
// the same; callers finish with fmaxf(a, 0) so that an all-NaN group gives +0, as the fp32 chain from
// +0 does.
__device__ __forceinline__ uint32_t abs2(uint32_t w) { return w & 0x7FFF7FFFu; }

template <typename In, bool kAbs = false>
__device__ __forceinline__ uint32_t packed_max(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same<In, Bf16>::value && kAbs) asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else if constexpr (std::is_same<In, Bf16>::value) asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else if constexpr (kAbs) asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// max(|a|, |b|) per half as packed_max<In, true>, but a NaN operand gives a NaN (max.NaN; the same
// bits when neither is one). The sign bits are unspecified: callers clear them (abs2) at the end.
template <typename In>
__device__ __forceinline__ uint32_t packed_abs_max_nan(uint32_t a, uint32_t b) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
  if constexpr (std::is_same<In, Bf16>::value) asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  if constexpr (std::is_same<In, Bf16>::value) asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(abs2(a)), "r"(abs2(b)));
  else asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(abs2(a)), "r"(abs2(b)));
#endif
  return d;
}

// fmaxf that returns a NaN when either operand is one (max.NaN.f32; |x| operands fold into it).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// The V values of row `row`, columns [col, col + V) of x [m, k] as one 16-byte vector, loaded element by
// element (x not 16-byte aligned, or k % V != 0); zeros outside the matrix.
template <typename In>
__device__ __forceinline__ uint4 load_vector(const void* x, int64_t row, int64_t col, int64_t m, int64_t k) {
  constexpr int V = In::kVec;
  if (row >= m) return make_uint4(0, 0, 0, 0);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (col + j < k) {
      const uint32_t bits = In::raw_bits(x, row * k + col + j);
      if (V == 4) w[j & 3] = bits;
      else w[(j >> 1) & 3] |= bits << (16 * (j & 1));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---------------------------------------------------------------------------------------------------
// Quantize.
struct QuantParams {
  const void* x;
  int64_t m, k, tiles_k;
  Fp8Kind kind;
  bool pow2;
  float epsilon, max_finite, fp8_max;
  const float* global_amax;  // NVFP4
  uint8_t* row_data;
  void* row_scale;
  int64_t row_scale_cols;
  uint8_t* col_data;
  void* col_scale;
  int64_t col_scale_cols;
};

// NOTE: the amax reductions below use fmaxf (one FMNMX) instead of fmt::max_f: both drop a NaN
// operand, and every operand here is non-negative (|x|, or a max of those starting at +0), where the
// two agree bit for bit (no signed zeros to order). On fp32 inputs (16-bit ones take packed maxima),
// |x| is fmt::abs_f, or fabsf in the NaN-propagating chains (the same bits, as a free operand
// modifier); those chains (fmax_nan, packed_abs_max_nan) only test for a NaN (column_abs_max).
__device__ __forceinline__ float shfl_max(float v, int offset) {
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
}

// The amax of r[] as the fmaxf chain from +0 computes it, chained from |r[0]| instead (a last fmaxf
// with +0 maps an all-NaN row to 0): MXFP8's row chain then shares no subexpression with its column
// amax, whose first step the compiler would otherwise compute before the barrier and spill across it.
template <int V>
__device__ __forceinline__ float row_abs_max(const float (&r)[V]) {
  float a = fmt::abs_f(r[0]);
#pragma unroll
  for (int j = 1; j < V; ++j) a = fmaxf(a, fmt::abs_f(r[j]));
  return fmaxf(a, 0.0f);
}

// The same from the packed words of a 16-bit row vector (In::kPacked). On SM 86+ with
// max.xorsign.abs, which also keeps the compiler from sharing abs2 words with the column amax,
// computed before the barrier (they would be live, and spilled, across it).
template <typename In>
__device__ __forceinline__ float row_abs_max_packed(const uint4& raw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
  const uint32_t m = abs2(packed_max<In, true>(packed_max<In, true>(raw.x, raw.y), packed_max<In, true>(raw.z, raw.w)));
#else
  const uint32_t m = packed_max<In>(packed_max<In>(abs2(raw.x), abs2(raw.y)), packed_max<In>(abs2(raw.z), abs2(raw.w)));
#endif
  return fmaxf(fmaxf(In::from_bits(m & 0xFFFFu), In::from_bits(m >> 16)), 0.0f);
}

// fmt::encode_e2m1 of c (|c| <= 6, the caller clamps) as the fp32 bits 0x4B000000 + magnitude code,
// bit-identical for all inputs (checked exhaustively on the host, with the clamp and the packing
// below, against fmt::encode_e2m1 for all 2^32 floats). On [0, 6] the code is RNE of the lowest of
// three lines: 2|c| on [0, 2], |c| + 2 on [2, 4], |c| / 2 + 4 on [4, 6] (the E2M1 grid points map to
// the integers, its rounding thresholds to the halves, and min commutes with monotonic rounding). Each
// line is rounded to an integer, ties to even (= the even code), by adding 2^23 in one FFMA / FADD
// (|c| is a free operand modifier); the min of the bits is one VIMNMX3 on SM 90.
__device__ __forceinline__ uint32_t e2m1_code_bits(float c) {
  const float a = fabsf(c);
  const uint32_t r1 = __float_as_uint(fmaf(a, 2.0f, 8388608.0f));
  const uint32_t r2 = __float_as_uint(__fadd_rn(a, 8388610.0f));
  const uint32_t r3 = __float_as_uint(fmaf(a, 0.5f, 8388612.0f));
  return min(min(r1, r2), r3);
}

// What the 0x4B000000 parts of N codes add to the packed word below (mod 2^32).
__host__ __device__ constexpr uint32_t e2m1_pack_bias(int n) { return n == 0 ? 0u : (0x4B000000u << (4 * (n - 1))) + e2m1_pack_bias(n - 1); }

// N (4 or 8) fmt::encode_e2m1 codes of y[] packed into nibbles, element j in bits [4j, 4j + 4). The
// magnitude is min(|y|, 6), which maps NaN to 6 (fminf drops a NaN operand), or with !kClamp |y|
// itself, for callers that know every y to be a number below kUnclampedBound; the sign bit of y is the
// code's bit 3, and a NaN y has it clear: y is always a product (fmt::mul_rn), and the GPU's fp32
// arithmetic returns the one canonical NaN, 0x7FFFFFFF, whatever the operands' NaN signs (so a NaN
// encodes as +6, 0x7, as fmt::encode_e2m1 does; the GPU tests feed negative NaNs). Checked on the host
// against fmt::encode_e2m1 for all 2^32 floats y. Per element: 1 FMNMX, 3 FFMA/FADD, 1 min, and two
// packing steps, each linear mod 2^32 (acc << 1 | sign as a funnel shift, acc * 8 + bits as one
// IMAD), whose 0x4B000000 parts sum to a constant subtracted once.
template <int N, bool kClamp>
__device__ __forceinline__ uint32_t pack_e2m1(const float (&y)[N]) {
  uint32_t acc = 0;
#pragma unroll
  for (int j = N - 1; j >= 0; --j) {
    acc = __funnelshift_l(__float_as_uint(y[j]), acc, 1);
    acc = acc * 8u + e2m1_code_bits(kClamp ? fminf(fabsf(y[j]), fmt::kE2M1Max) : y[j]);
  }
  constexpr uint32_t kBias = e2m1_pack_bias(N);
  return acc - kBias;
}

// Below 7 the clamp changes no code: on [6, 7) the lowest line, |c| / 2 + 4, rounds to 7 as 6 does
// (checked on the host with the rest, for all 2^32 floats). A block with RN(amax * multiplier) below
// it has every |y| = RN(|x| * multiplier) below it too (rounding is monotonic), if x holds no NaN.
constexpr float kUnclampedBound = 7.0f;

// Two fmt::encode_fp8 results (lo in the low byte) from one conversion instruction on SM 89+: the
// same cvt.rn.satfinite.*x2.f32 that fmt::encode_fp8 issues with a zero in the other half.
__device__ __forceinline__ uint32_t encode_fp8x2(float lo, float hi, Fp8Kind kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, kind == fmt::kE4M3 ? __NV_E4M3 : __NV_E5M2));
#else
  return uint32_t(fmt::encode_fp8(lo, kind)) | uint32_t(fmt::encode_fp8(hi, kind)) << 8;
#endif
}


// The per-tensor factors of NVFP4 from the global amax: s_enc_sixth = RN(S_enc * fl32(1/6)), which
// fmt::nvfp4_block computes for every block, and s_dec = fl32(1 / S_enc) computed in double.
struct Nvfp4TensorScales {
  float s_enc_sixth, s_dec;
};
__device__ __forceinline__ Nvfp4TensorScales nvfp4_tensor_scales(float global_amax) {
  const float s_enc = fmt::nvfp4_encode_scale(global_amax);
  return {fmt::mul_rn(s_enc, float(1.0 / 6.0)), static_cast<float>(1.0 / static_cast<double>(s_enc))};
}

// fmt::nvfp4_multiplier of a scale byte, decoded in hardware on SM 89+ (decode_fp8x2; exact).
__device__ __forceinline__ float nvfp4_multiplier_fast(uint8_t scale, float s_dec) {
  return fmt::nvfp4_multiplier(decode_fp8_one(scale, fmt::kE4M3), s_dec);
}

// fmt::nvfp4_block with the E4M3 conversions in hardware on SM 89+ (fmt::encode_fp8,
// nvfp4_multiplier_fast), bit for bit: the hardware's cvt.rn.satfinite equals fmt::encode_fp8_sw for
// every non-NaN input, and s_dec_b is never NaN (min_f(v, FLT_MAX) returns FLT_MAX when v is NaN).
// The multiplier comes from `multiplier_of` where the CTA filled that table (nvfp4_multiplier_fast of
// every byte: one division per byte instead of one per block; bytes from 0x80 on are the scales of a
// negative global amax given as a tensor, whose value is not checked), else from a division here.
constexpr int kNvfp4Scales = 256;
__device__ __forceinline__ fmt::Nvfp4Block nvfp4_block_fast(float block_amax, const Nvfp4TensorScales& t,
                                                             const float* multiplier_of = nullptr) {
  const float s_dec_b = fmt::min_f(fmt::mul_rn(block_amax, t.s_enc_sixth), fmt::kFloatMax);
  fmt::Nvfp4Block b;
  b.scale = fmt::encode_fp8(s_dec_b, fmt::kE4M3);
  b.multiplier = multiplier_of != nullptr ? multiplier_of[b.scale] : nvfp4_multiplier_fast(b.scale, t.s_dec);
  return b;
}

// x, with its value hidden from the optimizer: addresses derived from it stay "base + offset" (one
// 64-bit add per row) instead of being re-derived from the row index with 64-bit multiplies.
template <typename T>
__device__ __forceinline__ T* opaque(T* x) {
  asm("" : "+l"(x));
  return x;
}

// The FP8 codes of y[0..V) (V = 4 or 8) as V / 4 words, code j in byte j % 4 of word j / 4: two
// conversions of two values each, joined by one byte permute.
template <int V>
__device__ __forceinline__ void encode_fp8_words(const float (&y)[V], Fp8Kind kind, uint32_t (&w)[V / 4]) {
#pragma unroll
  for (int q = 0; q < V / 4; ++q)
    w[q] = __byte_perm(encode_fp8x2(y[4 * q], y[4 * q + 1], kind), encode_fp8x2(y[4 * q + 2], y[4 * q + 3], kind), 0x5410);
}

// Stores the first `valid` of V bytes (encode_fp8_words) at dst; one store when `vec` (dst V-aligned)
// and all V are valid.
template <int V>
__device__ __forceinline__ void store_fp8_words(uint8_t* dst, const uint32_t (&w)[V / 4], int valid, bool vec) {
  if (vec && valid == V) {
    if constexpr (V == 4) *reinterpret_cast<uint32_t*>(dst) = w[0];
    else *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[V / 4 - 1]);
    return;
  }
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (j < valid) dst[j] = uint8_t(w[j / 4] >> (8 * (j % 4)));
}

// The |x| maxima of the V columns over the NI rows of raw / v (zeros outside the matrix do not change
// an amax): fmaxf chains from +0 (16-bit inputs on the packed words, packed_max), or with kNan the
// same chains propagating NaN (max.NaN: equal bits when there is none, and as cheap, 16-bit inputs
// taking |x| in the instruction).
template <typename In, bool kNan, int NI, int V>
__device__ __forceinline__ void column_abs_max(const uint4 (&raw)[NI], const float (&v)[NI][V], float (&cpart)[V]) {
  if constexpr (In::kPacked) {
#pragma unroll
    for (int w = 0; w < V / 2; ++w) {
      uint32_t m = kNan ? word_of(raw[0], w) : abs2(word_of(raw[0], w));
#pragma unroll
      for (int i = 1; i < NI; ++i) m = kNan ? packed_abs_max_nan<In>(m, word_of(raw[i], w)) : packed_max<In>(m, abs2(word_of(raw[i], w)));
      if (kNan) m = abs2(m);  // the sign of an xorsign chain is the XOR of its operands'
      cpart[2 * w] = kNan ? In::from_bits(m & 0xFFFFu) : fmaxf(In::from_bits(m & 0xFFFFu), 0.0f);
      cpart[2 * w + 1] = kNan ? In::from_bits(m >> 16) : fmaxf(In::from_bits(m >> 16), 0.0f);
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      cpart[j] = kNan ? fabsf(v[0][j]) : 0.0f;
#pragma unroll
      for (int i = kNan ? 1 : 0; i < NI; ++i) cpart[j] = kNan ? fmax_nan(cpart[j], fabsf(v[i][j])) : fmaxf(cpart[j], fmt::abs_f(v[i][j]));
    }
  }
}

// The amax of column c of a tile over kCount row groups from `first`: a column block, from the row
// groups' partial maxima in shared memory.
template <int kCount, int kGroups, int kCols>
__device__ __forceinline__ float column_block_amax(const float (&col_part)[kGroups][kCols], int first, int c) {
  float a = 0.0f;
#pragma unroll
  for (int g = 0; g < kCount; ++g) a = fmaxf(a, col_part[first + g][c]);
  return a;
}

// CTAs per SM the register budget is sized for: 3 (<= 80 registers) where that fits without spills
// on SM 80 / 90 (bf16 inputs; for MXFP8 only with 16-byte loads, its element-wise path needs more),
// else 2 (SM 100 / 120 would spill at 80). NVFP4 from bf16 with 16-byte loads on SM 90: 4 (64
// registers, no spills there; SM 80 would spill): its E2M1 encodes are issue-bound and gain from the
// extra warps, 2-6 points of the copy per usage on an H200, where FP8 block and MXFP8 lost up to 1.2
// (benchmarks/runs/N).
template <Fmt F, typename In, bool kVecOk>
constexpr int quantize_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  if (F == Fmt::kNvfp4 && std::is_same<In, Bf16>::value && kVecOk) return 4;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 1000
  return (std::is_same<In, Bf16>::value && (F != Fmt::kMxfp8 || kVecOk)) ? 3 : 2;
#else
  return 2;
#endif
}

// The tile (mt, kt) of this CTA. kInterior: one of the full_m x full_k tiles that lie wholly inside x,
// from a 2-D grid (kt = blockIdx.x, mt = m_tile0 + blockIdx.y: no 64-bit division; full_m, full_k
// unused); else one of the others, CTA blockIdx.x of a 1-D grid (m_tile0 unused): first the tiles of
// the last (partial) tile column above the last tile row, then the last (partial) tile row. full_m =
// full_k = 0 makes that list every tile.
template <bool kInterior>
__device__ __forceinline__ void quantize_tile_of(const QuantParams& p, int64_t full_m, int64_t full_k, int64_t m_tile0,
                                                 int64_t& mt, int64_t& kt) {
  if (kInterior) {
    mt = m_tile0 + blockIdx.y, kt = blockIdx.x;
    return;
  }
  int64_t b = blockIdx.x;
  const int64_t cols = p.tiles_k - full_k;  // partial tile columns: 0 or 1 (all of them when full_k = 0)
  if (cols > 0 && b < full_m * cols) {
    mt = b / cols, kt = full_k + b % cols;
    return;
  }
  b -= full_m * cols;
  mt = full_m + b / p.tiles_k, kt = b % p.tiles_k;
}

// kInterior: every CTA's tile lies wholly inside x and x takes 16-byte loads (kVecOk), so that the
// bounds checks of every load and store fold away at compile time (launched separately from the edge tiles).
template <Fmt F, typename In, bool kVecOk, bool kInterior>
__global__ void __launch_bounds__(kThreads, quantize_min_blocks<F, In, kVecOk>())
    quantize_tile_kernel(const QuantParams p, int64_t full_m, int64_t full_k, int64_t m_tile0) {
  static_assert(kVecOk || !kInterior, "interior tiles take 16-byte loads");
  constexpr int V = In::kVec;
  constexpr int kLanesPerRow = kTile / V;  // 32 or 16
  constexpr int kGroupsPerWarp = 32 / kLanesPerRow;
  constexpr int NI = 16 / kGroupsPerWarp;  // consecutive rows per thread: 16 or 8
  constexpr int kGroups = kTile / NI;      // row groups per tile: 8 or 16
  constexpr bool kFp8Block = F == Fmt::kFp8Block1d || F == Fmt::kFp8Block2d;
  constexpr int kBlock = F == Fmt::kMxfp8 ? fmt::kMxfp8BlockLen : (F == Fmt::kNvfp4 ? fmt::kNvfp4BlockLen : kTile);
  constexpr int kOutWords = F == Fmt::kNvfp4 ? 16 : 32;  // words per row of the transposed tile
  // NVFP4: a 16-element row block spans kBlockLanes lanes, each of which derives the block scales of
  // kOwnRows of the NI rows (see the rowwise part); a column block is one of kColBlocks per column.
  constexpr int kBlockLanes = F == Fmt::kNvfp4 ? kBlock / V : 1;  // 2 or 4
  constexpr int kOwnRows = NI / kBlockLanes;
  constexpr int kColBlocks = F == Fmt::kNvfp4 ? kTile / kBlock : 1;

  __shared__ __align__(16) float col_part[kGroups][kTile];
  __shared__ uint32_t out_tile[kTile * kOutWords];
  __shared__ float warp_amax[kWarps];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = warp * 16 + (lane / kLanesPerRow) * NI;  // first tile row of this thread
  const int col0 = (lane % kLanesPerRow) * V;               // first tile column of this thread
  int64_t mt, kt;
  quantize_tile_of<kInterior>(p, full_m, full_k, m_tile0, mt, kt);
  const int64_t m0 = mt * kTile, k0 = kt * kTile;
  const int64_t gc = k0 + col0;  // first global column of this thread
  const int col_valid = kInterior ? V : gc >= p.k ? 0 : (p.k - gc >= V ? V : int(p.k - gc));
  const bool rowwise = p.row_data != nullptr, columnwise = p.col_data != nullptr;
  // NVFP4 rowwise: each lane of a block derives the block scales of kOwnRows rows, from own_row0. With
  // 4 lanes per block (fp32 inputs), slot i of v holds tile row row0 + (i ^ perm), so that those rows sit
  // in slots [0, kOwnRows) on every lane (no selects on lane parity in the reductions). With 2 (kSelectRows:
  // 16-bit inputs), slot i is row i, and the two exchanges select on lane parity (16 selects per thread):
  // loads and stores then take whole rows, so that the 4-byte stores of a half warp write one row's whole
  // sectors (ncu, run L: L2 write requests of the both-usage kernel 6.2M -> 4.2M per 256 MiB with the
  // column scales below), without the 40 selects that moved permuted slots to and from rows (run M).
  constexpr bool kSelectRows = F == Fmt::kNvfp4 && kBlockLanes == 2;
  const int own_row0 = F == Fmt::kNvfp4 ? (lane % kBlockLanes) * kOwnRows : 0;
  const int perm = F == Fmt::kNvfp4 && rowwise && !kSelectRows ? own_row0 : 0;

  // This thread's rows inside the matrix: those below rows_here (row offsets from row0).
  const int rows_here = kInterior ? NI : int(p.m - (m0 + row0) < NI ? (p.m - (m0 + row0) > 0 ? p.m - (m0 + row0) : 0) : NI);
  float v[NI][V];
  uint4 raw[NI];
  {
    // One base address, a 64-bit add per row. The loads go through L2 with its default eviction policy
    // (ld.global.cg, not L1): x is read once, but loads marked evict-first (ld.global.cs) made every
    // usage slower, the transposed ones most (NVFP4 columnwise quantize at 1 GiB: 75.6% of the copy with
    // .cs, 82.7% with .cg; benchmarks/runs/M).
    if (kVecOk) {
      const int64_t stride = p.k * (16 / V);  // bytes per row of x
      const char* base = opaque(static_cast<const char*>(p.x) + (m0 + row0) * stride + gc * (16 / V));
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int r = i ^ perm;
        raw[i] = make_uint4(0, 0, 0, 0);
        if (kInterior || (r < rows_here && gc < p.k)) raw[i] = __ldcg(reinterpret_cast<const uint4*>(base + r * stride));
      }
    } else {
#pragma unroll
      for (int i = 0; i < NI; ++i) raw[i] = load_vector<In>(p.x, m0 + row0 + (i ^ perm), gc, p.m, p.k);
    }
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
      for (int j = 0; j < V; ++j) v[i][j] = In::get(raw[i], j);
  }

  // NVFP4 columnwise (and both usages): the per-tensor factors, and the multiplier of every scale byte
  // (nvfp4_table), filled while the loads are in flight and read after the barrier below. Rowwise
  // alone, 4 blocks per thread, divides per block and takes the factors after the barrier (before
  // it, and with the table, it ran 2 points of the copy slower: benchmarks/runs/L).
  __shared__ float nvfp4_table[F == Fmt::kNvfp4 ? kNvfp4Scales : 1];
  const float* nvfp4_multiplier_of = F == Fmt::kNvfp4 && columnwise ? nvfp4_table : nullptr;
  Nvfp4TensorScales nvfp4{1.0f, 1.0f};
  if (F == Fmt::kNvfp4 && columnwise) {
    nvfp4 = nvfp4_tensor_scales(*p.global_amax);
    static_assert(kNvfp4Scales <= kThreads, "one table entry per thread");
    if (threadIdx.x < kNvfp4Scales) nvfp4_table[threadIdx.x] = nvfp4_multiplier_fast(uint8_t(threadIdx.x), nvfp4.s_dec);
  }

  // Column amax over this thread's NI rows. NVFP4 columnwise takes it propagating NaN first, so that
  // it shows whether any element of this thread is a NaN; only then (rare) is it taken again dropping
  // NaN. Without a NaN, the E2M1 encodes of a tile (columnwise) or warp (rowwise, with both usages)
  // whose blocks all scale below kUnclampedBound skip their clamp (pack_e2m1).
  float cpart[V];
  bool nan_here = false;
  if (F == Fmt::kNvfp4 && columnwise) {
    column_abs_max<In, true>(raw, v, cpart);
#pragma unroll
    for (int j = 0; j < V; ++j) nan_here |= isnan(cpart[j]);
  }
  if (F != Fmt::kNvfp4 || nan_here) column_abs_max<In, false>(raw, v, cpart);
  if (F == Fmt::kFp8Block2d) {
    float a = cpart[0];
#pragma unroll
    for (int j = 1; j < V; ++j) a = fmaxf(a, cpart[j]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) a = shfl_max(a, offset);
    if (lane == 0) warp_amax[warp] = a;
  } else if (columnwise) {
#pragma unroll
    for (int j = 0; j < V; j += 4)
      *reinterpret_cast<float4*>(&col_part[row0 / NI][col0 + j]) = make_float4(cpart[j], cpart[j + 1], cpart[j + 2], cpart[j + 3]);
  }
  __syncthreads();

  float tile_scale = 1.0f;
  if (F == Fmt::kFp8Block2d) {
    float a = warp_amax[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) a = fmaxf(a, warp_amax[w]);
    tile_scale = fmt::fp8_block_scale(a, p.fp8_max, p.pow2, p.epsilon, p.max_finite);
    if (threadIdx.x == 0) {
      const float inv = 1.0f / tile_scale;  // 2-D: fp32 division (as TE's 128x128 kernel)
      if (rowwise) static_cast<float*>(p.row_scale)[mt * p.row_scale_cols + kt] = inv;
      if (columnwise) static_cast<float*>(p.col_scale)[kt * p.col_scale_cols + mt] = inv;
    }
  }

  if (F == Fmt::kNvfp4 && !columnwise) nvfp4 = nvfp4_tensor_scales(*p.global_amax);

  // ---- MXFP8 columnwise (not transposed: written row by row next to the rowwise data). The tile's
  // kTile x kMxColBlocks column blocks (kBlock rows along M) each get their scale from one thread,
  // kPerThread blocks of one column per thread, from the per-group partials; the multipliers are
  // shared through shared memory (not derived again by each of a block's row groups), and the scale
  // bytes of a block row leave from consecutive threads.
  float mx_col_multiplier[V];
  if (F == Fmt::kMxfp8 && columnwise) {
    constexpr int kMxColBlocks = kTile / kBlock;
    constexpr int kPerThread = kTile * kMxColBlocks / kThreads;
    constexpr int kGroupsPerBlock = kBlock / NI;
    __shared__ __align__(16) float mx_col_mult[kMxColBlocks][kTile];
    const int c = threadIdx.x % kTile, b0 = (threadIdx.x / kTile) * kPerThread;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const float a = column_block_amax<kGroupsPerBlock>(col_part, (b0 + u) * kGroupsPerBlock, c);
      const uint8_t e = fmt::mxfp8_scale(a, p.fp8_max);
      mx_col_mult[b0 + u][c] = fmt::e8m0_reciprocal(e);
      const int64_t block_row = m0 + (b0 + u) * kBlock;
      if (kInterior || (block_row < p.m && k0 + c < p.k))
        static_cast<uint8_t*>(p.col_scale)[(block_row / kBlock) * p.col_scale_cols + k0 + c] = e;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const float4 m4 = *reinterpret_cast<const float4*>(&mx_col_mult[row0 / kBlock][col0 + j]);
      mx_col_multiplier[j] = m4.x, mx_col_multiplier[j + 1] = m4.y, mx_col_multiplier[j + 2] = m4.z, mx_col_multiplier[j + 3] = m4.w;
    }
  }

  // ---- FP8 1-D rowwise: the kLanesPerRow lanes of a row group all hold row i's amax after the
  // shuffles; lane i of the group keeps it and derives row i's multiplier and scale once (NI <=
  // kLanesPerRow), instead of every lane doing the division for every row. Broadcast in the row loop.
  float row_multiplier = 1.0f;
  if (F == Fmt::kFp8Block1d && rowwise) {
    static_assert(NI <= kLanesPerRow, "one lane per row of the group");
    const int mine = lane % kLanesPerRow;
    float amax_mine = 0.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      float a = 0.0f;
      if constexpr (In::kPacked) {
        a = row_abs_max_packed<In>(raw[i]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) a = fmaxf(a, fmt::abs_f(v[i][j]));
      }
#pragma unroll
      for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) a = shfl_max(a, offset);
      if (mine == i) amax_mine = a;
    }
    row_multiplier = fmt::fp8_block_scale(amax_mine, p.fp8_max, p.pow2, p.epsilon, p.max_finite);
    const int64_t row = m0 + row0 + mine;
    if (mine < NI && (kInterior || row < p.m))  // 1-D: 1/scale in double (as TE's 1x128 kernel)
      static_cast<float*>(p.row_scale)[kt * p.row_scale_cols + row] = static_cast<float>(1.0 / static_cast<double>(row_multiplier));
  }

  // ---- NVFP4 rowwise. The kBlockLanes lanes of a block reduce the row amaxes with a reduce-scatter
  // (each ends with the amaxes of its own kOwnRows rows, rows own_row0 + s, in slots [0, kOwnRows)),
  // derive those blocks' scales once, and all-gather the multipliers (by slot): kOwnRows blocks per
  // lane, not NI, and fewer shuffles.
  if (F == Fmt::kNvfp4 && rowwise) {
    float amax[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      if constexpr (In::kPacked) amax[i] = row_abs_max_packed<In>(raw[i]);
      else amax[i] = row_abs_max(v[i]);
    }
    if constexpr (kSelectRows) {  // keep own rows' amaxes (into slots [0, kOwnRows)), send the partner's
      const bool upper = own_row0 != 0;  // this lane's rows are the upper kOwnRows
#pragma unroll
      for (int s = 0; s < kOwnRows; ++s) {
        const float keep = upper ? amax[kOwnRows + s] : amax[s], give = upper ? amax[s] : amax[kOwnRows + s];
        amax[s] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, give, 1));
      }
    } else {
      // Chunk c (slots [c * kOwnRows, ...)) of lane q holds the rows that the partner q ^ d keeps in its
      // chunk c ^ d; each round keeps the chunks with bit d clear and folds in the partner's other one.
#pragma unroll
      for (int d = 1; d < kBlockLanes; d *= 2)
#pragma unroll
        for (int c = 0; c < kBlockLanes; c += 2 * d)
#pragma unroll
          for (int s = 0; s < kOwnRows; ++s)
            amax[c * kOwnRows + s] = fmaxf(amax[c * kOwnRows + s], __shfl_xor_sync(0xffffffffu, amax[(c + d) * kOwnRows + s], d));
    }
    float multiplier[NI];
    // Unclamped encodes need the NaN test of the column maxima: with both usages only.
    bool unclamped = columnwise && !nan_here;
    uint8_t* scale_dst = opaque(static_cast<uint8_t*>(p.row_scale) + (m0 + row0 + own_row0) * p.row_scale_cols + gc / kBlock);
#pragma unroll
    for (int s = 0; s < kOwnRows; ++s) {
      const fmt::Nvfp4Block b = nvfp4_block_fast(amax[s], nvfp4, nvfp4_multiplier_of);
      multiplier[s] = b.multiplier;
      unclamped &= fmt::mul_rn(amax[s], b.multiplier) < kUnclampedBound;
      if (own_row0 + s < rows_here && col_valid > 0) scale_dst[s * p.row_scale_cols] = b.scale;
    }
    if constexpr (kSelectRows) {  // own rows' multipliers from slots [0, kOwnRows), the partner's beside
      const bool upper = own_row0 != 0;
#pragma unroll
      for (int s = 0; s < kOwnRows; ++s) {
        const float mine = multiplier[s], other = __shfl_xor_sync(0xffffffffu, mine, 1);
        multiplier[s] = upper ? other : mine;
        multiplier[kOwnRows + s] = upper ? mine : other;
      }
    } else {
#pragma unroll
      for (int d = kBlockLanes / 2; d >= 1; d /= 2)
#pragma unroll
        for (int c = 0; c < kBlockLanes; c += 2 * d)
#pragma unroll
          for (int s = 0; s < kOwnRows; ++s)
            multiplier[(c + d) * kOwnRows + s] = __shfl_xor_sync(0xffffffffu, multiplier[c * kOwnRows + s], d);
    }
    uint8_t* data_dst = opaque(p.row_data + (m0 + row0) * (p.k / 2) + gc / 2);
    // The warp's rows are its lanes' own blocks: one vote decides whether its encodes clamp.
    auto encode_rows = [&](auto clamp) {
      uint32_t packed[NI];  // by slot
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        float y[V];
#pragma unroll
        for (int j = 0; j < V; ++j) y[j] = fmt::mul_rn(v[i][j], multiplier[i]);
        packed[i] = pack_e2m1<V, decltype(clamp)::value>(y);
      }
#pragma unroll
      for (int i = 0; i < NI; ++i) {  // slot i: row i ^ perm
        const int r = i ^ perm;
        const uint32_t w = packed[i];
        if (r < rows_here && col_valid > 0) {
          uint8_t* dst = data_dst + r * (p.k / 2);
          if (V == 4) *reinterpret_cast<uint16_t*>(dst) = uint16_t(w);
          else *reinterpret_cast<uint32_t*>(dst) = w;
        }
      }
    };
    if (columnwise && __all_sync(0xffffffffu, unclamped)) encode_rows(std::false_type{});
    else encode_rows(std::true_type{});
  }

  // ---- MXFP8 rowwise: the kMxLanes lanes of a row block all hold the block amax of each of the NI
  // rows after the shuffles; lane q keeps those of rows [q * kOwn, q * kOwn + kOwn) and derives their
  // scales and multipliers once (not every lane for every row). Broadcast in the row loop.
  constexpr int kMxLanes = F == Fmt::kMxfp8 ? kBlock / V : 1;  // 4 or 8
  constexpr int kOwn = NI / kMxLanes;                             // 2
  float mx_row_multiplier[kOwn];
  if (F == Fmt::kMxfp8 && rowwise) {
    const int q = lane % kMxLanes;
    float own[kOwn];
#pragma unroll
    for (int s = 0; s < kOwn; ++s) own[s] = 0.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      float a;
      if constexpr (In::kPacked) a = row_abs_max_packed<In>(raw[i]);
      else a = row_abs_max(v[i]);
#pragma unroll
      for (int offset = kMxLanes / 2; offset > 0; offset >>= 1) a = shfl_max(a, offset);
      if (q == i / kOwn) own[i % kOwn] = a;
    }
    const int64_t block_col = gc - q * V;  // the row block's first column
#pragma unroll
    for (int s = 0; s < kOwn; ++s) {
      const uint8_t e = fmt::mxfp8_scale(own[s], p.fp8_max);
      mx_row_multiplier[s] = fmt::e8m0_reciprocal(e);
      const int r = q * kOwn + s;
      if (kInterior || (r < rows_here && block_col < p.k))
        static_cast<uint8_t*>(p.row_scale)[(m0 + row0 + r) * p.row_scale_cols + block_col / kBlock] = e;
    }
  }

  // ---- rowwise (FP8 block, MXFP8): blocks of kBlock elements along K = kBlock / V lanes.
  if (F != Fmt::kNvfp4 && (rowwise || (F == Fmt::kMxfp8 && columnwise))) {
    const bool vec_store = kInterior || p.k % V == 0;
    // Row i's bytes at base + i * k (a 64-bit add per row, as the loads): rowwise and MXFP8 columnwise data.
    const int64_t first = (m0 + row0) * p.k + gc;
    uint8_t* row_base = rowwise ? opaque(p.row_data + first) : nullptr;
    uint8_t* col_base = F == Fmt::kMxfp8 && columnwise ? opaque(p.col_data + first) : nullptr;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const bool valid = i < rows_here && col_valid > 0;
      if (F == Fmt::kMxfp8 && columnwise) {
        float y[V];
#pragma unroll
        for (int j = 0; j < V; ++j) y[j] = fmt::mul_rn(v[i][j], mx_col_multiplier[j]);
        uint32_t w[V / 4];
        encode_fp8_words<V>(y, p.kind, w);
        if (valid) store_fp8_words<V>(col_base + i * p.k, w, col_valid, true);
      }
      if (!rowwise) continue;
      float multiplier;
      if (F == Fmt::kMxfp8) {
        multiplier = __shfl_sync(0xffffffffu, mx_row_multiplier[i % kOwn], (lane & ~(kMxLanes - 1)) | (i / kOwn));
      } else if (F == Fmt::kFp8Block1d) {
        multiplier = __shfl_sync(0xffffffffu, row_multiplier, (lane & ~(kLanesPerRow - 1)) | i);
      } else {
        multiplier = tile_scale;
      }
      float y[V];
#pragma unroll
      for (int j = 0; j < V; ++j) y[j] = fmt::mul_rn(v[i][j], multiplier);
      uint32_t w[V / 4];
      encode_fp8_words<V>(y, p.kind, w);
      if (valid) store_fp8_words<V>(row_base + i * p.k, w, col_valid, vec_store);
    }
  }

  if (!columnwise || F == Fmt::kMxfp8) return;  // uniform across the CTA

  if constexpr (kFp8Block) {
    // Transposed FP8 bytes: tile row c = column col0 + j, words (m / 4) of 4 consecutive rows.
    float multiplier[V];
    if (F == Fmt::kFp8Block1d) {
      // One 128-row block per column: thread c < 128 reduces column c over all row groups and derives
      // its multiplier and scale once (not once per row group); the others read it from shared memory.
      __shared__ float col_multiplier[kTile];
      if (threadIdx.x < kTile) {
        const int c = threadIdx.x;
        const float a = column_block_amax<kGroups>(col_part, 0, c);
        const float mult = fmt::fp8_block_scale(a, p.fp8_max, p.pow2, p.epsilon, p.max_finite);
        col_multiplier[c] = mult;
        if (kInterior || k0 + c < p.k)
          static_cast<float*>(p.col_scale)[mt * p.col_scale_cols + k0 + c] = static_cast<float>(1.0 / static_cast<double>(mult));
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < V; ++j) multiplier[j] = col_multiplier[col0 + j];
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) multiplier[j] = tile_scale;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = col0 + j;
#pragma unroll
      for (int t = 0; t < NI / 4; ++t) {
        const uint32_t w = encode_fp8x2(fmt::mul_rn(v[4 * t][j], multiplier[j]), fmt::mul_rn(v[4 * t + 1][j], multiplier[j]), p.kind) |
                           encode_fp8x2(fmt::mul_rn(v[4 * t + 2][j], multiplier[j]), fmt::mul_rn(v[4 * t + 3][j], multiplier[j]), p.kind) << 16;
        const int q = row0 / 4 + t;
        out_tile[c * kOutWords + (q ^ swizzle<kOutWords>(c))] = w;
      }
    }
  } else if constexpr (F == Fmt::kNvfp4) {  // nibbles packed along M, tile row c = column col0 + j, words of 8 consecutive rows
    // The 128 x kColBlocks column blocks' scales, kPerThread consecutive blocks of one column per
    // thread: derived once (not by every row group of a block) and shared through shared memory.
    constexpr int kPerThread = kTile * kColBlocks / kThreads;
    constexpr int kGroupsPerBlock = kBlock / NI;
    static_assert(kPerThread * 2 == kColBlocks, "two threads per column");
    __shared__ float col_multiplier[kColBlocks][kTile];
    __shared__ uint32_t col_scales_hi[kTile];  // scale bytes of the second thread of each column
    bool unclamped = !nan_here;
    const int sc = threadIdx.x % kTile, b0 = (threadIdx.x / kTile) * kPerThread;  // column, first block
    uint32_t scales = 0;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const float a = column_block_amax<kGroupsPerBlock>(col_part, (b0 + u) * kGroupsPerBlock, sc);
      const fmt::Nvfp4Block b = nvfp4_block_fast(a, nvfp4, nvfp4_multiplier_of);
      col_multiplier[b0 + u][sc] = b.multiplier;
      unclamped &= fmt::mul_rn(a, b.multiplier) < kUnclampedBound;
      scales |= uint32_t(b.scale) << (8 * u);
    }
    if (b0 != 0) col_scales_hi[sc] = scales;
    // Every thread's elements meet the multipliers of other threads' blocks: the CTA votes.
    const bool clamp_columns = !__syncthreads_and(unclamped);
    // Each column's kColBlocks scale bytes leave from its first thread, 8 bytes at once where aligned:
    // the tile has only these 8 bytes of each col_scale row, so one partial-sector write per row, not
    // two (L2 write requests of the columnwise kernel 3.1M -> 2.1M per 256 MiB; ncu, run L).
    if (b0 == 0 && (kInterior || k0 + sc < p.k)) {
      const int64_t mb0 = m0 / kBlock;  // first block (along M) of the tile
      const uint64_t bytes = (uint64_t(col_scales_hi[sc]) << (8 * kPerThread)) | scales;
      uint8_t* dst = static_cast<uint8_t*>(p.col_scale) + (k0 + sc) * p.col_scale_cols + mb0;
      if ((kInterior || m0 + kTile <= p.m) && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(uint32_t(bytes), uint32_t(bytes >> 32));
      } else {
#pragma unroll
        for (int u = 0; u < kColBlocks; ++u)
          if ((mb0 + u) * kBlock < p.m) dst[u] = uint8_t(bytes >> (8 * u));
      }
    }
    float multiplier[V];
#pragma unroll
    for (int j = 0; j < V; ++j) multiplier[j] = col_multiplier[row0 / kBlock][col0 + j];
    auto encode_columns = [&](auto clamp) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int c = col0 + j;
        uint32_t w[NI / 8];  // in slot order
#pragma unroll
        for (int t = 0; t < NI / 8; ++t) {
          float y[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) y[u] = fmt::mul_rn(v[8 * t + u][j], multiplier[j]);
          w[t] = pack_e2m1<8, decltype(clamp)::value>(y);
        }
#pragma unroll
        for (int t = 0; t < NI / 8; ++t) {
          // Rows 8t..8t+7 sit in slots (8t..8t+7) ^ perm (perm a multiple of 4): word t ^ (perm / 8),
          // halves swapped when perm & 4.
          const uint32_t ws = (perm & 8) ? w[t ^ ((NI / 8) - 1)] : w[t];
          const int q = row0 / 8 + t;
          out_tile[c * kOutWords + (q ^ swizzle<kOutWords>(c))] = __funnelshift_l(ws, ws, (perm & 4) * 4);
        }
      }
    };
    if (clamp_columns) encode_columns(std::true_type{});
    else encode_columns(std::false_type{});
  }
  __syncthreads();

  // Coalesced store of the transposed tile: consecutive threads write consecutive words of a row.
  // Pass n writes tile rows c0 + n * kRowsPerPass at word q, from one base address. The swizzle of row
  // c0 + n * kRowsPerPass is swizzle(c0) ^ swizzle(n * kRowsPerPass) (c0 < kRowsPerPass: the rows' bits
  // that swizzle reads do not overlap), so a pass costs one XOR with a constant.
  constexpr int kRowsPerPass = kThreads / kOutWords;
  static_assert((kRowsPerPass & (kRowsPerPass - 1)) == 0 && kRowsPerPass >= 4, "swizzle(c0 + n * kRowsPerPass) splits");
  const int c0 = threadIdx.x / kOutWords, q = threadIdx.x % kOutWords;
  const uint32_t* tile_row = out_tile + c0 * kOutWords;
  const int q_swizzled = q ^ swizzle<kOutWords>(c0);
  const int64_t out_row_bytes = F == Fmt::kNvfp4 ? p.m / 2 : p.m;  // bytes per row of col_data
  const int64_t off = (F == Fmt::kNvfp4 ? m0 / 2 : m0) + 4 * q;
  const bool word_store = out_row_bytes % 4 == 0;
  const int64_t rows_left = p.k - (k0 + c0);  // tile rows c0 + r with r < rows_left are inside
  uint8_t* dst0 = opaque(p.col_data + (k0 + c0) * out_row_bytes + off);
#pragma unroll
  for (int n = 0; n < kTile * kOutWords / kThreads; ++n) {
    if (!kInterior && n * kRowsPerPass >= rows_left) continue;
    const uint32_t w = tile_row[n * kRowsPerPass * kOutWords + (q_swizzled ^ swizzle<kOutWords>(n * kRowsPerPass))];
    uint8_t* dst = dst0 + n * kRowsPerPass * out_row_bytes;
    if (word_store) {
      if (kInterior || off < out_row_bytes) *reinterpret_cast<uint32_t*>(dst) = w;
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (off + u < out_row_bytes) dst[u] = uint8_t(w >> (8 * u));
    }
  }
}

// With 16-byte loads, the tiles wholly inside x (2-D grids of at most 65535 tile rows each) and the
// others (a partial last tile row / column) are separate launches; without, one launch of the general
// kernel covers every tile.
template <Fmt F, typename In>
cudaError_t launch_quantize_tiles(const QuantParams& p, bool vec_ok, cudaStream_t stream) {
  const int64_t tiles = fmt::cdiv(p.m, int64_t(kTile)) * p.tiles_k;
  if (tiles > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  if (!vec_ok) {
    quantize_tile_kernel<F, In, false, false><<<unsigned(tiles), kThreads, 0, stream>>>(p, 0, 0, 0);
    return cudaGetLastError();
  }
  const int64_t full_m = p.m / kTile, full_k = p.k / kTile, interior = full_m * full_k;
  constexpr int64_t kMaxGridY = 65535;
  for (int64_t mt0 = 0; full_k > 0 && mt0 < full_m; mt0 += kMaxGridY) {
    const dim3 grid(unsigned(full_k), unsigned(std::min(full_m - mt0, kMaxGridY)));
    quantize_tile_kernel<F, In, true, true><<<grid, kThreads, 0, stream>>>(p, full_m, full_k, mt0);
  }
  if (tiles > interior) quantize_tile_kernel<F, In, true, false><<<unsigned(tiles - interior), kThreads, 0, stream>>>(p, full_m, full_k, 0);
  return cudaGetLastError();
}

template <Fmt F>
cudaError_t launch_quantize(QuantParams p, HighPrecision dtype, cudaStream_t stream) {
  if (p.m == 0 || p.k == 0) return cudaSuccess;
  p.tiles_k = fmt::cdiv(p.k, kTile);
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  switch (dtype) {
    case HighPrecision::kFloat32: return launch_quantize_tiles<F, F32>(p, aligned && p.k % F32::kVec == 0, stream);
    case HighPrecision::kBFloat16: return launch_quantize_tiles<F, Bf16>(p, aligned && p.k % Bf16::kVec == 0, stream);
    case HighPrecision::kFloat16: return launch_quantize_tiles<F, F16>(p, aligned && p.k % F16::kVec == 0, stream);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

// ---------------------------------------------------------------------------------------------------
// Launchers (formats_launch.h).

cudaError_t launch_quantize_fp8_block(const Fp8BlockQuantizeArgs& a, cudaStream_t stream) {
  QuantParams p{};
  p.x = a.x;
  p.m = a.m;
  p.k = a.k;
  p.kind = a.kind;
  p.pow2 = a.pow2_scales;
  p.epsilon = a.amax_epsilon;
  p.max_finite = a.max_finite;
  p.fp8_max = a.kind == fmt::kE4M3 ? fmt::kE4M3Max : fmt::kE5M2Max;
  p.row_data = a.rowwise_data;
  p.row_scale = a.rowwise_scale_inv;
  p.row_scale_cols = fmt::fp8_block_scale_shape(a.m, a.k, a.block_dim, false).cols;
  p.col_data = a.columnwise_data;
  p.col_scale = a.columnwise_scale_inv;
  p.col_scale_cols = fmt::fp8_block_scale_shape(a.m, a.k, a.block_dim, true).cols;
  if (a.block_dim == 1) return launch_quantize<Fmt::kFp8Block1d>(p, a.x_dtype, stream);
  if (a.block_dim == 2) return launch_quantize<Fmt::kFp8Block2d>(p, a.x_dtype, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_quantize_mxfp8(const Mxfp8QuantizeArgs& a, cudaStream_t stream) {
  if (a.m % fmt::kMxfp8BlockLen != 0 || a.k % fmt::kMxfp8BlockLen != 0) return cudaErrorInvalidValue;
  QuantParams p{};
  p.x = a.x;
  p.m = a.m;
  p.k = a.k;
  p.kind = a.kind;
  p.fp8_max = a.kind == fmt::kE4M3 ? fmt::kE4M3Max : fmt::kE5M2Max;
  p.row_data = a.rowwise_data;
  p.row_scale = a.rowwise_scale_inv;
  p.row_scale_cols = fmt::mxfp8_scale_shape(a.m, a.k, false).cols;
  p.col_data = a.columnwise_data;
  p.col_scale = a.columnwise_scale_inv;
  p.col_scale_cols = fmt::mxfp8_scale_shape(a.m, a.k, true).cols;
  return launch_quantize<Fmt::kMxfp8>(p, a.x_dtype, stream);
}

cudaError_t launch_quantize_nvfp4(const Nvfp4QuantizeArgs& a, cudaStream_t stream) {
  if (a.m % fmt::kNvfp4BlockLen != 0 || a.k % fmt::kNvfp4BlockLen != 0) return cudaErrorInvalidValue;
  QuantParams p{};
  p.x = a.x;
  p.m = a.m;
  p.k = a.k;
  p.kind = fmt::kE4M3;
  p.global_amax = a.global_amax;
  p.row_data = a.rowwise_data;
  p.row_scale = a.rowwise_scale_inv;
  p.row_scale_cols = fmt::nvfp4_scale_shape(a.m, a.k, false).cols;
  p.col_data = a.columnwise_data;
  p.col_scale = a.columnwise_scale_inv;
  p.col_scale_cols = fmt::nvfp4_scale_shape(a.m, a.k, true).cols;
  return launch_quantize<Fmt::kNvfp4>(p, a.x_dtype, stream);
}

}  // namespace pyxfer
