"""torch.ops.pyxfer.sm_copy (the copy kernel `pyxfer bench` times as sm_pull / sm_push): exact bytes
into a sentinel-filled destination, and every argument check. CPU here (a memcpy); on GPUs, one
device and across two, in tests/test_sm_copy_gpu.py."""
import pytest
import torch

import pyxfer  # noqa: F401  (registers the ops)

from tensors import random_tensor

SENTINEL = 0xC3


def run_sm_copy(src, dst_device, pull, pad=5):
    """sm_copy of ``src`` into the middle of a sentinel-filled buffer: (the destination view, the whole buffer)."""
    n = src.numel() * src.element_size()
    whole = torch.full((n + 2 * pad,), SENTINEL, dtype=torch.uint8, device=dst_device)
    dst = whole[pad:pad + n]
    torch.ops.pyxfer.sm_copy(src, dst, pull)
    return dst, whole


def check_exact(src, dst, whole, pad=5):
    want = src.reshape(-1).view(torch.uint8).cpu()
    assert torch.equal(dst.cpu(), want)
    assert bool((whole[:pad] == SENTINEL).all()) and bool((whole[pad + want.numel():] == SENTINEL).all())


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
