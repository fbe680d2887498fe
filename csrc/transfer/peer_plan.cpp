// Verified GPU -> GPU copies, the device-generic part (declared in transfer/peer_plan.h), and the ops
// that expose the pure parts of the CUDA path to tests on any machine: plan_peer_chunks,
// judge_verify_words, verified_copy_limits (schemas in csrc/torch_bindings.cpp).
#include "transfer/peer_plan.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "pyxfer/verify_words.h"

namespace pyxfer {
namespace {

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

PeerKnobs read_knobs() {
  PeerKnobs k;
  if (const char* text = env("PYXFER_PEER_FUSED_MIB")) {
    double mib = -1;
    TORCH_CHECK(std::sscanf(text, "%lf", &mib) == 1 && mib >= 0, "PYXFER_PEER_FUSED_MIB must be a size in MiB "
                "such as '64' (0: never), got '", text, "'");
    k.fused_max = int64_t(mib * double(1 << 20));
  }
  if (const char* text = env("PYXFER_PEER_CHUNKS")) {
    long long shrink = 0;
    double min_mib = 0;
    TORCH_CHECK(std::sscanf(text, "%lld,%lf", &shrink, &min_mib) == 2 && min_mib > 0, "PYXFER_PEER_CHUNKS must be "
                "'<shrink>,<min chunk MiB>' such as '6,2', got '", text, "'");
    k.shrink = std::max<int64_t>(1, shrink);
    k.min_chunk = std::max<int64_t>(8, int64_t(min_mib * double(1 << 20)) / 8 * 8);
  }
  if (const char* text = env("PYXFER_PEER_HASH_GRID")) {
    TORCH_CHECK(std::sscanf(text, "%lf", &k.hash_grid) == 1 && k.hash_grid > 0 && k.hash_grid <= 1,
                "PYXFER_PEER_HASH_GRID must be the share of a wave of blocks for the hashes beside a peer copy, "
                "in (0, 1], such as '0.5', got '", text, "'");
  }
  if (const char* text = env("PYXFER_PEER_RATES")) {
    TORCH_CHECK(std::sscanf(text, "%lf,%lf", &k.link_gbps, &k.hash_gbps) == 2 && k.link_gbps > 0 && k.hash_gbps > 0,
                "PYXFER_PEER_RATES must be '<link GB/s>,<hash GB/s>' such as '395,3000', got '", text, "'");
  }
  return k;
}

std::vector<int64_t> plan_peer_chunks_op(int64_t num_bytes, double link_gbps, double hash_gbps, int64_t wave_blocks,
                                         bool knobs) {
  constexpr const char* op = "pyxfer.plan_peer_chunks";
  TORCH_CHECK(num_bytes >= 0, op, ": num_bytes must be >= 0, got ", num_bytes);
  TORCH_CHECK(std::isfinite(link_gbps) && link_gbps > 0, op, ": link_gbps must be a positive rate, got ", link_gbps);
  TORCH_CHECK(std::isfinite(hash_gbps) && hash_gbps > 0, op, ": hash_gbps must be a positive rate, got ", hash_gbps);
  TORCH_CHECK(wave_blocks >= 1, op, ": wave_blocks must be >= 1, got ", wave_blocks);
  const PeerSchedule s = knobs ? tuned_schedule(link_gbps, hash_gbps, wave_blocks)
                               : schedule_from_rates(link_gbps, hash_gbps, wave_blocks);
  std::vector<int64_t> out{s.shrink, s.min_chunk, s.hash_blocks, s.src_blocks};
  for (int64_t begin = 0; begin < num_bytes;) {
    begin = next_chunk_end(begin, num_bytes, s.shrink, s.min_chunk);
    out.push_back(begin);
  }
  return out;
}

std::vector<int64_t> judge_verify_words_op(at::IntArrayRef words, int64_t seq, int64_t src_device,
                                           int64_t dst_device) {
  constexpr const char* op = "pyxfer.judge_verify_words";
  TORCH_CHECK(words.size() == 4, op, ": words must be [src, dst, src_token, dst_token], got ", words.size(),
              " values");
  const VerifyWords w{uint64_t(words[0]), uint64_t(words[1]), uint64_t(words[2]), uint64_t(words[3])};
  const verify::Verdict v =
      verify::judge(w, uint64_t(seq), verify::device_canary(src_device), verify::device_canary(dst_device));
  return {v.ok ? 1 : 0, int64_t(v.src_hash), int64_t(v.dst_hash)};
}

std::vector<int64_t> verified_copy_limits_op() {
  return {kSerialPeerBytes, peer_knobs().fused_max, kSpinWaitBytes};
}

}  // namespace

const PeerKnobs& peer_knobs() {
  static const PeerKnobs knobs = read_knobs();
  return knobs;
}

PeerSchedule tuned_schedule(double link_gbps, double hash_gbps, int64_t wave_blocks) {
  const PeerKnobs& k = peer_knobs();
  PeerSchedule s = schedule_from_rates(link_gbps, hash_gbps, wave_blocks);
  if (k.shrink > 0) {
    s.shrink = k.shrink;
    s.min_chunk = k.min_chunk;
  }
  if (k.hash_grid > 0) {
    s.hash_blocks = std::max<int64_t>(1, int64_t(std::ceil(double(wave_blocks) * k.hash_grid)));
    s.src_blocks = s.hash_blocks;
  }
  return s;
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) {
  m.impl("plan_peer_chunks", &plan_peer_chunks_op);
  m.impl("judge_verify_words", &judge_verify_words_op);
  m.impl("verified_copy_limits", &verified_copy_limits_op);
}

}  // namespace pyxfer
