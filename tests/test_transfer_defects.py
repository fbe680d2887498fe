"""Verified copies on the CPU: regressions of the transfer review (issue 28) and staged_copy's autograd
(issue 22): conjugate / negative views, faults that always write wrong bytes, the deferred-error
record of several pairs, staged_copy differentiable like verified_copy."""
import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from tensors import logical_bytes, random_tensor


@pytest.fixture(autouse=True)
def clean_state():
    pyxfer.health.reset()
    yield
    pyxfer.check_transfers()  # no test may leave a latched mismatch behind
    pyxfer.health.reset()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and logical_bytes(a) == logical_bytes(b)


def conj_views(gen, device="cpu"):
    """Lazily conjugated / negated views and what they must read as (resolved copies)."""
    z = random_tensor((37, 29), torch.complex64, gen, device)
    zd = random_tensor((1001,), torch.complex128, gen, device)
    for name, view in (("conj", z.conj()), ("conj-imag", z.conj().imag), ("conj-slice", z[3:, 5::2].conj()),
                       ("conj-t", z.t().conj()), ("conj-1d-offset", zd[1:].conj()), ("neg-view", zd.conj().imag[7:])):
        assert view.is_conj() or view.is_neg(), name  # the views really are lazy
        yield name, view, view.resolve_conj().resolve_neg()


# Issue 28 item 6: PyTorch's dispatcher materializes conjugate / negative views (its Conjugate and
# Negative fallbacks) before a custom op runs: the copy and the checksum see the resolved values.
def test_conjugate_and_negative_views_copy_their_values(gen):
    for name, view, want in conj_views(gen):
        for route in ("direct", "staged"):
            for verify in ("sync", "deferred", "none"):
                out = pyxfer.verified_copy(view, "cpu", route=route, verify=verify)
                assert not out.is_conj() and not out.is_neg() and same_bits(out, want), (name, route, verify)
        assert same_bits(pyxfer.staged_copy(view, "cpu"), want), name
        assert pyxfer.checksum(view) == pyxfer.checksum(want), name
        assert pyxfer.checksum(view) != pyxfer.checksum(want.conj().resolve_conj()) or not want.is_complex(), name


# Issue 28, "faults that must always produce wrong bytes": a fault whose bytes happen to equal the
# source's (an all-zero source under "zeros", a recycled destination that already held the source
# under "truncate") must still write wrong bytes, and a verified copy must see it.
def test_zeros_fault_on_an_all_zero_source_writes_wrong_bytes():
    src = torch.zeros(4099, dtype=torch.uint8)
    for route in ("direct", "staged"):
        with inject_fault("zeros", path=route) as fault:
            out = pyxfer.verified_copy(src, "cpu", route=route, verify="none")
        assert fault.used == 1 and not same_bits(out, src), route
    with inject_fault("zeros", path="direct") as fault:  # verified: detected, repaired, the pair marked corrupt
        out = pyxfer.verified_copy(src, "cpu", route="direct")
    assert fault.used == 1 and same_bits(out, src)
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_faults_on_a_recycled_destination_that_held_the_source_write_wrong_bytes(kind):
    # A constant source, copied once unfaulted and freed: the next destination of the same size is
    # usually the same memory, still holding the source's bytes where the fault leaves old bytes.
    src = torch.full((4099,), 0x5A, dtype=torch.uint8)
    for _ in range(12):
        out = pyxfer.verified_copy(src, "cpu", route="direct", verify="none")
        del out
        with inject_fault(kind, path="direct") as fault:
            out = pyxfer.verified_copy(src, "cpu", route="direct", verify="none")
        assert fault.used == 1 and not same_bits(out, src), kind


def test_check_transfers_reports_every_deferred_mismatch_and_clears(gen):
    src = random_tensor((5003,), torch.uint8, gen)
    with inject_fault("bitflip", path="direct", times=3):
        for _ in range(3):
            pyxfer.verified_copy(src, "cpu", route="direct", verify="deferred")
    with pytest.raises(pyxfer.TransferError, match=r"^3 deferred verified copies failed verification; the first: "
                                                  r"copy cpu -> cpu of 5003 bytes") as info:
        pyxfer.check_transfers()
    assert info.value.src_hash == pyxfer.checksum(src) and info.value.dst_hash != info.value.src_hash
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"
    pyxfer.check_transfers()  # reported once


# Issue 22 item 1: staged_copy is differentiable like verified_copy (the gradient goes back to the
# source's device through a staged copy).
def test_staged_copy_is_differentiable():
    x = torch.randn(13, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 13, dtype=torch.float64)
    y = pyxfer.staged_copy(x.t(), "cpu")
    assert y.requires_grad and y.grad_fn is not None
    (y * w).sum().backward()
    assert torch.equal(x.grad, w.t())
    torch.autograd.gradcheck(lambda a: pyxfer.staged_copy(a, "cpu") * 3,
                             (torch.randn(4, 3, dtype=torch.float64, requires_grad=True),))
    with torch.no_grad():
        assert not pyxfer.staged_copy(x, "cpu").requires_grad
    assert not pyxfer.staged_copy(x.detach(), "cpu").requires_grad
