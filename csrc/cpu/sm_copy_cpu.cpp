// sm_copy on the CPU: a memcpy (pull and push are the same there); the op's CUDA kernel is the one
// `pyxfer bench` times. Also the op's device-generic layers, which run before the CPU or CUDA kernel
// (this file is in every build): autograd's in-place rules, and the conjugate / negative bits.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cstring>

#include "checks.h"

namespace pyxfer {
namespace {

constexpr const char* kOp = "pyxfer.sm_copy";

void sm_copy_cpu(const at::Tensor& src, const at::Tensor& dst, bool /*pull*/) {
  check_sm_copy(kOp, src, dst);
  TORCH_CHECK(src.is_cpu() && dst.is_cpu(), kOp, ": src and dst must be on one backend, got src on ", src.device(),
              " and dst on ", dst.device());
  if (dst.nbytes() > 0) std::memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes());
}

using SmCopyFn = void(const at::Tensor&, const at::Tensor&, bool);

const c10::TypedOperatorHandle<SmCopyFn>& sm_copy_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pyxfer::sm_copy", "").typed<SmCopyFn>();
  return op;
}

// Autograd: sm_copy copies bytes and records no history, so where copy_ would record one (grad mode on
// and src or dst requiring grad) it refuses, with copy_'s own words for what copy_ refuses too.
void sm_copy_autograd(c10::DispatchKeySet ks, const at::Tensor& src, const at::Tensor& dst, bool pull) {
  if (at::GradMode::is_enabled()) {
    TORCH_CHECK(!(dst.requires_grad() && dst.is_leaf()), kOp, ": a leaf Variable that requires grad is being used "
                "in an in-place operation (dst); write into it under torch.no_grad(), as copy_ would need");
    TORCH_CHECK(!(dst.requires_grad() && dst.is_view() && dst._base().is_leaf()), kOp, ": a view of a leaf "
                "Variable that requires grad is being used in an in-place operation (dst); write into it under "
                "torch.no_grad(), as copy_ would need");
    TORCH_CHECK(!dst.requires_grad(), kOp, ": dst requires grad, and sm_copy records no autograd history (it copies "
                "bytes); call it under torch.no_grad() or write into a tensor that does not require grad");
    TORCH_CHECK(!src.requires_grad(), kOp, ": src requires grad, and sm_copy records no autograd history (it copies "
                "bytes); pass src.detach() or call it under torch.no_grad()");
  }
  const at::AutoDispatchBelowAutograd guard;
  sm_copy_op().redispatch(ks & c10::after_autograd_keyset, src, dst, pull);
}

// ADInplaceOrView: bump dst's version like every in-place op, so that a tensor autograd saved and
// sm_copy then overwrote makes backward raise instead of computing with the new bytes.
void sm_copy_ad_inplace_or_view(c10::DispatchKeySet ks, const at::Tensor& src, const at::Tensor& dst, bool pull) {
  // copy_ writes first and raises at the bump (VariableVersion::bump); sm_copy refuses before writing.
  TORCH_CHECK(!dst.is_inference() || c10::InferenceMode::is_enabled(), kOp, ": Inplace update to inference tensor "
              "outside InferenceMode is not allowed (dst is an inference tensor); write into a clone, or call "
              "sm_copy inside torch.inference_mode()");
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    sm_copy_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, src, dst, pull);
  }
  torch::autograd::impl::bump_version(dst);
}

// Conjugate / Negative: these replace torch's math-bits fallback for sm_copy. The fallback writes a
// mutated argument back through the op's return value, and sm_copy returns nothing (an internal assert,
// then a corrupted interpreter). A dst with the bit is refused (its bytes would be read back conjugated
// or negated); a src with it is materialized first, as the fallback does, so its values are copied.
template <c10::DispatchKey kKey>
void sm_copy_math_bit(c10::DispatchKeySet ks, const at::Tensor& src, const at::Tensor& dst, bool pull) {
  constexpr bool kConj = kKey == c10::DispatchKey::Conjugate;
  const char* what = kConj ? "conjugate" : "negative";
  TORCH_CHECK_VALUE(!(kConj ? dst.is_conj() : dst.is_neg()), kOp, ": dst must be a tensor without the ", what,
                    " bit, got a ", what, " view (dst.", kConj ? "is_conj()" : "is_neg()", " is True): sm_copy "
                    "writes bytes, which such a view reads back ", kConj ? "conjugated" : "negated",
                    "; write into the tensor it views");
  check_sm_copy(kOp, src, dst);  // before materializing src
  const bool src_bit = kConj ? src.is_conj() : src.is_neg();
  const at::Tensor values = !src_bit ? src : kConj ? src.resolve_conj() : src.resolve_neg();
  const c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  sm_copy_op().redispatch(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), values, dst, pull);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CPU, m) { m.impl("sm_copy", &sm_copy_cpu); }
TORCH_LIBRARY_IMPL(pyxfer, Autograd, m) { m.impl("sm_copy", &sm_copy_autograd); }
TORCH_LIBRARY_IMPL(pyxfer, ADInplaceOrView, m) { m.impl("sm_copy", &sm_copy_ad_inplace_or_view); }
TORCH_LIBRARY_IMPL(pyxfer, Conjugate, m) { m.impl("sm_copy", &sm_copy_math_bit<c10::DispatchKey::Conjugate>); }
TORCH_LIBRARY_IMPL(pyxfer, Negative, m) { m.impl("sm_copy", &sm_copy_math_bit<c10::DispatchKey::Negative>); }

}  // namespace pyxfer
