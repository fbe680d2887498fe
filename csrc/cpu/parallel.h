// Splitting CPU work over threads. NOTE: not at::parallel_for / parallel_reduce: ATen's OpenMP
// backend is inline in its headers, so in an extension built without -fopenmp it runs serially
// (and a second OpenMP runtime beside torch's is worse). Threads: at::get_num_threads().
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace pyxfer {

// Calls fn(begin, end) on disjoint ranges covering [0, n), each at least min_per_thread long
// (except when n is smaller), the first on the calling thread. Returns when all are done.
template <typename Fn>
void parallel_for(int64_t n, int64_t min_per_thread, const Fn& fn) {
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(1, min_per_thread)));
  if (num_threads <= 1) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
  const int64_t per_thread = (n + num_threads - 1) / num_threads;
  std::vector<std::thread> workers;
  for (int64_t i = 1; i < num_threads; ++i) {
    const int64_t begin = i * per_thread, end = std::min(n, begin + per_thread);
    if (begin < end) workers.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(int64_t(0), std::min(n, per_thread));
  for (auto& w : workers) w.join();
}

// Sum (mod 2^64) of sum_range(begin, end) over [0, n), split like parallel_for.
template <typename SumRange>
uint64_t parallel_sum(int64_t n, int64_t min_per_thread, const SumRange& sum_range) {
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(1, min_per_thread)));
  const int64_t per_thread = (n + num_threads - 1) / std::max<int64_t>(1, num_threads);
  std::vector<uint64_t> sums(num_threads, 0);
  parallel_for(num_threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) sums[i] = sum_range(std::min(n, i * per_thread), std::min(n, (i + 1) * per_thread));
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return total;
}

}  // namespace pyxfer
