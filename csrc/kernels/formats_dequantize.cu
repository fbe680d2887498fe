// Dequantize kernels of the quantized formats (FP8 block 1x128 and 128x128, MXFP8, NVFP4) and their
// launchers (pyxfer/formats_launch.h). Shared device helpers: pyxfer/formats_device.cuh.
//
// Dequantize: row-major data (every rowwise usage, MXFP8 columnwise) decodes 4 chunks of 16 elements
// per thread, all loads issued first (16-byte or 8-byte loads, 16-byte stores); transposed data
// (FP8-block and NVFP4 columnwise) goes through shared tiles of 128 rows x 128 bytes, filled by a
// cp.async pipeline in persistent CTAs (dequantize_transposed_kernel).
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "pyxfer/formats.h"
#include "pyxfer/formats_device.cuh"
#include "pyxfer/formats_launch.h"
#include "pyxfer/resident_blocks.h"

namespace pyxfer {
namespace {

using formats_device::Bf16;
using formats_device::decode_fp8_one;
using formats_device::decode_fp8x2;
using formats_device::F16;
using formats_device::F32;
using formats_device::Fmt;
using formats_device::Fp8Kind;
using formats_device::kThreads;
using formats_device::kTile;
using formats_device::swizzle;
using formats_device::word_of;

struct DequantParams {
  const uint8_t* data;
  const void* scale;
  int64_t scale_cols;
  const float* amax;  // NVFP4
  int64_t m, k, tiles_m, tiles_k;  // tiles_*: the transposed kernel's, along the data rows / columns
  Fp8Kind kind;
  bool columnwise;
  void* out;
};

// Writes `count` (<= 4) results at out[offset]; 16-byte / 8-byte stores when `vec`. The dequantize
// kernels' results are written once and not read back here: streaming stores (st.global.cs, as in
// store_out16_pair). With plain stores the transposed kernel's writes to fp32 went through L2 at 2.4x
// their sectors, at 52% of DRAM peak (ncu, 8192 x 16384 columnwise to fp32: FP8 1x128 260 -> 183 us,
// NVFP4 208 -> 166 us; rowwise: FP8 1x128 209 -> 190 us, NVFP4 182 -> 170 us; to bf16 unchanged).
template <typename Out>
__device__ __forceinline__ void store_out4(void* out, int64_t offset, const float (&r)[4], int count, bool vec);

template <>
__device__ __forceinline__ void store_out4<F32>(void* out, int64_t offset, const float (&r)[4], int count, bool vec) {
  float* o = static_cast<float*>(out) + offset;
  if (vec && count == 4) {
    __stcs(reinterpret_cast<float4*>(o), make_float4(r[0], r[1], r[2], r[3]));
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < count) o[j] = r[j];
}

template <typename Out>
__device__ __forceinline__ void store_out4(void* out, int64_t offset, const float (&r)[4], int count, bool vec) {
  uint16_t* o = static_cast<uint16_t*>(out) + offset;
  if (vec && count == 4) {
    uint2 w;
    w.x = Out::to_bits2(r[0], r[1]);
    w.y = Out::to_bits2(r[2], r[3]);
    __stcs(reinterpret_cast<uint2*>(o), w);
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < count) o[j] = Out::to_bits(r[j]);
}

// Decode factor of the block holding element (m, k) of row-major data (rowwise, or MXFP8 columnwise).
template <Fmt F>
__device__ __forceinline__ float row_major_factor(const DequantParams& p, int64_t m, int64_t k, float amax) {
  if (F == Fmt::kFp8Block1d) return static_cast<const float*>(p.scale)[(k / kTile) * p.scale_cols + m];
  if (F == Fmt::kFp8Block2d) return static_cast<const float*>(p.scale)[(m / kTile) * p.scale_cols + k / kTile];
  const uint8_t* s = static_cast<const uint8_t*>(p.scale);
  if (F == Fmt::kMxfp8) {
    return fmt::e8m0_value(p.columnwise ? s[(m / fmt::kMxfp8BlockLen) * p.scale_cols + k]
                                        : s[m * p.scale_cols + k / fmt::kMxfp8BlockLen]);
  }
  return fmt::nvfp4_decode_factor(s[m * p.scale_cols + k / fmt::kNvfp4BlockLen], amax);
}

// E2M1 code (the low 4 bits of `code`) to float, bit-identical to fmt::decode_e2m1 for all 16 codes:
// the magnitude bits e1 e0 m placed at fp32 bits 24..22 read as 2^(e - 127) * (1 + m / 2) (e >= 1) or
// the subnormal 2^-127 (e = 0, m = 1), so one exact multiply by 2^126 gives 2^(e - 1) * (1 + m / 2),
// 0.5 and 0 (NVFP4 dequantize is ALU-bound on SM 90: two shifts, one LOP3 and a multiply per element).
__host__ __device__ __forceinline__ float decode_e2m1_fast(uint32_t code) {
  const uint32_t bits = ((code << 22) & 0x01C00000u) | ((code << 28) & 0x80000000u);
  return fmt::mul_rn(fmt::bits_float(bits), 0x1p126f);
}

// Stores the 16 results of this lane's chunk, whose 16 * sizeof(Out) bytes at out[offset] sit right
// after those of lane - 1 (odd lanes) or right before those of lane + 1 (even lanes): the two lanes
// swap half of their 16-byte pieces so that each of their store instructions writes one whole 32-byte
// sector (storing its own 32 or 64 bytes, a lane writes half sectors: twice the L2 sector writes; the
// rows kernels ran at 85-92% of L2 throughput and 57-69% of DRAM's, now 72-77% of DRAM's, benchmarks/runs/I).
// `paired`: both chunks exist; otherwise the even lane stores its own chunk and the odd one nothing.
template <typename Out>
__device__ __forceinline__ void store_out16_pair(void* out, int64_t offset, const float (&r)[16], bool odd, bool paired) {
  constexpr int kWords = std::is_same<Out, F32>::value ? 16 : 8;  // 32-bit words of the 16 results
  constexpr int kPieces = kWords / 4;                              // 16-byte pieces per chunk (2 or 4)
  uint32_t w[kWords];
#pragma unroll
  for (int j = 0; j < kWords; ++j) {
    if constexpr (std::is_same<Out, F32>::value) w[j] = __float_as_uint(r[j]);
    else w[j] = Out::to_bits2(r[2 * j], r[2 * j + 1]);
  }
  // Each lane keeps the pieces whose index has its parity and sends the others, in order.
  const unsigned mask = 3u << (threadIdx.x & 30u);
  uint32_t got[kWords / 2];
#pragma unroll
  for (int h = 0; h < kPieces / 2; ++h) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      got[4 * h + j] = __shfl_xor_sync(mask, odd ? w[4 * (2 * h) + j] : w[4 * (2 * h + 1) + j], 1);
  }
  const auto piece = [](const uint32_t* a, int q) { return make_uint4(a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]); };
  uint4* own = reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + offset * int64_t(sizeof(uint32_t) * kWords / 16));
  if (!paired) {
    if (!odd) {
#pragma unroll
      for (int q = 0; q < kPieces; ++q) __stcs(own + q, piece(w, q));
    }
    return;
  }
  // Store s writes the pair's sector s: piece 2s from the even lane, piece 2s + 1 from the odd one
  // (pieces 0 .. kPieces - 1 are the even lane's, the rest the odd lane's).
  uint4* pair_start = own - (odd ? kPieces : 0);
#pragma unroll
  for (int s = 0; s < kPieces; ++s) {
    const uint4 v = odd ? (2 * s + 1 < kPieces ? piece(got, s) : piece(w, 2 * s + 1 - kPieces))
                        : (2 * s < kPieces ? piece(w, 2 * s) : piece(got, s - kPieces / 2));
    __stcs(pair_start + 2 * s + (odd ? 1 : 0), v);
  }
}

// Row-major data, 16 consecutive elements (a "chunk") per thread and kRowsUnroll chunks per thread,
// kThreads chunks apart: all the data loads of a thread are issued before any decode (bytes in flight).
// Needs k % 16 == 0, data aligned to 16 bytes (FP8) or 8 bytes (NVFP4) and out to 16 bytes; 16
// elements never straddle a block (blocks are 16, 32 or 128 long). `idx32`: num_chunks < 2^32, so the
// row / column split uses 32-bit division. `vec_scale`: the MXFP8 columnwise scales are 16-byte aligned
// (16 per-column scale bytes of a chunk are one load). `kPerElement`: MXFP8 columnwise, whose scale
// [m / 32, k] has one byte per column.
constexpr int kRowsUnroll = 4;

template <Fmt F, typename Out, bool kPerElement>
__global__ void __launch_bounds__(kThreads, F == Fmt::kMxfp8 ? 4 : 5) dequantize_rows_kernel(const DequantParams p, int64_t num_chunks,
                                                                    bool idx32, bool vec_scale) {
  constexpr bool kFp4 = F == Fmt::kNvfp4;
  const int64_t base = int64_t(blockIdx.x) * (kThreads * kRowsUnroll) + threadIdx.x;
  uint4 raw[kRowsUnroll];
#pragma unroll
  for (int u = 0; u < kRowsUnroll; ++u) {
    const int64_t chunk = base + int64_t(u) * kThreads;
    raw[u] = make_uint4(0, 0, 0, 0);
    if (chunk < num_chunks) {
      if (kFp4) {
        const uint2 w = __ldcs(reinterpret_cast<const uint2*>(p.data) + chunk);
        raw[u].x = w.x;
        raw[u].y = w.y;
      } else {
        raw[u] = __ldcs(reinterpret_cast<const uint4*>(p.data) + chunk);
      }
    }
  }
  const float amax = kFp4 ? *p.amax : 0.0f;
  const int64_t chunks_per_row = p.k / 16;
  auto position = [&](int64_t chunk, int64_t& m, int64_t& k) {
    if (idx32) {
      const uint32_t c = uint32_t(chunk), cpr = uint32_t(chunks_per_row);
      const uint32_t mm = c / cpr;
      m = mm;
      k = int64_t(c - mm * cpr) * 16;
    } else {
      m = chunk / chunks_per_row;
      k = (chunk - m * chunks_per_row) * 16;
    }
  };
  // Per-element scales (16 bytes a chunk) are loaded for every chunk before any store: stores may alias
  // them as far as the compiler knows, so loads left behind a store wait one by one (MXFP8 columnwise
  // dequantize: 69% -> 86% of the copy, benchmarks/runs/H). One factor per chunk stays in the loop (hoisting
  // it measured slower).
  uint32_t sw[kRowsUnroll][4] = {};
  if (kPerElement) {
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
      const int64_t chunk = base + int64_t(u) * kThreads;
      if (chunk >= num_chunks) break;
      int64_t m, k;
      position(chunk, m, k);
      const uint8_t* s = static_cast<const uint8_t*>(p.scale) + (m / fmt::kMxfp8BlockLen) * p.scale_cols + k;
      if (vec_scale) {
        const uint4 v = *reinterpret_cast<const uint4*>(s);
        sw[u][0] = v.x;
        sw[u][1] = v.y;
        sw[u][2] = v.z;
        sw[u][3] = v.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          sw[u][j] = uint32_t(s[4 * j]) | uint32_t(s[4 * j + 1]) << 8 | uint32_t(s[4 * j + 2]) << 16 |
                     uint32_t(s[4 * j + 3]) << 24;
      }
    }
  }
  const bool odd = threadIdx.x & 1;  // lanes 2i and 2i + 1 hold adjacent chunks and store together
#pragma unroll
  for (int u = 0; u < kRowsUnroll; ++u) {
    const int64_t chunk = base + int64_t(u) * kThreads;
    if ((chunk & ~int64_t(1)) >= num_chunks) break;  // both lanes of a pair go on or stop together
    const bool valid = chunk < num_chunks;  // false for an odd lane just past the end (nothing stored)
    int64_t m, k;
    position(valid ? chunk : chunk - 1, m, k);
    float value[16];
    if (kFp4) {
#pragma unroll
      for (int j = 0; j < 16; ++j) value[j] = decode_e2m1_fast((j < 8 ? raw[u].x : raw[u].y) >> (4 * (j % 8)));
    } else {
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const float2 d = decode_fp8x2(word_of(raw[u], j / 4) >> (8 * (j % 4)), p.kind);
        value[j] = d.x;
        value[j + 1] = d.y;
      }
    }
    float r[16];
    if (kPerElement) {
#pragma unroll
      for (int j = 0; j < 16; ++j) r[j] = fmt::mul_rn(value[j], fmt::e8m0_value(uint8_t(sw[u][j / 4] >> (8 * (j % 4)))));
    } else {
      const float factor = row_major_factor<F>(p, m, k, amax);
#pragma unroll
      for (int j = 0; j < 16; ++j) r[j] = fmt::mul_rn(value[j], factor);
    }
    store_out16_pair<Out>(p.out, 16 * chunk, r, odd, (chunk | 1) < num_chunks);
  }
}

// Any shape and alignment: one element per thread (FP8 block with k % 16 != 0, misaligned data).
template <Fmt F, typename Out>
__global__ void __launch_bounds__(kThreads) dequantize_elements_kernel(const DequantParams p, int64_t count) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  const int64_t m = i / p.k, k = i - m * p.k;
  const float amax = F == Fmt::kNvfp4 ? *p.amax : 0.0f;
  float value;
  if (F == Fmt::kNvfp4) {
    const uint8_t byte = p.data[i / 2];
    value = fmt::decode_e2m1(uint8_t((k & 1) ? byte >> 4 : byte & 0xFu));
  } else {
    value = decode_fp8_one(p.data[i], p.kind);
  }
  const float r[4] = {fmt::mul_rn(value, row_major_factor<F>(p, m, k, amax)), 0.0f, 0.0f, 0.0f};
  store_out4<Out>(p.out, i, r, 1, false);
}

// Transposed data (FP8 block columnwise [K, M], NVFP4 columnwise [K, M/2]) to out [M, K], in tiles of
// 128 (k) x 128 bytes of each data row (128 values of m for FP8, 256 for NVFP4), written as coalesced
// output rows. Persistent CTAs walk the tiles and stage them in shared memory through a
// kTransposedStages-deep cp.async pipeline, so that the next tiles' loads are in flight while one is
// decoded and stored (with one tile per CTA, load, barrier, then decode: the kernel was latency-bound
// at 61% of the copy, DRAM 51% busy). Warp w decodes 16-byte unit w of every column of the tile (16 values of m for FP8,
// 32 for NVFP4), lane l its columns 4l .. 4l + 3. NVFP4's scale bytes travel in the same pipeline
// (staged_scales): read from global memory by each lane (8 bytes from 8 scale rows per thread and tile,
// behind the thread's own stores), they held its columnwise dequantize at 69% of the copy.
constexpr int kTransposedStages = 3;
constexpr int kTransposedMinBlocks = 4;  // CTAs per SM: 64 registers, 4 x 48 (NVFP4: 54) KB of shared memory
constexpr int kTransposedUnits = kTile / 16;  // 16-byte units per tile row

// 16-byte units of one pipeline stage: the data tile, then for NVFP4 the tile's scale bytes (the 16
// blocks of the tile's 256 values of m, one unit per column); and the shared memory of all stages.
template <Fmt F>
__host__ __device__ constexpr int transposed_stage_units() { return kTile * kTransposedUnits + (F == Fmt::kNvfp4 ? kTile : 0); }
template <Fmt F>
__host__ __device__ constexpr int transposed_smem_bytes() { return kTransposedStages * transposed_stage_units<F>() * 16; }

// Where column c's scale unit sits in a stage: the 32 lanes of a warp read one word of columns
// 4l + j (j fixed), which unswizzled would fall on 2 banks (16-way conflicts), swizzled on 8 (4-way).
__device__ __forceinline__ int scale_slot(int c) { return c ^ swizzle<4>(c >> 1); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

// Tile t's (mt, kt): its 128-byte column block of the data rows and its 128-row block of them. NVFP4
// walks mt fastest, so that the tiles in flight together read whole data rows (ncu, columnwise
// dequantize to bf16: 1 GiB 436 -> 413 us, 256 MiB 103 -> 101 us); FP8 block walks kt fastest (its
// 1 GiB case measured 451 against 455 us the other way).
template <Fmt F>
__device__ __forceinline__ void transposed_tile_coords(const DequantParams& p, int64_t t, int64_t& mt, int64_t& kt) {
  if (F == Fmt::kNvfp4) mt = t % p.tiles_m, kt = t / p.tiles_m;
  else mt = t / p.tiles_k, kt = t % p.tiles_k;
}

// Queues the loads of tile `t` into `stage`; bytes outside the data read as zero. `async_loads`: rows
// of 16-byte multiples at a 16-byte aligned base (units fully in or out), else byte loads.
// `staged_scales` (NVFP4, scale_cols % 16 == 0 at a 16-byte aligned base): the tile's scale units too.
template <Fmt F>
__device__ __forceinline__ void load_transposed_tile(const DequantParams& p, int64_t t, uint4* stage, bool async_loads,
                                                     bool staged_scales) {
  const int64_t row_bytes = F == Fmt::kNvfp4 ? p.m / 2 : p.m;
  int64_t mt, kt;
  transposed_tile_coords<F>(p, t, mt, kt);
  const int64_t k0 = kt * kTile, byte0 = mt * kTile;
#pragma unroll
  for (int n = 0; n < kTile * kTransposedUnits / kThreads; ++n) {
    const int idx = n * kThreads + threadIdx.x;
    const int c = idx / kTransposedUnits, u = idx % kTransposedUnits;
    const int64_t kk = k0 + c, off = byte0 + 16 * u;
    uint4* dst = stage + c * kTransposedUnits + (u ^ swizzle<kTransposedUnits>(c));
    const bool inside = kk < p.k && off < row_bytes;
    if (async_loads) {
      cp_async16(dst, inside ? p.data + kk * row_bytes + off : p.data, inside ? 16 : 0);
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
      if (kk < p.k) {
        const uint8_t* src = p.data + kk * row_bytes;
#pragma unroll
        for (int b = 0; b < 16; ++b)
          if (off + b < row_bytes) w[b / 4] |= uint32_t(src[off + b]) << (8 * (b % 4));
      }
      *dst = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  if (F == Fmt::kNvfp4 && staged_scales && threadIdx.x < kTile) {
    // Column k0 + c's 16 bytes from block byte0 / 8 (two values of m per byte): inside its scale row,
    // as the rows are padded to 128 (k) and scale_cols is a multiple of 16.
    const int c = threadIdx.x;
    cp_async16(stage + kTile * kTransposedUnits + scale_slot(c),
               static_cast<const uint8_t*>(p.scale) + (k0 + c) * p.scale_cols + byte0 / 8, 16);
  }
}

// Decodes and stores this thread's part of tile `t` from `stage`.
template <Fmt F, typename Out>
__device__ __forceinline__ void store_transposed_tile(const DequantParams& p, int64_t t, const uint4* stage,
                                                      bool staged_scales) {
  constexpr bool kFp4 = F == Fmt::kNvfp4;
  constexpr int kRowsPerWord = kFp4 ? 8 : 4;  // values of m in one 32-bit word of a data row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t mt, kt;
  transposed_tile_coords<F>(p, t, mt, kt);
  const int64_t first_row = mt * (kFp4 ? 2 * kTile : kTile) + warp * 4 * kRowsPerWord;  // this warp's rows
  const int64_t kc = kt * kTile + 4 * lane;  // this thread's 4 columns of out
  if (first_row >= p.m || kc >= p.k) return;
  const int count = p.k - kc >= 4 ? 4 : int(p.k - kc);
  const bool vec = p.k % 4 == 0;
  uint4 v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = 4 * lane + j;
    v[j] = stage[c * kTransposedUnits + (warp ^ swizzle<kTransposedUnits>(c))];
  }
  // NVFP4: two 16-row scale blocks per warp (bytes 2w and 2w + 1 of a column's 16 in the tile); FP8
  // block: one factor per column for all 16 rows. All read before any store.
  constexpr int kBlocks = kFp4 ? 2 : 1;
  float factor[kBlocks][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) factor[b][j] = 0.0f;
    if (j >= count) continue;
    if (F == Fmt::kFp8Block1d) factor[0][j] = static_cast<const float*>(p.scale)[mt * p.scale_cols + kc + j];
    if (F == Fmt::kFp8Block2d) factor[0][j] = static_cast<const float*>(p.scale)[kt * p.scale_cols + mt];
    if (F == Fmt::kNvfp4) {
      uint32_t pair;  // block b's byte in bits [8b, 8b + 8)
      if (staged_scales) {
        const uint32_t w = reinterpret_cast<const uint32_t*>(stage + kTile * kTransposedUnits + scale_slot(4 * lane + j))[warp / 2];
        pair = w >> (16 * (warp % 2));
      } else {
        const uint8_t* s = static_cast<const uint8_t*>(p.scale) + (kc + j) * p.scale_cols + first_row / fmt::kNvfp4BlockLen;
        pair = s[0] | (first_row + fmt::kNvfp4BlockLen < p.m ? uint32_t(s[1]) << 8 : 0u);
      }
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) factor[b][j] = fmt::nvfp4_decode_factor(uint8_t(pair >> (8 * b)), *p.amax);
    }
  }
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    if (first_row + 16 * b >= p.m) return;
#pragma unroll
    for (int q = 0; q < 4 / (kFp4 ? 2 : 1); ++q) {  // words of the block
      const int word = b * 2 + q;
#pragma unroll
      for (int r = 0; r < kRowsPerWord; r += 2) {
        float out0[4], out1[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w = word_of(v[j], word);
          float2 d;
          if (kFp4) d = make_float2(decode_e2m1_fast(w >> (4 * r)), decode_e2m1_fast(w >> (4 * r + 4)));
          else d = decode_fp8x2(w >> (8 * r), p.kind);
          out0[j] = fmt::mul_rn(d.x, factor[b][j]);
          out1[j] = fmt::mul_rn(d.y, factor[b][j]);
        }
        const int64_t m = first_row + word * kRowsPerWord + r;
        if (m >= p.m) return;
        store_out4<Out>(p.out, m * p.k + kc, out0, count, vec);
        if (m + 1 >= p.m) return;
        store_out4<Out>(p.out, (m + 1) * p.k + kc, out1, count, vec);
      }
    }
  }
}

template <Fmt F, typename Out>
__global__ void __launch_bounds__(kThreads, kTransposedMinBlocks)
    dequantize_transposed_kernel(const DequantParams p, int64_t tiles, bool async_loads, bool staged_scales) {
  static_assert(F != Fmt::kMxfp8, "MXFP8 columnwise data is row-major (dequantize_rows_kernel)");
  extern __shared__ uint4 transposed_stages[];  // kTransposedStages x transposed_stage_units<F>() (NVFP4: > 48 KB)
  const auto stages = [](int s) { return transposed_stages + s * transposed_stage_units<F>(); };
  const int64_t stride = gridDim.x;
  int64_t next = blockIdx.x;  // next tile to load
#pragma unroll
  for (int s = 0; s + 1 < kTransposedStages; ++s, next += stride) {
    if (next < tiles) load_transposed_tile<F>(p, next, stages(s), async_loads, staged_scales);
    cp_async_commit();  // one group per stage, empty or not, so that the wait below counts right
  }
  int stage = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += stride, next += stride) {
    // The stage loaded here was last read in the previous iteration, before its closing barrier.
    if (next < tiles)
      load_transposed_tile<F>(p, next, stages((stage + kTransposedStages - 1) % kTransposedStages), async_loads, staged_scales);
    cp_async_commit();
    cp_async_wait<kTransposedStages - 1>();  // this thread's copies of tile t have landed
    __syncthreads();                          // and everyone else's
    store_transposed_tile<F, Out>(p, t, stages(stage), staged_scales);
    __syncthreads();
    stage = (stage + 1) % kTransposedStages;
  }
}

template <Fmt F, typename Out>
cudaError_t launch_dequantize_transposed(DequantParams p, cudaStream_t stream) {
  const int64_t row_bytes = F == Fmt::kNvfp4 ? p.m / 2 : p.m;
  p.tiles_m = fmt::cdiv(row_bytes, int64_t(kTile));
  p.tiles_k = fmt::cdiv(p.k, kTile);
  const int64_t tiles = p.tiles_m * p.tiles_k;
  const bool async_loads = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.data) % 16 == 0;
  const bool staged_scales = F == Fmt::kNvfp4 && p.scale_cols % 16 == 0 && reinterpret_cast<uintptr_t>(p.scale) % 16 == 0;
  constexpr int kSmem = transposed_smem_bytes<F>();
  const int64_t grid = std::min<int64_t>(tiles, max_resident_blocks<dequantize_transposed_kernel<F, Out>, kThreads, kSmem>());
  dequantize_transposed_kernel<F, Out><<<unsigned(grid), kThreads, kSmem, stream>>>(p, tiles, async_loads, staged_scales);
  return cudaGetLastError();
}

template <Fmt F, typename Out>
cudaError_t launch_dequantize_typed(DequantParams p, cudaStream_t stream) {
  // Columnwise FP8 block and NVFP4 data is transposed; MXFP8's is row-major, so that no transposed
  // kernel is instantiated for it (it could never launch).
  if constexpr (F != Fmt::kMxfp8) {
    if (p.columnwise) return launch_dequantize_transposed<F, Out>(p, stream);
  }
  const unsigned align = F == Fmt::kNvfp4 ? 8 : 16;
  if (p.k % 16 == 0 && reinterpret_cast<uintptr_t>(p.data) % align == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0) {
    const int64_t chunks = p.m * (p.k / 16);
    const int64_t blocks = fmt::cdiv(chunks, int64_t(kThreads) * kRowsUnroll);
    if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    const bool idx32 = chunks < (int64_t(1) << 32);
    const bool vec_scale = reinterpret_cast<uintptr_t>(p.scale) % 16 == 0 && p.scale_cols % 16 == 0;
    if constexpr (F == Fmt::kMxfp8) {
      if (p.columnwise) {  // scale [m / 32, k]: one per column
        dequantize_rows_kernel<F, Out, true><<<unsigned(blocks), kThreads, 0, stream>>>(p, chunks, idx32, vec_scale);
        return cudaGetLastError();
      }
    }
    dequantize_rows_kernel<F, Out, false><<<unsigned(blocks), kThreads, 0, stream>>>(p, chunks, idx32, vec_scale);
  } else {
    const int64_t count = p.m * p.k;
    const int64_t blocks = fmt::cdiv(count, kThreads);
    if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    dequantize_elements_kernel<F, Out><<<unsigned(blocks), kThreads, 0, stream>>>(p, count);
  }
  return cudaGetLastError();
}

template <Fmt F>
cudaError_t launch_dequantize(const DequantParams& p, HighPrecision out_dtype, cudaStream_t stream) {
  if (p.m == 0 || p.k == 0) return cudaSuccess;
  switch (out_dtype) {
    case HighPrecision::kFloat32: return launch_dequantize_typed<F, F32>(p, stream);
    case HighPrecision::kBFloat16: return launch_dequantize_typed<F, Bf16>(p, stream);
    case HighPrecision::kFloat16: return launch_dequantize_typed<F, F16>(p, stream);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

// ---------------------------------------------------------------------------------------------------
// Launchers (formats_launch.h).

cudaError_t launch_dequantize_fp8_block(const uint8_t* data, const float* scale_inv, int64_t m, int64_t k,
                                        int block_dim, bool columnwise, Fp8Kind kind, HighPrecision out_dtype,
                                        void* out, cudaStream_t stream) {
  DequantParams p{};
  p.data = data;
  p.scale = scale_inv;
  p.scale_cols = fmt::fp8_block_scale_shape(m, k, block_dim, columnwise).cols;
  p.m = m;
  p.k = k;
  p.kind = kind;
  p.columnwise = columnwise;
  p.out = out;
  if (block_dim == 1) return launch_dequantize<Fmt::kFp8Block1d>(p, out_dtype, stream);
  if (block_dim == 2) return launch_dequantize<Fmt::kFp8Block2d>(p, out_dtype, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_dequantize_mxfp8(const uint8_t* data, const uint8_t* scale_inv, int64_t m, int64_t k,
                                    bool columnwise, Fp8Kind kind, HighPrecision out_dtype, void* out,
                                    cudaStream_t stream) {
  if (m % fmt::kMxfp8BlockLen != 0 || k % fmt::kMxfp8BlockLen != 0) return cudaErrorInvalidValue;
  DequantParams p{};
  p.data = data;
  p.scale = scale_inv;
  p.scale_cols = fmt::mxfp8_scale_shape(m, k, columnwise).cols;
  p.m = m;
  p.k = k;
  p.kind = kind;
  p.columnwise = columnwise;
  p.out = out;
  return launch_dequantize<Fmt::kMxfp8>(p, out_dtype, stream);
}

cudaError_t launch_dequantize_nvfp4(const uint8_t* data, const uint8_t* scale_inv, const float* amax, int64_t m,
                                    int64_t k, bool columnwise, HighPrecision out_dtype, void* out,
                                    cudaStream_t stream) {
  if (m % fmt::kNvfp4BlockLen != 0 || k % fmt::kNvfp4BlockLen != 0) return cudaErrorInvalidValue;
  DequantParams p{};
  p.data = data;
  p.scale = scale_inv;
  p.scale_cols = fmt::nvfp4_scale_shape(m, k, columnwise).cols;
  p.amax = amax;
  p.m = m;
  p.k = k;
  p.columnwise = columnwise;
  p.out = out;
  return launch_dequantize<Fmt::kNvfp4>(p, out_dtype, stream);
}

}  // namespace pyxfer
