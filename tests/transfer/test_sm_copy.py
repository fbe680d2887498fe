"""torch.ops.pyxfer.sm_copy (the copy kernel `pyxfer bench` times as sm_pull / sm_push): exact bytes
into a sentinel-filled destination, every argument check, and the rules of an in-place op (conjugate and
negative views, autograd's version counter, tensors that require grad, inference and meta tensors).
CPU here (a memcpy); on GPUs, one device and across two, in tests/transfer/test_sm_copy_gpu.py."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pyxfer  # noqa: F401  (registers the ops)

from support.processes import run_python
from support.sm_copy import (
    MATH_BIT_DST_SCRIPT,
    assert_sentinel,
    check_exact,
    flip_sign_bits,
    run_sm_copy,
    sentinel_like,
)
from support.tensors import random_tensor


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 4099, (1 << 20) + 5])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("pull", [True, False])
def test_exact_bytes_on_cpu(n, offset, pull, gen):
    base = random_tensor((n + offset,), torch.uint8, gen)
    dst, whole = run_sm_copy(base[offset:], "cpu", pull)
    check_exact(base[offset:], dst, whole)


def test_other_dtypes_same_bytes(gen):
    src = random_tensor((7, 5), torch.float64, gen)
    dst = torch.full((35,), -1, dtype=torch.int64)
    torch.ops.pyxfer.sm_copy(src, dst)  # pull by default
    assert torch.equal(dst.view(torch.uint8), src.reshape(-1).view(torch.uint8))


def test_argument_checks():
    op = torch.ops.pyxfer.sm_copy
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src and dst must hold the same number of bytes, "
                                           r"got 12 and 16"):
        op(torch.zeros(3), torch.zeros(4), True)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src and dst must be contiguous, got a non-contiguous "
                                           r"src"):
        op(torch.zeros(4, 2).t(), torch.zeros(8), True)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src and dst must be contiguous, got a non-contiguous "
                                           r"dst"):
        op(torch.zeros(8), torch.zeros(4, 2).t(), True)
    # nested, sparse and quantized tensors meet pyxfer's rejecting kernel (pyxfer._checks) first
    with pytest.raises(ValueError, match=r"torch.ops.pyxfer.sm_copy: dst must be a dense tensor, got a nested tensor"):
        op(torch.zeros(4), torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)]), True)


# ---- math bits (conjugate / negative views): refused as dst (it used to trip an internal assert in
# torch's math-bits fallback and corrupt the interpreter, so this runs in a fresh one), copied as src


def test_conjugate_or_negative_dst_is_refused_and_the_interpreter_survives():
    r = run_python(MATH_BIT_DST_SCRIPT.format(device="cpu"), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "alive", (r.returncode, r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("n", [1, 7, 4099])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_conjugate_src_copies_its_values(n, dtype, gen):
    src = random_tensor((n,), dtype, gen)  # every bit pattern, NaNs included
    dst = sentinel_like(src)
    torch.ops.pyxfer.sm_copy(src.conj(), dst, True)
    assert torch.equal(dst.view(torch.uint8), flip_sign_bits(src, step=2, start=1))
    assert not dst.is_conj() and not src.is_conj()


@pytest.mark.parametrize("n", [1, 7, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negative_src_copies_its_values(n, dtype, gen):
    src = random_tensor((n,), dtype, gen)
    dst = sentinel_like(src)
    torch.ops.pyxfer.sm_copy(torch._neg_view(src), dst, False)
    assert torch.equal(dst.view(torch.uint8), flip_sign_bits(src))


def test_math_bit_src_is_checked_before_it_is_materialized(gen):
    # torch's fallback materialized a conjugate src into a contiguous copy first, so a strided one passed
    src = random_tensor((14,), torch.complex64, gen)[::2]
    dst = sentinel_like(torch.empty(7, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src and dst must be contiguous, got a non-contiguous "
                                           r"src"):
        torch.ops.pyxfer.sm_copy(src.conj(), dst, True)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src and dst must be contiguous, got a non-contiguous "
                                           r"src"):
        torch.ops.pyxfer.sm_copy(torch._neg_view(src.real), dst.real.contiguous(), True)
    assert_sentinel(dst)


# ---- autograd's in-place rules, as copy_ keeps them

def test_overwriting_a_saved_tensor_makes_backward_raise(gen):
    w = torch.randn(7, generator=gen, requires_grad=True)
    x = torch.randn(7, generator=gen)
    y = (w * x).sum()  # saves x for w's gradient
    before = x._version
    torch.ops.pyxfer.sm_copy(torch.randn(7, generator=gen), x, True)
    assert x._version == before + 1
    with pytest.raises(RuntimeError, match=r"one of the variables needed for gradient computation has been modified "
                                           r"by an inplace operation: \[torch.FloatTensor \[7\]\] is at version 1; "
                                           r"expected version 0 instead"):
        y.backward()


def test_writing_a_view_bumps_its_base(gen):
    w = torch.randn(9, generator=gen, requires_grad=True)
    x = torch.randn(9, generator=gen)
    y = (w * x).sum()
    src = torch.randn(4, generator=gen)
    torch.ops.pyxfer.sm_copy(src, x[3:7], False)
    assert torch.equal(x[3:7], src) and x._version == 1
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        y.backward()


def test_untouched_saved_tensors_still_give_the_right_gradient(gen):
    w = torch.randn(7, generator=gen, requires_grad=True)
    x = torch.randn(7, generator=gen)
    other = sentinel_like(x)
    y = (w * x).sum()
    torch.ops.pyxfer.sm_copy(torch.randn(7, generator=gen), other, True)  # not a saved tensor
    y.backward()
    assert torch.equal(w.grad, x)


def test_a_leaf_that_requires_grad_is_refused_like_copy_(gen):
    src = torch.randn(7, generator=gen)
    leaf = sentinel_like(src).requires_grad_()
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: a leaf Variable that requires grad is being used in an "
                                           r"in-place operation \(dst\)"):
        torch.ops.pyxfer.sm_copy(src, leaf, True)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: a view of a leaf Variable that requires grad is being "
                                           r"used in an in-place operation \(dst\)"):
        torch.ops.pyxfer.sm_copy(src[:3], leaf[2:5], True)
    assert_sentinel(leaf)
    assert leaf._version == 0
    with torch.no_grad():  # as with copy_, allowed without grad mode (initializing parameters)
        torch.ops.pyxfer.sm_copy(src, leaf, True)
    assert torch.equal(leaf.detach(), src) and leaf.requires_grad and leaf.is_leaf and leaf._version == 1


def test_src_or_dst_that_require_grad_are_refused_in_grad_mode(gen):
    src = torch.randn(7, generator=gen)
    dst = sentinel_like(src)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src requires grad, and sm_copy records no autograd "
                                           r"history \(it copies bytes\); pass src.detach\(\) or call it under "
                                           r"torch.no_grad\(\)"):
        torch.ops.pyxfer.sm_copy(src.clone().requires_grad_(), dst, True)
    non_leaf = sentinel_like(src).requires_grad_() * 1
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: dst requires grad, and sm_copy records no autograd "
                                           r"history"):
        torch.ops.pyxfer.sm_copy(src, non_leaf, True)
    assert_sentinel(dst)
    assert_sentinel(non_leaf)
    assert dst._version == 0 and non_leaf._version == 0
    with torch.no_grad():
        torch.ops.pyxfer.sm_copy(src.clone().requires_grad_(), dst, True)
    assert torch.equal(dst, src) and not dst.requires_grad


def test_inference_tensors(gen):
    src = torch.randn(7, generator=gen)
    with torch.inference_mode():
        inference_dst = sentinel_like(src)
        inference_src = src.clone()
    # copy_ writes and then raises; sm_copy raises first
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: Inplace update to inference tensor outside "
                                           r"InferenceMode is not allowed \(dst is an inference tensor\)"):
        torch.ops.pyxfer.sm_copy(src, inference_dst, True)
    assert_sentinel(inference_dst)
    normal = sentinel_like(src)
    with torch.inference_mode():  # allowed inside inference mode, for inference and normal destinations
        torch.ops.pyxfer.sm_copy(src, inference_dst, True)
        torch.ops.pyxfer.sm_copy(src, normal, True)  # a normal tensor's version still counts
    assert torch.equal(inference_dst, src) and torch.equal(normal, src) and normal._version == 1
    out = sentinel_like(src)
    torch.ops.pyxfer.sm_copy(inference_src, out, True)  # reading an inference tensor is fine
    assert torch.equal(out, src)


# ---- meta tensors: no memory, refused as by every entry point (the fake kernel only under FakeTensorMode)

def test_meta_tensors_are_refused(gen):
    real = random_tensor((11,), torch.uint8, gen)
    dst = sentinel_like(real)
    meta = torch.empty(11, dtype=torch.uint8, device="meta")
    for s, d, name in ((meta, dst, "src"), (real, meta, "dst"), (meta, meta.clone(), "src")):
        with pytest.raises(ValueError, match=rf"^torch.ops.pyxfer.sm_copy: {name} is on the meta device and has no "
                                             r"data to read$"):
            torch.ops.pyxfer.sm_copy(s, d, True)
    assert_sentinel(dst)
    assert dst._version == 0


def test_the_fake_kernel_still_runs_under_fake_tensor_mode(gen):
    src, dst = random_tensor((11,), torch.uint8, gen), torch.empty(11, dtype=torch.uint8)
    with FakeTensorMode() as mode:
        fake_src, fake_dst = mode.from_tensor(src), mode.from_tensor(dst)
        assert torch.ops.pyxfer.sm_copy(fake_src, fake_dst, True) is None
        assert fake_dst._version == 1
