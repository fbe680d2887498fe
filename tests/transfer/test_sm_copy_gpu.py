"""torch.ops.pyxfer.sm_copy on GPUs: exact bytes (aligned vectors, misaligned bytes, the tail after
the last vector), pulled by the destination GPU and pushed by the source GPU, ordered like a copy_
between devices: after the other GPU's queued writes of the source, before its later work; and the
op's in-place rules (math bits, versions, grad, inference and meta tensors) in front of the CUDA kernel."""
import pytest
import torch

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


# ---- the op's device-generic layers (math bits, autograd, meta) in front of the CUDA kernel

@pytest.mark.gpu
def test_conjugate_or_negative_dst_is_refused_on_gpu():
    r = run_python(MATH_BIT_DST_SCRIPT.format(device="cuda:0"), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "alive", (r.returncode, r.stdout, r.stderr[-3000:])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, (1 << 20) + 5])
def test_conjugate_and_negative_src_copy_their_values_on_gpu(n, gen):
    z = random_tensor((n,), torch.complex64, gen)  # every bit pattern, NaNs included
    x = random_tensor((n,), torch.float64, gen)
    for src, want, pull in ((z.cuda().conj(), flip_sign_bits(z, step=2, start=1), True),
                            (torch._neg_view(x.cuda()), flip_sign_bits(x), False)):
        dst = sentinel_like(src.resolve_conj().resolve_neg())
        torch.ops.pyxfer.sm_copy(src, dst, pull)
        torch.cuda.synchronize(0)
        assert torch.equal(dst.view(torch.uint8).cpu(), want)


@pytest.mark.gpu
def test_overwriting_a_saved_tensor_makes_backward_raise_on_gpu(gen):
    w = torch.randn(7, generator=gen).cuda().requires_grad_()
    x = torch.randn(7, generator=gen).cuda()
    y = (w * x).sum()
    torch.ops.pyxfer.sm_copy(torch.randn(7, generator=gen).cuda(), x, True)
    assert x._version == 1
    with pytest.raises(RuntimeError, match=r"one of the variables needed for gradient computation has been modified "
                                           r"by an inplace operation: \[torch.cuda.FloatTensor \[7\]\] is at version "
                                           r"1; expected version 0 instead"):
        y.backward()


@pytest.mark.gpu
def test_grad_and_inference_destinations_are_refused_on_gpu(gen):
    src = torch.randn(7, generator=gen).cuda()
    leaf = sentinel_like(src).requires_grad_()
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: a leaf Variable that requires grad is being used in an "
                                           r"in-place operation \(dst\)"):
        torch.ops.pyxfer.sm_copy(src, leaf, True)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: src requires grad"):
        torch.ops.pyxfer.sm_copy(src.clone().requires_grad_(), sentinel_like(src), True)
    with torch.inference_mode():
        inference_dst = sentinel_like(src)
    with pytest.raises(RuntimeError, match=r"pyxfer.sm_copy: Inplace update to inference tensor outside "
                                           r"InferenceMode is not allowed \(dst is an inference tensor\)"):
        torch.ops.pyxfer.sm_copy(src, inference_dst, True)
    torch.cuda.synchronize(0)
    assert_sentinel(leaf)
    assert_sentinel(inference_dst)
    with torch.no_grad():
        torch.ops.pyxfer.sm_copy(src, leaf, True)
    torch.cuda.synchronize(0)
    assert torch.equal(leaf.detach(), src) and leaf._version == 1


@pytest.mark.gpu
def test_meta_tensors_are_refused_beside_a_gpu_tensor(gen):
    real = random_tensor((11,), torch.uint8, gen, device="cuda:0")
    dst = sentinel_like(real)
    meta = torch.empty(11, dtype=torch.uint8, device="meta")
    for s, d, name in ((meta, dst, "src"), (real, meta, "dst")):
        with pytest.raises(ValueError, match=rf"^torch.ops.pyxfer.sm_copy: {name} is on the meta device and has no "
                                             r"data to read$"):
            torch.ops.pyxfer.sm_copy(s, d, True)
    torch.cuda.synchronize(0)
    assert_sentinel(dst)


@pytest.mark.multigpu
@pytest.mark.parametrize("pull", [True, False], ids=["pull", "push"])
def test_math_bits_and_versions_across_two_gpus(pull, gen):
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("no peer access between cuda:0 and cuda:1: sm_copy refuses the pair")
    z = random_tensor(((1 << 18) + 3,), torch.complex64, gen)
    w = torch.randn(z.numel(), generator=gen).to("cuda:1").requires_grad_()
    dst = sentinel_like(z.to("cuda:1"))
    y = (w * dst.real).sum()  # saves a view of dst
    torch.ops.pyxfer.sm_copy(z.to("cuda:0").conj(), dst, pull)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(dst.view(torch.uint8).cpu(), flip_sign_bits(z, step=2, start=1))
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        y.backward()
