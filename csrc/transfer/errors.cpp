// The structured error channel of verified transfers: the per-thread host latch of deferred
// mismatches, the per-thread record of the last sync failure, and the ops that hand either to Python as the same
// int[] record (schemas in csrc/torch_bindings.cpp; decoded by pyxfer/transfer.py).
#include "transfer/errors.h"

#include <torch/library.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace pyxfer {
namespace {

// Deferred mismatches belong to the thread that made the copy (its check_transfers() reports them).
constexpr size_t kHostRecords = 16;  // kept per thread between takes (the count keeps counting)
thread_local TransferErrors host_latch;

// A thread reads back the failure its own sync copy raised (the op call and its caller share it).
thread_local TransferErrorRecord sync_error;

thread_local int64_t current_batch_index = -1;

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

// [count, src, dst, num_bytes, src_hash, dst_hash, route (0 not recorded, 1 direct, 2 staged),
// attempt, retry_dst_hash, index (in a verified_copy_many call; -1: none)], hashes as the int64 of their
// bits; [] for no failure.
std::vector<int64_t> encode(const TransferErrorRecord& r) {
  if (r.count == 0) return {};
  return {r.count, r.src, r.dst, r.num_bytes, int64_t(r.src_hash), int64_t(r.dst_hash),
          int64_t(r.route), r.attempt, int64_t(r.retry_dst_hash), r.index};
}

// The first record as encode() lays it out (count: every mismatch), then [src, dst] of each later
// record whose pair differs from the ones before: check_transfers marks every such pair corrupt.
// A count without any record (all of them still being written by kernels) has src = dst = -2.
std::vector<int64_t> take_transfer_errors_op() {
  TransferErrors all = std::move(host_latch);
  host_latch = TransferErrors{};
  for (const PathFamily& family : path_families()) {
    if (family.take_errors == nullptr) continue;
    TransferErrors g = family.take_errors();  // waits for the devices with this thread's deferred copies
    all.count += g.count;
    all.records.insert(all.records.end(), g.records.begin(), g.records.end());
  }
  if (all.count == 0) return {};
  TransferErrorRecord first;
  if (!all.records.empty()) first = all.records.front();
  else first.src = first.dst = kAnyDevice;
  first.count = all.count;
  std::vector<int64_t> out = encode(first);
  std::vector<std::pair<int64_t, int64_t>> pairs{{first.src, first.dst}};
  for (const TransferErrorRecord& r : all.records) {
    if (std::find(pairs.begin(), pairs.end(), std::make_pair(r.src, r.dst)) != pairs.end()) continue;
    pairs.emplace_back(r.src, r.dst);
    out.push_back(r.src);
    out.push_back(r.dst);
  }
  return out;
}

std::vector<int64_t> take_sync_transfer_error_op() {
  const TransferErrorRecord r = sync_error;
  sync_error = TransferErrorRecord{};
  return encode(r);
}

}  // namespace

int64_t batch_index() { return current_batch_index; }

BatchIndexScope::BatchIndexScope(int64_t index) : previous_(current_batch_index) { current_batch_index = index; }

BatchIndexScope::~BatchIndexScope() { current_batch_index = previous_; }

void latch_host_error(int64_t src, int64_t dst, int64_t num_bytes, uint64_t src_hash, uint64_t dst_hash) {
  ++host_latch.count;
  if (host_latch.records.size() >= kHostRecords) return;
  TransferErrorRecord r;
  r.count = 1;
  r.src = src;
  r.dst = dst;
  r.num_bytes = num_bytes;
  r.src_hash = src_hash;
  r.dst_hash = dst_hash;
  r.index = current_batch_index;
  host_latch.records.push_back(r);
}

void raise_transfer_error(const TransferErrorRecord& r) {
  sync_error = r;
  const std::string which = r.index >= 0 ? "tensors[" + std::to_string(r.index) + "]: " : "";
  TORCH_CHECK(false, "pyxfer.TransferError: ", which, "copy ", device_name(r.src), " -> ", device_name(r.dst), " of ",
              r.num_bytes, " bytes failed verification on the ", r.route == Route::kDirect ? "direct" : "staged",
              " path and again on the staged path: source PXH64 ", hex(r.src_hash), ", destination PXH64 ",
              hex(r.dst_hash), " (first try), ", hex(r.retry_dst_hash), " (staged retry)");
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) {
  m.impl("take_transfer_errors", &take_transfer_errors_op);
  m.impl("take_sync_transfer_error", &take_sync_transfer_error_op);
}

}  // namespace pyxfer
