"""torch.ops.pyxfer.sm_copy on GPUs: exact bytes (aligned vectors, misaligned bytes, the tail after
the last vector), pulled by the destination GPU and pushed by the source GPU, ordered like a copy_
between devices: after the other GPU's queued writes of the source, before its later work."""
import pytest
import torch

from tensors import random_tensor
from test_sm_copy import check_exact, run_sm_copy

SIZES = [1, 15, 16, 17, 4099, (1 << 20) + 5, (64 << 20) + 3]


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 3])
def test_exact_bytes_on_one_gpu(n, offset, gen):
    base = random_tensor((n + offset,), torch.uint8, gen, device="cuda:0")
    dst, whole = run_sm_copy(base[offset:], "cuda:0", pull=True)
    torch.cuda.synchronize(0)
    check_exact(base[offset:], dst, whole)


@pytest.mark.gpu
def test_mixed_devices_are_refused():
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src and dst must both be CUDA tensors \(a copy kernel "
                                           r"moves GPU memory\), got src on cpu and dst on cuda:0"):
        torch.ops.pyxfer.sm_copy(torch.zeros(4), torch.zeros(4, device="cuda:0"), True)


@pytest.mark.multigpu
@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
@pytest.mark.parametrize("src_dev,dst_dev", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
@pytest.mark.parametrize("offset", [0, 3])
def test_exact_bytes_across_two_gpus(src_dev, dst_dev, pull, offset, gen):
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("no peer access between cuda:0 and cuda:1: sm_copy refuses the pair")
    torch.cuda.set_device(0)
    for n in SIZES:
        base = random_tensor((n + offset,), torch.uint8, gen, device=src_dev)
        dst, whole = run_sm_copy(base[offset:], dst_dev, pull)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        check_exact(base[offset:], dst, whole)


@pytest.mark.multigpu
@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
def test_ordered_after_the_other_gpus_writes(pull, gen):
    """The source is rewritten on its GPU's stream behind a long sleep; the copy (queued at once, on
    the destination GPU for a pull) must see the new bytes, and the destination GPU's later reads the
    copied ones."""
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("no peer access between cuda:0 and cuda:1")
    n = (8 << 20) + 3
    src = random_tensor((n,), torch.uint8, gen, device="cuda:0")
    fresh = random_tensor((n,), torch.uint8, gen, device="cuda:0")
    dst = torch.full((n,), 0xC3, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    with torch.cuda.device(0):
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the source GPU's current stream
        src.copy_(fresh)
    torch.ops.pyxfer.sm_copy(src, dst, pull)
    with torch.cuda.device(1):
        got = dst.clone()  # on cuda:1's current stream, after the copy
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(got.cpu(), fresh.cpu())
