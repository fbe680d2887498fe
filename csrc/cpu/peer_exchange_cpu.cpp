// peer_exchange on the CPU: the protocol of pyxfer/peer_exchange.h between two host threads, one per side,
// with acquire / release flags as the GPU kernel's (csrc/kernels/transfer.cu). It defines the result the GPU
// pair must give, and lets the protocol, its hooks and its timeouts be tested on any machine.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "checks.h"
#include "pyxfer/peer_exchange.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.peer_exchange";

bool wait_at_least(int64_t* word, int64_t at_least, std::chrono::steady_clock::time_point give_up) {
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < at_least) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

void run_side(int64_t* mine, int64_t* theirs, int64_t num_words, int64_t rounds, uint64_t seed, int side,
              double timeout_s, int64_t corrupt_round, int64_t* result) {
  const auto limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(timeout_s));
  int64_t* inbox = mine + kExchangeHeaderWords;
  int64_t* outbox = theirs + kExchangeHeaderWords;
  for (int64_t r = 1; r <= rounds; ++r) {
    if (!wait_at_least(mine + kExchangeAck, r - 1, std::chrono::steady_clock::now() + limit)) {
      result[kResultTimedOut] = 1;
      return;
    }
    for (int64_t i = 0; i < num_words; ++i) {
      uint64_t w = exchange_word(seed, side, r, i);
      if (side == 0 && r == corrupt_round && i == num_words / 2) w ^= 1;
      outbox[i] = static_cast<int64_t>(w);
    }
    __atomic_store_n(theirs + kExchangeReady, r, __ATOMIC_RELEASE);
    if (!wait_at_least(mine + kExchangeReady, r, std::chrono::steady_clock::now() + limit)) {
      result[kResultTimedOut] = 1;
      return;
    }
    int64_t round_wrong = 0, round_first = -1;
    for (int64_t i = 0; i < num_words; ++i) {
      if (static_cast<uint64_t>(inbox[i]) != exchange_word(seed, 1 - side, r, i)) {
        if (round_wrong++ == 0) round_first = i;
      }
    }
    __atomic_store_n(theirs + kExchangeAck, r, __ATOMIC_RELEASE);
    result[kResultWrong] += round_wrong;
    if (round_wrong && result[kResultFirstBadRound] < 0) {
      result[kResultFirstBadRound] = r;
      result[kResultFirstBadWord] = round_first;
    }
    result[kResultRoundsDone] = r;
  }
}

at::Tensor peer_exchange_cpu(const at::Tensor& a, const at::Tensor& b, int64_t rounds, int64_t seed,
                             double timeout_s, int64_t corrupt_round, int64_t stall_side) {
  check_peer_exchange(kOp, a, b, rounds, timeout_s, corrupt_round, stall_side, kExchangeHeaderWords);
  TORCH_CHECK_VALUE(a.is_cpu() && b.is_cpu(), kOp, ": a and b must both be on the CPU here (two GPUs for the GPU "
                    "probe), got ", a.device(), " and ", b.device());
  a.zero_();
  b.zero_();
  at::Tensor out = at::zeros({2, kExchangeResultWords}, a.options());
  int64_t* rows = out.mutable_data_ptr<int64_t>();
  for (int side = 0; side < 2; ++side) {
    rows[side * kExchangeResultWords + kResultFirstBadRound] = -1;
    rows[side * kExchangeResultWords + kResultFirstBadWord] = -1;
  }
  int64_t* ends[2] = {a.mutable_data_ptr<int64_t>(), b.mutable_data_ptr<int64_t>()};
  const int64_t num_words = a.numel() - kExchangeHeaderWords;
  std::thread sides[2];
  for (int side = 0; side < 2; ++side) {
    if (side == stall_side) continue;  // the test hook: this side never runs
    sides[side] = std::thread(run_side, ends[side], ends[1 - side], num_words, rounds, u64(seed), side, timeout_s,
                              corrupt_round, rows + side * kExchangeResultWords);
  }
  for (auto& t : sides) {
    if (t.joinable()) t.join();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CPU, m) { m.impl("peer_exchange", &peer_exchange_cpu); }

}  // namespace pyxfer
