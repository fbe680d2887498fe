// Verification failures as one structured record for both modes: a sync copy whose staged retry
// failed too raises it (keeping it for its thread: take_sync_transfer_error), deferred comparisons
// latch their mismatches for the thread that made the copy until its take_transfer_errors.
// pyxfer.TransferError carries the fields of the first.
#pragma once

#include <cstdint>
#include <vector>

#include "transfer/transfer.h"

namespace pyxfer {

struct TransferErrorRecord {
  int64_t count = 0;  // failed copies it stands for (deferred: mismatches since the last take; sync: 1); 0: none
  int64_t src = 0, dst = 0, num_bytes = 0;  // device codes; bytes copied
  uint64_t src_hash = 0, dst_hash = 0;      // PXH64 of the source and of the first failing destination
  Route route = Route::kAuto;               // the route of that attempt; kAuto: not recorded (deferred)
  int64_t attempt = 1;                      // the last attempt that failed: 2 when a sync retry failed too
  uint64_t retry_dst_hash = 0;              // destination PXH64 of the staged retry (attempt 2)
  int64_t index = -1;                       // the tensor's index in its verified_copy_many call; -1: none
};

// Deferred mismatches of one thread since its last take: how many, and the records kept of them
// (oldest first; a latch keeps a bounded number, the count says how many there were).
struct TransferErrors {
  int64_t count = 0;
  std::vector<TransferErrorRecord> records;  // count 1 each
};

// The index of the tensor the calling thread's verified_copy_many is copying (-1 outside one): recorded
// with its failures (sync and deferred, host and device latches) so that errors name the tensor.
int64_t batch_index();
// Sets it for the scope's lifetime (restores the previous value).
class BatchIndexScope {
 public:
  explicit BatchIndexScope(int64_t index);
  ~BatchIndexScope();
  BatchIndexScope(const BatchIndexScope&) = delete;
  BatchIndexScope& operator=(const BatchIndexScope&) = delete;

 private:
  int64_t previous_;
};

// The calling thread's host latch, for deferred comparisons done on the CPU; shared with the CUDA
// path for the cases it compares on the host. Records batch_index().
void latch_host_error(int64_t src, int64_t dst, int64_t num_bytes, uint64_t src_hash, uint64_t dst_hash);

// Keeps `r` (a sync failure) for this thread and throws "pyxfer.TransferError: <what failed>".
[[noreturn]] void raise_transfer_error(const TransferErrorRecord& r);

}  // namespace pyxfer
