// Splitting CPU work over the host hashing pool (cpu/host_pool.h): its threads are made once per process,
// not per call. NOTE: not at::parallel_for / parallel_reduce: ATen's OpenMP backend is inline in its
// headers, so in an extension built without -fopenmp it runs serially (and a second OpenMP runtime
// beside torch's is worse).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/host_pool.h"

namespace pyxfer {

// Calls fn(begin, end) on disjoint ranges covering [0, n), each at least min_per_thread long (except
// when n is smaller), on the pool and the calling thread. Returns when all are done; rethrows the first
// exception of fn.
template <typename Fn>
void parallel_for(int64_t n, int64_t min_per_thread, const Fn& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(host_pool_threads() + 1,
                                                               n / std::max<int64_t>(1, min_per_thread)));
  host_parallel_for(n, (n + parts - 1) / parts, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
}

}  // namespace pyxfer
