// The steady-state all-gather (declared and documented in gather/gather.h): the plan registry, the
// device-generic steps, the CPU (gloo) backend and the ops' registrations.
//
// CPU path (gloo): every part and the record are packed into one byte buffer and gathered with one
// all_gather_single, waited for at once (gloo's coalesced all-gather mis-gathers mixed dtypes, and
// more than one gloo gather in flight hung once: see pyxfer/gather/exchange.py), then unpacked; the
// verdict is computed here and written to the latch (host memory) before the op returns, so the CPU
// path keeps the CUDA path's protocol with every step already complete.
#include "gather/gather.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>

#include "cpu/parallel.h"
#include "pyxfer/gather.h"

namespace pyxfer {
namespace gather {

int64_t PartPlan::send_numel() const {
  int64_t n = 1;
  for (int64_t d : send_shape) n *= d;
  return n;
}

namespace {

// gather_stats: [native calls, ns inside the collective calls, verdict waits that found it missing, ns waited]
std::atomic<int64_t> stat_calls{0}, stat_collective_ns{0}, stat_waits{0}, stat_wait_ns{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<int64_t, std::shared_ptr<const GatherPlan>>& registry() {
  static auto* plans = new std::map<int64_t, std::shared_ptr<const GatherPlan>>();  // NOTE: leaked (exit order)
  return *plans;
}

Backend& cuda_backend() {
  static Backend backend{nullptr, nullptr, nullptr, nullptr};
  return backend;
}

at::ScalarType scalar_type(const char* what, int64_t code) {
  TORCH_CHECK(code >= 0 && code < int64_t(c10::ScalarType::NumOptions), kOp, ": plan descriptor: bad ", what,
              " dtype code ", code);
  return static_cast<at::ScalarType>(code);
}

std::vector<int64_t> dims(const std::vector<int64_t>& desc, size_t at, int64_t ndim) {
  TORCH_CHECK(ndim >= 0 && ndim <= kMaxDims, kOp, ": plan descriptor: bad ndim ", ndim);
  return std::vector<int64_t>(desc.begin() + int64_t(at), desc.begin() + int64_t(at) + ndim);
}

GatherPlan parse(const std::vector<int64_t>& d) {
  TORCH_CHECK(d.size() >= size_t(kHeaderWords) && d[0] == kPlanVersion, kOp,
              ": plan descriptor of another version (pyxfer's Python and native parts differ: rebuild pyxfer)");
  GatherPlan p;
  p.world = d[1];
  p.rank = d[2];
  p.record_len = d[3];
  p.compare_len = d[4];
  p.hash_slot = d[5];
  const int64_t num_parts = d[6];
  TORCH_CHECK(p.world >= 1 && p.rank >= 0 && p.rank < p.world && p.compare_len >= 1 &&
                  p.compare_len <= kMaxCompare && p.compare_len <= p.record_len && num_parts >= 0 &&
                  p.hash_slot + num_parts <= p.record_len && d.size() == size_t(kHeaderWords + num_parts * kPartWords),
              kOp, ": malformed plan descriptor");
  Nvfp4Plan& n = p.nvfp4;
  n.enabled = d[7] != 0;
  n.shard_m = d[8];
  n.k = d[9];
  n.nominal = int(d[10]);
  n.rowwise = d[11] != 0;
  n.columnwise = d[12] != 0;
  n.amax_row_slot = int(d[13]);
  n.amax_col_slot = int(d[14]);
  n.row_data = int(d[15]);
  n.row_scale = int(d[16]);
  n.col_data = int(d[17]);
  n.col_scale = int(d[18]);
  for (int64_t i = 0; i < num_parts; ++i) {
    const size_t at = size_t(kHeaderWords + i * kPartWords);
    PartPlan q;
    q.src = int(d[at]);
    q.send_dtype = scalar_type("send", d[at + 1]);
    q.as_bytes = d[at + 2] != 0;
    q.trim_rows = d[at + 3];
    q.trim_cols = d[at + 4];
    q.send_shape = dims(d, at + 6, d[at + 5]);
    q.fixup = static_cast<Fixup>(d[at + 14]);
    q.out_dtype = scalar_type("result", d[at + 15]);
    q.out_shape = dims(d, at + 17, d[at + 16]);
    q.pad_rows = d[at + 25];
    q.pad_cols = d[at + 26];
    q.poison_width = int(d[at + 27]);
    q.poison_pattern = d[at + 28];
    TORCH_CHECK(q.src >= 0 && d[at + 14] >= 0 && d[at + 14] <= 2 &&
                    (q.poison_width == 0 || q.poison_width == 1 || q.poison_width == 2 || q.poison_width == 4 ||
                     q.poison_width == 8),
                kOp, ": malformed plan part ", i);
    p.parts.push_back(std::move(q));
  }
  if (n.enabled) {
    const auto ok = [&](int i) { return i >= -1 && i < int(num_parts); };
    TORCH_CHECK(ok(n.row_data) && ok(n.row_scale) && ok(n.col_data) && ok(n.col_scale) &&
                    (n.rowwise == (n.row_data >= 0 && n.row_scale >= 0)) &&
                    (n.columnwise == (n.col_data >= 0 && n.col_scale >= 0)) && n.amax_row_slot >= p.compare_len &&
                    n.amax_col_slot >= p.compare_len && n.amax_row_slot < p.record_len &&
                    n.amax_col_slot < p.record_len,
                kOp, ": malformed NVFP4 plan");
  }
  return p;
}

int64_t plan_new(c10::IntArrayRef desc) {
  auto plan = std::make_shared<const GatherPlan>(parse(desc.vec()));
  const std::lock_guard<std::mutex> lock(registry_mutex());
  static int64_t next_id = 0;
  registry()[++next_id] = std::move(plan);
  return next_id;
}

void plan_free(int64_t id) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(id);
}

at::Tensor as_flat_bytes(const at::Tensor& t) {
  const at::Tensor flat = t.reshape({-1});
  return flat.scalar_type() == at::kByte ? flat : flat.view(at::kByte);
}

at::Tensor checksum_op(const at::Tensor& t) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyxfer::checksum", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(t, 0);
}

// ---- the CPU backend --------------------------------------------------------------------------------

void write_latch_cpu(int64_t* w, int64_t seq, bool bad, bool renorm) {
  if (bad) {
    w[kLatchStickyBadSeq] = seq;
    w[kLatchStickyBad] = 1;
  }
  if (renorm) {
    w[kLatchStickyRenormSeq] = seq;
    w[kLatchStickyRenorm] = 1;
  }
  w[latch_slot(seq, false)] = slot_word(seq, bad, renorm);
}

// The verdict of `seq` (the CPU path wrote it before its op returned).
bool latch_verdict_bad_cpu(const int64_t* latch, int64_t seq) {
  const int64_t word = latch[latch_slot(seq, false)];
  TORCH_CHECK((word >> kSlotShift) == seq, kOp, ": internal error: the verdict of call ", seq,
              " is missing from the latch");
  return (word & kVerdictBad) != 0;
}

uint32_t float_bits_of(const at::Tensor& amax) {
  const at::Tensor a = amax.reshape({-1}).to(at::kFloat).contiguous();
  uint32_t bits;
  std::memcpy(&bits, a.data_ptr<float>(), sizeof(bits));
  return bits;
}

Posted post_cpu(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const GatherPlan& plan,
                const std::vector<at::Tensor>& inputs, const at::Tensor& meta, const std::vector<at::Tensor>& amax,
                int64_t* latch, int64_t seq, int64_t wait_seq, int64_t mode) {
  const at::TensorOptions options = meta.options();
  std::vector<at::Tensor> sends = prepare_sends(plan, inputs, (mode & kModeScratch) != 0, options);
  at::Tensor meta_send = meta.contiguous();
  if (!amax.empty() || (mode & kModeHashes)) {
    meta_send = meta_send.clone();
    int64_t* m = meta_send.data_ptr<int64_t>();
    if (!amax.empty()) {  // the int32 bits, sign-extended (as the Python record writes them)
      m[plan.nvfp4.amax_row_slot] = int64_t(int32_t(float_bits_of(amax[0])));
      m[plan.nvfp4.amax_col_slot] = int64_t(int32_t(float_bits_of(amax[1])));
    }
    if (mode & kModeHashes) write_hashes(plan, sends, meta_send);
  }
  Posted posted = allocate_receives(plan, options);
  if (wait_seq > 0 && latch_verdict_bad_cpu(latch, wait_seq)) return Posted{};
  posted.posted = true;
  // One byte buffer: every part's bytes, then the record.
  std::vector<at::Tensor> send_bytes;
  std::vector<int64_t> sizes;
  for (const at::Tensor& s : sends) {
    send_bytes.push_back(as_flat_bytes(s));
    sizes.push_back(send_bytes.back().numel());
  }
  send_bytes.push_back(as_flat_bytes(meta_send));
  sizes.push_back(send_bytes.back().numel());
  at::Tensor packed = at::cat(send_bytes);
  const int64_t total = packed.numel();
  at::Tensor gathered = at::empty({plan.world * total}, packed.options());
  c10d::AllgatherOptions opts;
  const int64_t started = now_ns();
  c10::intrusive_ptr<c10d::Work> work = all_gather_single(*pg, gathered, packed, opts, 0);
  if (work) work->wait();
  work.reset();  // NOTE: no Work object outlives its use (a gloo Work that outlives its group aborts at exit)
  note_collective(now_ns() - started);
  const std::vector<at::Tensor> columns = gathered.view({plan.world, total}).split_with_sizes(sizes, 1);
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sizes[i] == 0) continue;
    as_flat_bytes(receive_view(plan, i, posted)).view({plan.world, sizes[i]}).copy_(columns[i]);
  }
  as_flat_bytes(posted.meta_recv).view({plan.world, sizes.back()}).copy_(columns.back());
  if (mode & kModeVerdict) {
    const int64_t* records = posted.meta_recv.data_ptr<int64_t>();
    const bool bad = records_disagree_host(plan, records);
    const bool renorm = plan.nvfp4.enabled && !bad &&
                        nvfp4_amaxes(records, int(plan.world), int(plan.record_len), plan.nvfp4.amax_row_slot,
                                     plan.nvfp4.amax_col_slot)
                            .renormalise;
    write_latch_cpu(latch, seq, bad, renorm);
  }
  return posted;
}

void poison_cpu(const at::Tensor& t, int width, int64_t pattern) {
  if (width == 0 || t.numel() == 0) return;
  uint8_t* p = static_cast<uint8_t*>(t.data_ptr());
  const int64_t count = int64_t(t.nbytes()) / width;
  for (int64_t i = 0; i < count; ++i) std::memcpy(p + i * width, &pattern, size_t(width));  // little-endian
}

template <typename T>
float round_to(float v) {
  return static_cast<float>(T(v));
}

void renormalise_cpu(const GatherPlan& plan, const std::vector<at::Tensor>& finals, const int64_t* records,
                     float group_max) {
  const Nvfp4Plan& n = plan.nvfp4;
  Nvfp4Gathered g{};
  g.row_data = n.rowwise ? finals[n.row_data].data_ptr<uint8_t>() : nullptr;
  g.row_scale = n.rowwise ? finals[n.row_scale].data_ptr<uint8_t>() : nullptr;
  g.col_data = n.columnwise ? finals[n.col_data].data_ptr<uint8_t>() : nullptr;
  g.col_scale = n.columnwise ? finals[n.col_scale].data_ptr<uint8_t>() : nullptr;
  g.shard_m = n.shard_m;
  g.k = n.k;
  g.world = plan.world;
  g.row_scale_cols = n.rowwise ? finals[n.row_scale].size(1) : 0;
  g.col_scale_cols = n.columnwise ? finals[n.col_scale].size(1) : 0;
  const bool from_rowwise = n.rowwise;
  const int amax_slot = from_rowwise ? n.amax_row_slot : n.amax_col_slot;
  const auto shard_amax = [&](int64_t r) { return fmt::bits_float(uint32_t(records[r * plan.record_len + amax_slot])); };
  const float s_enc = fmt::nvfp4_encode_scale(group_max);
  const float s_dec = static_cast<float>(1.0 / static_cast<double>(s_enc));
  const int64_t wm = plan.world * n.shard_m, bl = fmt::kNvfp4BlockLen;
  const auto pass = [&](bool rowwise_out, const auto& round) {
    const int64_t lines = rowwise_out ? wm : n.k, blocks = rowwise_out ? n.k / bl : wm / bl;
    parallel_for(lines, 64, [&](int64_t begin, int64_t end) {
      for (int64_t line = begin; line < end; ++line)
        for (int64_t b = 0; b < blocks; ++b)
          nvfp4_renormalise_block(g, rowwise_out, from_rowwise, line, b, s_enc, s_dec, round, shard_amax);
    });
  };
  const auto both = [&](const auto& round) {
    if (n.columnwise) pass(false, round);  // first: it may read the rowwise bytes the rowwise pass rewrites
    if (n.rowwise) pass(true, round);
  };
  if (n.nominal == 1) {
    both([](float v) { return round_to<c10::BFloat16>(v); });
  } else if (n.nominal == 2) {
    both([](float v) { return round_to<c10::Half>(v); });
  } else {
    both([](float v) { return v; });
  }
}

void swap_cpu(const at::Tensor& src, at::Tensor& dst, int64_t a_count, int64_t b_count, int64_t row_bytes) {
  const auto* in = static_cast<const uint8_t*>(src.data_ptr());
  auto* out = static_cast<uint8_t*>(dst.data_ptr());
  parallel_for(a_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a)
      for (int64_t b = 0; b < b_count; ++b)
        std::memcpy(out + (b * a_count + a) * row_bytes, in + (a * b_count + b) * row_bytes, size_t(row_bytes));
  });
}

void finish_cpu(const GatherPlan& plan, const std::vector<at::Tensor>& results, const std::vector<at::Tensor>& temps,
                const at::Tensor& meta_recv, int64_t seq, int64_t mode) {
  (void)seq;
  fix_up(plan, results, temps, &swap_cpu);
  const int64_t* records = meta_recv.data_ptr<int64_t>();
  const bool bad = (mode & kModeVerdict) && records_disagree_host(plan, records);
  if (bad) {
    for (size_t i = 0; i < plan.parts.size(); ++i)
      poison_cpu(results[i], plan.parts[i].poison_width, plan.parts[i].poison_pattern);
  }
  if (!plan.nvfp4.enabled) return;
  const Nvfp4Amaxes a = nvfp4_amaxes(records, int(plan.world), int(plan.record_len), plan.nvfp4.amax_row_slot,
                                     plan.nvfp4.amax_col_slot);
  const uint32_t nan_bits = 0x7FC00000u;
  const uint32_t row_bits = bad ? nan_bits : a.row_bits, col_bits = bad ? nan_bits : a.col_bits;
  const size_t n = plan.parts.size();
  std::memcpy(results[n].data_ptr<float>(), &row_bits, 4);
  std::memcpy(results[n + 1].data_ptr<float>(), &col_bits, 4);
  if (!bad && a.renormalise) renormalise_cpu(plan, results, records, a.group_max);
}

// ---- the ops -----------------------------------------------------------------------------------------

const Backend& backend_for(const at::Tensor& t) {
  if (t.is_cuda()) {
    TORCH_CHECK(cuda_backend().post != nullptr, kOp, ": the data is on ", t.device(),
                " but pyxfer was built without CUDA (pyxfer.build_info()['cuda'] is False)");
    return cuda_backend();
  }
  TORCH_CHECK(t.is_cpu(), kOp, ": gathered tensors must be on the CPU or a CUDA device, got ", t.device());
  static const Backend cpu{&post_cpu, &finish_cpu, nullptr, nullptr};
  return cpu;
}

std::shared_ptr<const GatherPlan> plan_of(int64_t id) {
  std::shared_ptr<const GatherPlan> plan = find_plan(id);
  TORCH_CHECK(plan != nullptr, kOp, ": unknown plan id ", id);
  return plan;
}

void check_meta(const GatherPlan& plan, const at::Tensor& meta, const char* what, int64_t rows) {
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 1 && meta.numel() == rows * plan.record_len &&
                  meta.is_contiguous(),
              kOp, ": ", what, " must be a contiguous 1-D int64 tensor of ", rows * plan.record_len, " elements, got ",
              meta.scalar_type(), " ", meta.sizes());
}

std::mutex& latch_mutex() {
  static std::mutex m;
  return m;
}
std::map<int64_t, bool>& latches() {  // address -> on a CUDA device
  static auto* known = new std::map<int64_t, bool>();  // NOTE: leaked, as the latches themselves
  return *known;
}

// The latch named by its address, which must be one gather_latch_new made for the data's device kind.
int64_t* latch_at(int64_t address, bool cuda) {
  const std::lock_guard<std::mutex> lock(latch_mutex());
  const auto it = latches().find(address);
  TORCH_CHECK(it != latches().end() && it->second == cuda, kOp, ": latch ", address,
              " is not a latch of pyxfer.gather for ", cuda ? "a CUDA device" : "the CPU");
  return reinterpret_cast<int64_t*>(address);
}

// gather_post's outputs: results, temps, meta_recv ([] when nothing was posted).
std::vector<at::Tensor> posted_outputs(Posted posted, bool with_temps) {
  if (!posted.posted) return {};
  std::vector<at::Tensor> out = std::move(posted.results);
  if (with_temps) out.insert(out.end(), posted.temps.begin(), posted.temps.end());
  out.push_back(posted.meta_recv);
  return out;
}

size_t num_swaps(const GatherPlan& plan) {
  size_t n = 0;
  for (const PartPlan& p : plan.parts) n += p.fixup == Fixup::kSwap;
  return n;
}

size_t num_results(const GatherPlan& plan) { return plan.parts.size() + (plan.nvfp4.enabled ? 2 : 0); }

c10::intrusive_ptr<c10d::ProcessGroup> group_named(c10::string_view name) {
  // (resolve_process_group raises a clear error for a name no live group has)
  return c10d::resolve_process_group(std::string(name));
}

std::vector<at::Tensor> gather_post_impl(c10::string_view group, int64_t plan_id,
                                         at::TensorList inputs, const at::Tensor& meta, at::TensorList amax,
                                         int64_t latch_address, int64_t seq, int64_t wait_seq, int64_t mode) {
  const std::shared_ptr<const GatherPlan> plan = plan_of(plan_id);
  check_meta(*plan, meta, "meta", 1);
  int64_t* latch = latch_at(latch_address, meta.is_cuda());
  TORCH_CHECK(amax.empty() || (plan->nvfp4.enabled && amax.size() == 2), kOp, ": amax must be empty or hold the "
              "(rowwise, columnwise) amax of an NVFP4 plan");
  stat_calls += 1;
  return posted_outputs(
      backend_for(meta).post(group_named(group), *plan, inputs.vec(), meta, amax.vec(), latch, seq, wait_seq, mode),
      true);
}

void gather_finish_impl(int64_t plan_id, at::TensorList results, at::TensorList temps, const at::Tensor& meta_recv,
                        int64_t seq, int64_t mode) {
  const std::shared_ptr<const GatherPlan> plan = plan_of(plan_id);
  check_meta(*plan, meta_recv, "meta_recv", plan->world);
  TORCH_CHECK(results.size() == num_results(*plan) && temps.size() == num_swaps(*plan), kOp, ": finish takes ",
              num_results(*plan), " results and ", num_swaps(*plan), " temporaries, got ", results.size(), " and ",
              temps.size());
  backend_for(meta_recv).finish(*plan, results.vec(), temps.vec(), meta_recv, seq, mode);
}

void gather_join_impl(const at::Tensor& meta_recv, int64_t seq) {
  TORCH_CHECK(meta_recv.scalar_type() == at::kLong && meta_recv.dim() == 1, kOp,
              ": meta_recv must be the 1-D int64 records of a posted call, got ", meta_recv.scalar_type(), " ",
              meta_recv.sizes());
  TORCH_CHECK(seq > 0, kOp, ": seq must be a posted call's number (> 0), got ", seq);
  const Backend& backend = backend_for(meta_recv);
  if (backend.join != nullptr) backend.join(meta_recv.device(), seq);
}

std::vector<at::Tensor> gather_run_impl(c10::string_view group, int64_t plan_id,
                                        at::TensorList inputs, const at::Tensor& meta, at::TensorList amax,
                                        int64_t latch_address, int64_t seq, int64_t wait_seq, int64_t mode) {
  TORCH_CHECK(!(mode & (kModeAsync | kModeScratch)), kOp, ": gather_run is the synchronous call of real data");
  const std::shared_ptr<const GatherPlan> plan = plan_of(plan_id);
  check_meta(*plan, meta, "meta", 1);
  int64_t* latch = latch_at(latch_address, meta.is_cuda());
  stat_calls += 1;
  const Backend& backend = backend_for(meta);
  Posted posted = backend.post(group_named(group), *plan, inputs.vec(), meta, amax.vec(), latch, seq, wait_seq, mode);
  if (posted.posted) backend.finish(*plan, posted.results, posted.temps, posted.meta_recv, seq, mode);
  return posted_outputs(std::move(posted), false);
}

}  // namespace

// ---- device-generic steps ----------------------------------------------------------------------------

std::shared_ptr<const GatherPlan> find_plan(int64_t id) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  const auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

void note_collective(int64_t ns) { stat_collective_ns += ns; }

void note_verdict_wait(bool waited, int64_t ns) {
  if (!waited) return;
  stat_waits += 1;
  stat_wait_ns += ns;
}

bool register_cuda_backend(const Backend& backend) {
  cuda_backend() = backend;
  return true;
}

bool records_disagree_host(const GatherPlan& plan, const int64_t* records) {
  return records_disagree(records, int(plan.world), int(plan.record_len), records + plan.rank * plan.record_len,
                          int(plan.compare_len));
}

std::vector<at::Tensor> prepare_sends(const GatherPlan& plan, const std::vector<at::Tensor>& inputs, bool scratch,
                                      const at::TensorOptions& device_options) {
  std::vector<at::Tensor> sends;
  sends.reserve(plan.parts.size());
  for (size_t i = 0; i < plan.parts.size(); ++i) {
    const PartPlan& p = plan.parts[i];
    if (scratch) {  // nobody reads it: uninitialized, of the size the peers send
      sends.push_back(at::empty({p.send_numel()}, device_options.dtype(p.send_dtype)));
      continue;
    }
    TORCH_CHECK(size_t(p.src) < inputs.size(), kOp, ": plan part ", i, " reads input ", p.src, " of ",
                inputs.size());
    at::Tensor t = inputs[p.src];
    if (p.trim_rows >= 0) {
      TORCH_CHECK(t.dim() == 2, kOp, ": input ", p.src, " must be 2-D");
      if (p.trim_cols != t.size(1)) t = t.narrow(1, 0, p.trim_cols);
      if (p.trim_rows != t.size(0)) t = t.narrow(0, 0, p.trim_rows);
    }
    t = t.is_contiguous() ? t.reshape({-1}) : t.contiguous().reshape({-1});
    if (p.as_bytes) t = as_flat_bytes(t);  // send_shape counts bytes then
    TORCH_CHECK(t.numel() == p.send_numel(), kOp, ": input ", p.src, " gives ", t.numel(), " elements, its plan sends ",
                p.send_numel());
    sends.push_back(t);
  }
  return sends;
}

Posted allocate_receives(const GatherPlan& plan, const at::TensorOptions& device_options) {
  Posted posted;
  for (const PartPlan& p : plan.parts) {
    if (p.fixup == Fixup::kSwap) {
      posted.temps.push_back(at::empty({plan.world * p.send_numel()}, device_options.dtype(p.send_dtype)));
      posted.results.push_back(p.pad_rows < 0 ? at::empty(p.out_shape, device_options.dtype(p.out_dtype))
                                              : at::zeros({p.pad_rows, p.pad_cols}, device_options.dtype(p.out_dtype)));
      continue;
    }
    at::Tensor out = at::empty(p.out_shape, device_options.dtype(p.out_dtype));
    if (p.fixup == Fixup::kPrefix) {  // its padding rows: the collective never writes them
      const int64_t rows = plan.world * p.send_shape[0];
      if (rows < out.size(0)) out.narrow(0, rows, out.size(0) - rows).zero_();
    }
    posted.results.push_back(out);
  }
  if (plan.nvfp4.enabled) {
    posted.results.push_back(at::empty({1}, device_options.dtype(at::kFloat)));
    posted.results.push_back(at::empty({1}, device_options.dtype(at::kFloat)));
  }
  posted.meta_recv = at::empty({plan.world * plan.record_len}, device_options.dtype(at::kLong));
  return posted;
}

at::Tensor receive_view(const GatherPlan& plan, size_t i, const Posted& posted) {
  const PartPlan& p = plan.parts[i];
  if (p.fixup == Fixup::kSwap) {  // the temporary is exactly the rank-major buffer
    size_t k = 0;
    for (size_t j = 0; j < i; ++j) k += plan.parts[j].fixup == Fixup::kSwap;
    return posted.temps[k];
  }
  const at::Tensor flat = p.as_bytes ? as_flat_bytes(posted.results[i]) : posted.results[i].reshape({-1});
  return flat.narrow(0, 0, plan.world * p.send_numel());
}

void fix_up(const GatherPlan& plan, const std::vector<at::Tensor>& results, const std::vector<at::Tensor>& temps,
            SwapFn swap) {
  size_t k = 0;
  for (size_t i = 0; i < plan.parts.size(); ++i) {
    const PartPlan& p = plan.parts[i];
    if (p.fixup != Fixup::kSwap) continue;
    const at::Tensor& temp = temps[k++];
    // rank-major [W, A, B...] -> [A, W, B...]
    const int64_t a_rows = p.send_shape[0];
    const int64_t row_bytes = a_rows == 0 ? 0 : int64_t(temp.nbytes()) / (plan.world * a_rows);
    at::Tensor dst = results[i];
    const bool direct = p.pad_rows < 0 || (p.pad_cols == plan.world * p.send_shape[1]);
    if (!direct) dst = at::empty({a_rows, plan.world * p.send_shape[1]}, temp.options());
    if (temp.numel() > 0) swap(temp, dst, plan.world, a_rows, row_bytes);
    if (!direct) results[i].narrow(0, 0, a_rows).narrow(1, 0, dst.size(1)).copy_(dst);
  }
}

void write_hashes(const GatherPlan& plan, const std::vector<at::Tensor>& sends, at::Tensor& meta) {
  if (sends.empty()) return;
  std::vector<at::Tensor> hashes;
  for (const at::Tensor& s : sends) hashes.push_back(checksum_op(s));
  meta.narrow(0, plan.hash_slot, int64_t(sends.size())).copy_(at::stack(hashes));
}

namespace {

at::Tensor gather_latch_new_impl(c10::Device device) {
  int64_t* words = nullptr;
  if (device.is_cuda()) {
    TORCH_CHECK(cuda_backend().new_latch != nullptr, kOp, ": ", device,
                " but pyxfer was built without CUDA (pyxfer.build_info()['cuda'] is False)");
    words = cuda_backend().new_latch(device);
  } else {
    TORCH_CHECK(device.is_cpu(), kOp, ": a latch serves the CPU or a CUDA device, got ", device);
    words = new int64_t[kLatchWords]();  // NOTE: never freed, as a CUDA latch
  }
  {
    const std::lock_guard<std::mutex> lock(latch_mutex());
    latches()[reinterpret_cast<int64_t>(words)] = device.is_cuda();
  }
  return at::from_blob(words, {kLatchWords}, at::TensorOptions().dtype(at::kLong));
}

std::vector<int64_t> gather_stats_impl(bool reset) {
  std::vector<int64_t> out{stat_calls.load(), stat_collective_ns.load(), stat_waits.load(), stat_wait_ns.load()};
  if (reset) stat_calls = stat_collective_ns = stat_waits = stat_wait_ns = 0;
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CompositeExplicitAutograd, m) {
  m.impl("gather_post", &gather_post_impl);
  m.impl("gather_finish", &gather_finish_impl);
  m.impl("gather_join", &gather_join_impl);
  m.impl("gather_run", &gather_run_impl);
}

// No tensor arguments: the catch-all (CompositeImplicitAutograd) kernel, as def(schema, fn) registers.
TORCH_LIBRARY_IMPL(pyxfer, CompositeImplicitAutograd, m) {
  m.impl("gather_plan_new", &plan_new);
  m.impl("gather_plan_free", &plan_free);
  m.impl("gather_latch_new", &gather_latch_new_impl);
  m.impl("gather_stats", &gather_stats_impl);
}

}  // namespace gather
}  // namespace pyxfer
