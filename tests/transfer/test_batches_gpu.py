"""pyxfer.verified_copy_many on real GPUs (issue 34 item 5): mixed batches (CPU pinned and pageable, the
destination GPU itself, the peer GPU, empty tensors, views, dtypes) with data on a device other than the
current one; a fault of every kind in one tensor of a batch repaired for that tensor alone (sync) or
latched with its index (deferred), peer both ways, host <-> GPU and GPU-local; pyxfer.nested.verified_send
moving a call's tensors through one batch. Zero-byte tensors take no fault (pyxfer.testing), and a fault
armed for one pair hits only that pair's copies: so the target's index is known."""
import pytest
import torch

import pyxfer
from pyxfer.nested import verified_send
from pyxfer.testing import FAULT_KINDS, KERNEL_FAULT_KINDS, inject_fault

from support.tensors import layouts, logical_bytes, random_tensor

# cuda:0 current and health reset around each test; no latched mismatch left behind (conftest.py)
pytestmark = pytest.mark.usefixtures("clean_transfers")

PAIRS = [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]
GPU_KINDS = FAULT_KINDS + KERNEL_FAULT_KINDS  # skip_kernel: direct GPU copies only


def same_bits(out, src):
    return out.dtype == src.dtype and out.shape == src.shape and logical_bytes(out) == logical_bytes(src)


def mixed_batch(gen, devices):
    """Layouts of several dtypes (empty, scalar, odd sizes, views, offsets) on each of `devices`, interleaved,
    plus pinned host tensors where "cpu" is one of them."""
    out = []
    for dtype in (torch.uint8, torch.bfloat16, torch.int64, torch.float8_e4m3fn):
        for (_, t) in layouts(dtype, gen):
            for d in devices:
                out.append(t.to(d) if d != "cpu" else t)
    if "cpu" in devices:
        out += [random_tensor((4096 + 5,), torch.uint8, gen).pin_memory(),
                random_tensor((3, 1001), torch.float16, gen).pin_memory().t()]
    return out


def targeted(gen, src_dev, others, index, numel=(1 << 20) + 3):
    """`index` tensors that the pair's fault cannot hit (empty ones on src_dev, non-empty ones on `others`),
    then the target (non-empty, on src_dev), then more of both."""
    head = [random_tensor((0,), torch.float32, gen, device=src_dev) if i % 2 == 0 or not others
            else random_tensor((777,), torch.uint8, gen, device=others[i % len(others)]) for i in range(index)]
    tail = [random_tensor((4099,), torch.uint8, gen, device=src_dev),
            random_tensor((33, 65), torch.int32, gen, device=src_dev).t()]
    tail += [random_tensor((5,), torch.int16, gen, device=d) for d in others]
    return head + [random_tensor((numel,), torch.uint8, gen, device=src_dev)] + tail


@pytest.mark.multigpu
@pytest.mark.parametrize("dst", ["cuda:0", "cuda:1", "cpu"])
@pytest.mark.parametrize("current", [0, 1])
def test_mixed_batches_every_route_and_mode(dst, current, gen):
    torch.cuda.set_device(current)
    batch = mixed_batch(gen, ["cpu", "cuda:0", "cuda:1"])
    for route in ("auto", "direct", "staged"):
        for verify in ("sync", "deferred", "none"):
            out = pyxfer.verified_copy_many(batch, dst, route=route, verify=verify)
            assert torch.cuda.current_device() == current
            assert len(out) == len(batch)
            for i, (o, t) in enumerate(zip(out, batch)):
                assert o.device == torch.device(dst) and o.is_contiguous(), (i, route, verify)
                assert same_bits(o, t), (i, route, verify)
                if dst == "cpu" and t.is_cuda and t.numel():  # (an empty tensor has no memory to pin)
                    assert o.is_pinned(), i  # pin_memory=True, as verified_copy
    pyxfer.check_transfers()


@pytest.mark.multigpu
def test_pageable_results_and_gradients_like_verified_copy(gen):
    a = torch.randn(31, 7, device="cuda:1", generator=None).requires_grad_()
    b = torch.randn(9, device="cuda:0")
    out = pyxfer.verified_copy_many([a, b], "cpu", pin_memory=False)
    assert [o.is_pinned() for o in out] == [False, False]
    assert [o.requires_grad for o in out] == [True, False]
    (out[0] * 2).sum().backward()
    assert a.grad.device == a.device and torch.equal(a.grad, torch.full_like(a, 2))


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
@pytest.mark.parametrize("numel", [4099, (96 << 20) + 7])  # the fused pull kernel; the copy engine
def test_a_peer_fault_in_one_tensor_is_repaired_for_that_tensor(kind, src_dev, dst_dev, numel, gen):
    torch.cuda.set_device(1)  # the data lives on both GPUs, cuda:1 current
    batch = targeted(gen, src_dev, ["cpu", dst_dev], 3, numel)
    with inject_fault(kind, src=src_dev, dst=dst_dev, path="direct") as fault:
        out = pyxfer.verified_copy_many(batch, dst_dev, route="direct")
    assert fault.used == 1
    assert all(same_bits(o, t) for o, t in zip(out, batch))
    assert pyxfer.health.status(src_dev, dst_dev) == "corrupt"  # detected, repaired through the staged path
    assert pyxfer.health.status(dst_dev, src_dev) == "unknown"


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
def test_a_deferred_peer_fault_is_latched_with_its_index(kind, src_dev, dst_dev, gen):
    batch = targeted(gen, src_dev, ["cpu", dst_dev], 4)
    with inject_fault(kind, src=src_dev, dst=dst_dev, path="direct") as fault:
        out = pyxfer.verified_copy_many(batch, dst_dev, route="direct", verify="deferred")
    assert fault.used == 1
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert all(same_bits(o, t) for i, (o, t) in enumerate(zip(out, batch)) if i != 4)
    with pytest.raises(pyxfer.TransferError, match=rf"^1 deferred verified copy failed verification; the first: "
                                                   rf"tensors\[4\] of a verified_copy_many call: copy {src_dev} -> "
                                                   rf"{dst_dev} of {(1 << 20) + 3} bytes") as info:
        pyxfer.check_transfers()
    assert info.value.index == 4


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("gpu", ["cuda:0", "cuda:1"])
def test_host_gpu_faults_in_a_batch_both_directions(kind, gpu, gen):
    host = targeted(gen, "cpu", [], 2, (5 << 20) + 1)
    with inject_fault(kind, src="cpu", dst=gpu, path="direct") as up:
        on_gpu = pyxfer.verified_copy_many(host, gpu, route="direct")
    assert up.used == 1 and all(same_bits(o, t) for o, t in zip(on_gpu, host))
    with inject_fault(kind, src=gpu, dst="cpu", path="direct") as down:
        back = pyxfer.verified_copy_many(on_gpu, "cpu", route="direct")
    assert down.used == 1 and all(same_bits(o, t) for o, t in zip(back, host))
    for pair in ((gpu, "cpu"), ("cpu", gpu)):
        assert pyxfer.health.status(*pair) == "corrupt"
    pyxfer.health.reset()
    with inject_fault(kind, src="cpu", dst=gpu, path="direct"):  # deferred: latched with the index
        pyxfer.verified_copy_many(host, gpu, route="direct", verify="deferred")
    with pytest.raises(pyxfer.TransferError) as info:
        pyxfer.check_transfers()
    assert (info.value.index, info.value.src, info.value.dst) == (2, "cpu", gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_local_faults_in_a_batch(kind, gen):
    batch = targeted(gen, "cuda:0", ["cpu"], 3)
    with inject_fault(kind, src="cuda:0", dst="cuda:0", path="direct") as fault:
        out = pyxfer.verified_copy_many(batch, "cuda:0", route="direct")
    assert fault.used == 1 and all(same_bits(o, t) for o, t in zip(out, batch))
    assert pyxfer.health.status("cuda:0", "cuda:0") == "corrupt"
    with inject_fault(kind, src="cuda:0", dst="cuda:0", path="direct"):
        pyxfer.verified_copy_many(batch, "cuda:0", route="direct", verify="deferred")
    with pytest.raises(pyxfer.TransferError) as info:
        pyxfer.check_transfers()
    assert (info.value.index, info.value.src, info.value.dst) == (3, "cuda:0", "cuda:0")


@pytest.mark.multigpu
def test_faults_on_both_paths_raise_naming_the_index(gen):
    batch = targeted(gen, "cuda:1", ["cpu", "cuda:0"], 5, 123457)
    with inject_fault("zeros", src="cuda:1", dst="cuda:0", path="direct"), \
            inject_fault("truncate", src="cuda:1", dst="cuda:0", path="staged"):
        with pytest.raises(pyxfer.TransferError, match=r"^tensors\[5\]: copy cuda:1 -> cuda:0 of 123457 bytes") as info:
            pyxfer.verified_copy_many(batch, "cuda:0")
    assert (info.value.index, info.value.attempt) == (5, 2)


@pytest.mark.multigpu
def test_verified_send_moves_a_call_through_one_batch(gen):
    data = {"hidden": random_tensor((4, 129), torch.bfloat16, gen, device="cuda:1"),
            "mask": random_tensor((4, 1, 129), torch.bool, gen, device="cuda:1"),
            "pos": (random_tensor((129,), torch.int64, gen, device="cuda:1"),
                    random_tensor((7, 3), torch.float32, gen, device="cuda:1").t()),
            "here": random_tensor((5,), torch.float32, gen, device="cuda:0"), "n": 3}
    out = verified_send(data, "cuda:0")
    assert out["here"] is data["here"] and out["n"] == 3
    for o, t in ((out["hidden"], data["hidden"]), (out["mask"], data["mask"]), (out["pos"][0], data["pos"][0]),
                 (out["pos"][1], data["pos"][1])):
        assert o.device == torch.device("cuda:0") and o.stride() == t.stride() and same_bits(o, t)
    # the call's copies in traversal order: a (empty: no fault), b, c[0], c[1]; b fails on both paths
    with inject_fault("zeros", src="cuda:1", dst="cuda:0", path="direct", times=3), \
            inject_fault("zeros", src="cuda:1", dst="cuda:0", path="staged", times=3):
        with pytest.raises(pyxfer.TransferError) as info:
            verified_send({"a": data["hidden"][:0], "b": data["mask"], "c": data["pos"]}, "cuda:0")
    assert info.value.index == 1
