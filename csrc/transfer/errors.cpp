// The structured error channel of verified transfers: the host latch of deferred mismatches, the
// per-thread record of the last sync failure, and the ops that hand either to Python as the same
// int[] record (schemas in csrc/torch_bindings.cpp; decoded by pyxfer/transfer.py).
#include "transfer/errors.h"

#include <torch/library.h>

#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace pyxfer {
namespace {

std::mutex latch_mutex;
TransferErrorRecord host_latch;

// A thread reads back the failure its own sync copy raised (the op call and its caller share it).
thread_local TransferErrorRecord sync_error;

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

// [count, src, dst, num_bytes, src_hash, dst_hash, route (0 not recorded, 1 direct, 2 staged),
// attempt, retry_dst_hash], hashes as the int64 of their bits; [] for no failure.
std::vector<int64_t> encode(const TransferErrorRecord& r) {
  if (r.count == 0) return {};
  return {r.count, r.src, r.dst, r.num_bytes, int64_t(r.src_hash), int64_t(r.dst_hash),
          int64_t(r.route), r.attempt, int64_t(r.retry_dst_hash)};
}

std::vector<int64_t> take_transfer_errors_op() {
  TransferErrorRecord r;
  {
    std::lock_guard<std::mutex> lock(latch_mutex);
    r = host_latch;
    host_latch = TransferErrorRecord{};
  }
  for (const PathFamily& family : path_families()) {
    if (family.take_errors == nullptr) continue;
    const TransferErrorRecord g = family.take_errors();  // waits for the devices with deferred copies
    if (r.count == 0) r = g; else r.count += g.count;
  }
  return encode(r);
}

std::vector<int64_t> take_sync_transfer_error_op() {
  const TransferErrorRecord r = sync_error;
  sync_error = TransferErrorRecord{};
  return encode(r);
}

}  // namespace

void latch_host_error(int64_t src, int64_t dst, int64_t num_bytes, uint64_t src_hash, uint64_t dst_hash) {
  std::lock_guard<std::mutex> lock(latch_mutex);
  if (host_latch.count++ == 0) {
    host_latch.src = src;
    host_latch.dst = dst;
    host_latch.num_bytes = num_bytes;
    host_latch.src_hash = src_hash;
    host_latch.dst_hash = dst_hash;
  }
}

void raise_transfer_error(const TransferErrorRecord& r) {
  sync_error = r;
  TORCH_CHECK(false, "pyxfer.TransferError: copy ", device_name(r.src), " -> ", device_name(r.dst), " of ",
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
