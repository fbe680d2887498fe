// The steady-state all-gather's device-side rules (csrc/gather/, csrc/kernels/gather_post.cu), written
// once for the CPU path and the CUDA kernels. Torch-free.
//
// Every collective of a planned gather carries, beside its data parts, a "meta" part: each rank's
// agreement record (pyxfer/gather/record.py: RECORD_LEN int64 slots). After the data arrived, the
// verdict compares every rank's record with this rank's expected one in slots [0, compare_len): a
// rank that called with another signature (or could not send) posted scratch buffers of the agreed
// layout and its own record, so its peers see the difference here, without any host read.
//
// The latch (kLatchWords int64, in host memory the device can write: mapped pinned memory for CUDA,
// plain memory for the CPU path) is where verdicts land for the host to read later:
//   [kLatchStickyBad]       1 once any verdict since the host last cleared it was "disagree"
//   [kLatchStickyBadSeq]    the sequence number of such a call
//   [kLatchStickyRenorm]    1 once an NVFP4 gather renormalised shards with different amax
//   [kLatchStickyRenormSeq]
//   [kLatchRing + seq % kLatchRingSlots]  seq << kSlotShift | flags (kVerdictBad, kVerdictRenorm): one
//                                          aligned 8-byte store, so a reader never sees half of it
//   [kLatchGraphSlot]                      the same for calls captured in a CUDA graph (their replays
//                                          never overwrite an eager call's slot)
// NOTE: no atomics: one thread writes a slot, distinct calls in flight use distinct slots, and the
// sticky words are only ever set (to 1) by the device (before the slot, behind a system-scope fence)
// and cleared by the host when no call is in flight.
#pragma once

#include <stdint.h>

#include "pyxfer/formats.h"
#include "pyxfer/host_device.h"

namespace pyxfer {
namespace gather {

constexpr int kLatchWords = 64;
constexpr int kLatchStickyBad = 0, kLatchStickyBadSeq = 1, kLatchStickyRenorm = 2, kLatchStickyRenormSeq = 3;
constexpr int kLatchGraphSlot = 6;
constexpr int kLatchRing = 8;
constexpr int kLatchRingSlots = kLatchWords - kLatchRing;  // 56
constexpr int64_t kVerdictBad = 1, kVerdictRenorm = 2;
constexpr int kSlotShift = 4;

// The most record slots a verdict compares.
constexpr int kMaxCompare = 32;

PYXFER_HOST_DEVICE int latch_slot(int64_t seq, bool captured) {
  return captured ? kLatchGraphSlot : kLatchRing + int(seq % kLatchRingSlots);
}

PYXFER_HOST_DEVICE int64_t slot_word(int64_t seq, bool bad, bool renorm) {
  return (seq << kSlotShift) | (bad ? kVerdictBad : 0) | (renorm ? kVerdictRenorm : 0);
}

// Whether some rank's record (records: world x record_len, rank-major) differs from `expected` in
// slots [0, compare_len).
PYXFER_HOST_DEVICE bool records_disagree(const int64_t* records, int world, int record_len, const int64_t* expected,
                                         int compare_len) {
  for (int r = 0; r < world; ++r) {
    for (int i = 0; i < compare_len; ++i) {
      if (records[int64_t(r) * record_len + i] != expected[i]) return true;
    }
  }
  return false;
}

// NVFP4 shards: the amax slots of the records hold the fp32 bits of each rank's global amax (rowwise,
// columnwise). When every rank's rowwise amax is the same and every rank's columnwise amax is the
// same, the gathered bytes are the result; else each shard is decoded with its own amax and the
// whole requantized with the largest of them all (`renormalise`).
struct Nvfp4Amaxes {
  bool renormalise;
  uint32_t row_bits, col_bits;  // the result's amax_rowwise / amax_columnwise
  float group_max;              // max over every rank's rowwise and columnwise amax
};

PYXFER_HOST_DEVICE Nvfp4Amaxes nvfp4_amaxes(const int64_t* records, int world, int record_len, int row_slot,
                                            int col_slot) {
  Nvfp4Amaxes a;
  const uint32_t row0 = uint32_t(records[row_slot]), col0 = uint32_t(records[col_slot]);
  bool same = true;
  float top = fmt::bits_float(row0);
  for (int r = 0; r < world; ++r) {
    const uint32_t row = uint32_t(records[int64_t(r) * record_len + row_slot]);
    const uint32_t col = uint32_t(records[int64_t(r) * record_len + col_slot]);
    same = same && row == row0 && col == col0;
    const float fr = fmt::bits_float(row), fc = fmt::bits_float(col);
    if (fr > top) top = fr;
    if (fc > top) top = fc;
  }
  a.renormalise = !same;
  a.group_max = top;
  a.row_bits = same ? row0 : fmt::float_bits(top);
  a.col_bits = same ? col0 : fmt::float_bits(top);
  return a;
}

// ---- NVFP4 renormalisation of a gathered tensor (pyxfer.gather: shards quantized with different
// global amax). Buffers are the gathered result's: rowwise data [W*M, K/2] and compact scales with
// `row_scale_cols` columns; columnwise data [K, W*M/2] and scales with `col_scale_cols` columns. Shard
// r holds rows [r*M, (r+1)*M). The source of the values is the rowwise usage when gathered, else the
// columnwise one (as QuantizedTensor.dequantize chooses); each value is decoded with its shard's amax
// (shard_amax(r): rowwise amax when the source is rowwise, else columnwise) and rounded to the nominal
// dtype (as dequantize's output), then requantized with `group_max` exactly as quantize_nvfp4 does.
struct Nvfp4Gathered {
  uint8_t* row_data;
  uint8_t* row_scale;
  uint8_t* col_data;
  uint8_t* col_scale;
  int64_t shard_m, k, world, row_scale_cols, col_scale_cols;
};

// Element (gm, kk) of the gathered matrix decoded as dequantize_nvfp4 does (fp32, before the cast).
PYXFER_HOST_DEVICE float nvfp4_gathered_value(const Nvfp4Gathered& g, bool from_rowwise, int64_t gm, int64_t kk,
                                              float shard_amax) {
  const int64_t wm = g.world * g.shard_m;
  const int64_t along = from_rowwise ? kk : gm;
  const uint8_t byte = from_rowwise ? g.row_data[gm * (g.k / 2) + kk / 2] : g.col_data[kk * (wm / 2) + gm / 2];
  const uint8_t scale = from_rowwise ? g.row_scale[gm * g.row_scale_cols + kk / fmt::kNvfp4BlockLen]
                                     : g.col_scale[kk * g.col_scale_cols + gm / fmt::kNvfp4BlockLen];
  const float code = fmt::decode_e2m1(uint8_t((along & 1) ? byte >> 4 : byte & 0xF));
  return fmt::mul_rn(code, fmt::nvfp4_decode_factor(scale, shard_amax));
}

// Requantizes one 16-element block from `values` (already rounded to the nominal dtype) with the
// tensor scales of the group's amax: writes the block's scale byte and its 8 data bytes.
PYXFER_HOST_DEVICE void nvfp4_requantize_block(const float (&values)[fmt::kNvfp4BlockLen], float s_enc, float s_dec,
                                               uint8_t* scale_out, uint8_t* data_out) {
  float amax = 0.0f;
  for (int i = 0; i < fmt::kNvfp4BlockLen; ++i) amax = fmt::max_f(amax, fmt::abs_f(values[i]));
  const fmt::Nvfp4Block b = fmt::nvfp4_block(amax, s_enc, s_dec);
  *scale_out = b.scale;
  for (int i = 0; i < fmt::kNvfp4BlockLen; i += 2) {
    const uint8_t lo = fmt::encode_e2m1(fmt::mul_rn(values[i], b.multiplier));
    const uint8_t hi = fmt::encode_e2m1(fmt::mul_rn(values[i + 1], b.multiplier));
    data_out[i / 2] = uint8_t(lo | (hi << 4));
  }
}

// The block's 16 values, read before anything of the block is written (the rowwise pass rewrites its
// own source in place; so does a columnwise-only pass). `round` rounds to the nominal dtype.
// Columnwise output block (kk, gmb) covers rows [16 gmb, 16 gmb + 16) of column kk; rowwise output
// block (gm, kb) covers columns [16 kb, 16 kb + 16) of row gm.
template <typename Round, typename AmaxOf>
PYXFER_HOST_DEVICE void nvfp4_renormalise_block(const Nvfp4Gathered& g, bool rowwise_out, bool from_rowwise,
                                                int64_t line, int64_t block, float s_enc, float s_dec,
                                                const Round& round, const AmaxOf& shard_amax) {
  float v[fmt::kNvfp4BlockLen];
  const int64_t bl = fmt::kNvfp4BlockLen;
  for (int i = 0; i < fmt::kNvfp4BlockLen; ++i) {
    const int64_t gm = rowwise_out ? line : block * bl + i, kk = rowwise_out ? block * bl + i : line;
    v[i] = round(nvfp4_gathered_value(g, from_rowwise, gm, kk, shard_amax(gm / g.shard_m)));
  }
  if (rowwise_out) {
    nvfp4_requantize_block(v, s_enc, s_dec, g.row_scale + line * g.row_scale_cols + block,
                           g.row_data + line * (g.k / 2) + block * (bl / 2));
  } else {
    const int64_t wm = g.world * g.shard_m;
    nvfp4_requantize_block(v, s_enc, s_dec, g.col_scale + line * g.col_scale_cols + block,
                           g.col_data + line * (wm / 2) + block * (bl / 2));
  }
}

}  // namespace gather
}  // namespace pyxfer
