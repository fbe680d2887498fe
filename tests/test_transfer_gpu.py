"""Verified transfers on real GPUs: peer copies both ways, host <-> device, faults on the real peer
path, concurrency across streams, deferred verification inside a CUDA graph, autograd over two GPUs."""
import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from conftest import run_python
from tensors import logical_bytes, random_tensor

pytestmark = pytest.mark.multigpu


@pytest.fixture(autouse=True)
def clean_state():
    pyxfer.health.reset()
    torch.cuda.set_device(0)
    yield
    pyxfer.check_transfers()  # no test may leave a latched mismatch behind
    pyxfer.health.reset()
    torch.cuda.set_device(0)


def gpu_bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.to(a.device).contiguous().reshape(-1).view(torch.uint8))


SIZES = [0, 1, 7, 4096 + 3, (1 << 20) + 5, (64 << 20) + 3, (192 << 20) + 11]  # bytes; > 64 MiB: copy engine, chunks
PAIRS = [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]


@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
@pytest.mark.parametrize("current", [0, 1])
def test_peer_copies_every_size_route_and_mode(src_dev, dst_dev, current, gen):
    torch.cuda.set_device(current)
    for n in SIZES:
        src = random_tensor((n,), torch.uint8, gen, device=src_dev)
        for route in ("direct", "staged", "auto"):
            for verify in ("sync", "deferred"):
                out = pyxfer.verified_copy(src, dst_dev, route=route, verify=verify)
                assert out.device == torch.device(dst_dev) and gpu_bytes_equal(out, src), (n, route, verify)
        assert torch.cuda.current_device() == current
    pyxfer.check_transfers()
    assert pyxfer.health.status(src_dev, dst_dev) == "healthy"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.bfloat16,
                                   torch.complex64, torch.int64])
def test_dtypes_and_non_contiguous_views(dtype, gen):
    base = random_tensor((37, 1029), dtype, gen, device="cuda:0")
    for view in (base, base.t(), base[3:, 5::3], base[1:2], base.view(-1)[1:]):
        out = pyxfer.verified_copy(view, "cuda:1")
        assert out.is_contiguous() and gpu_bytes_equal(out, view.contiguous())
        back = pyxfer.verified_copy(out.t() if out.dim() == 2 else out, "cuda:0")
        assert gpu_bytes_equal(back, (out.t() if out.dim() == 2 else out).contiguous())


def test_one_gib_both_directions(gen):
    src = torch.randint(-2**31, 2**31 - 1, ((1 << 30) // 4 + 3,), dtype=torch.int32, device="cuda:0")
    out = pyxfer.verified_copy(src, "cuda:1")
    back = pyxfer.verified_copy(out, "cuda:0")
    assert torch.equal(back, src)
    assert pyxfer.checksum(out) == pyxfer.checksum(src)


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
def test_faults_on_the_real_peer_path_are_detected_and_repaired(kind, src_dev, dst_dev, gen):
    for n in (5, 4099, (5 << 20) + 3, (96 << 20) + 7):  # the fused kernel up to 64 MiB, then the copy engine
        # "stale" / "truncate" leave destination bytes as they were; for the 5-byte copy the one
        # missing byte may equal the source's by chance (1 in 256): then try fresh data again.
        for _ in range(4):
            pyxfer.health.reset()
            src = random_tensor((n,), torch.uint8, gen, device=src_dev)
            with inject_fault(kind, src=src_dev, dst=dst_dev, path="direct") as fault:
                out = pyxfer.verified_copy(src, dst_dev)
            assert fault.used == 1 and gpu_bytes_equal(out, src)
            if pyxfer.health.status(src_dev, dst_dev) == "corrupt":
                break
        assert pyxfer.health.status(src_dev, dst_dev) == "corrupt"
        assert pyxfer.health.status(dst_dev, src_dev) == "unknown"
    with inject_fault(kind, src=src_dev, dst=dst_dev, path="direct") as fault:  # routed staged now
        out = pyxfer.verified_copy(src, dst_dev)
    assert fault.used == 0 and gpu_bytes_equal(out, src)


def test_faults_on_both_paths_raise(gen):
    src = random_tensor((123457,), torch.uint8, gen, device="cuda:1")
    with inject_fault("zeros", path="direct"), inject_fault("truncate", path="staged"):
        with pytest.raises(pyxfer.TransferError, match=r"copy cuda:1 -> cuda:0 of 123457 bytes"):
            pyxfer.verified_copy(src, "cuda:0")


def test_unverified_fault_really_lands_in_peer_memory(gen):
    src = random_tensor((1 << 20,), torch.uint8, gen, device="cuda:0")
    with inject_fault("bitflip", path="direct"):
        out = pyxfer.verified_copy(src, "cuda:1", route="direct", verify="none")
    diff = (out.cpu() ^ src.cpu()).nonzero()
    assert diff.numel() == 1  # exactly one byte, one bit
    assert bin(int((out.cpu() ^ src.cpu())[diff[0, 0]])).count("1") == 1


@pytest.mark.parametrize("pinned", [True, False])
def test_host_device_copies_from_pinned_and_pageable_memory(pinned, gen):
    for n in (0, 3, 4096 + 1, (24 << 20) + 5):
        host = random_tensor((n,), torch.uint8, gen)
        if pinned:
            host = host.pin_memory()
        for dev in ("cuda:1", "cuda:0"):
            for route in ("direct", "staged"):
                on_gpu = pyxfer.verified_copy(host, dev, route=route)
                assert gpu_bytes_equal(on_gpu, host.to(dev))
                back = pyxfer.verified_copy(on_gpu, "cpu", route=route)
                assert logical_bytes(back) == logical_bytes(host)
    host = random_tensor((5 << 20,), torch.uint8, gen)
    for kind in FAULT_KINDS:  # faults on host <-> device direct copies are caught too
        pyxfer.health.reset()
        with inject_fault(kind, path="direct", times=2) as fault:
            on_gpu = pyxfer.verified_copy(host, "cuda:1")
            back = pyxfer.verified_copy(on_gpu, "cpu")
        assert fault.used == 2 and logical_bytes(back) == logical_bytes(host)


def test_many_copies_in_flight_on_several_streams(gen):
    sources = [random_tensor((int(n),), torch.uint8, gen, device="cuda:0")
               for n in torch.randint(1, 8 << 20, (24,), generator=gen)]
    streams = [torch.cuda.Stream(device=0) for _ in range(4)]
    outs = [None] * len(sources)
    torch.cuda.synchronize(0)
    for i, src in enumerate(sources):
        s = streams[i % len(streams)]
        with torch.cuda.stream(s):
            torch.cuda._sleep(2_000_000)  # keep several copies genuinely in flight together
            outs[i] = pyxfer.verified_copy(src, "cuda:1", verify="deferred")
        torch.cuda.set_device(0)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for src, out in zip(sources, outs):
        assert gpu_bytes_equal(out, src)
    pyxfer.check_transfers()


def test_deferred_verification_inside_a_cuda_graph(gen):
    static_src = torch.empty(3 << 20, dtype=torch.uint8, device="cuda:0")
    static_src.copy_(random_tensor(static_src.shape, torch.uint8, gen, device="cuda:0"))
    pyxfer.verified_copy(static_src, "cuda:1", verify="deferred")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = pyxfer.verified_copy(static_src, "cuda:1", route="direct", verify="deferred")
    for _ in range(3):
        fresh = random_tensor(static_src.shape, torch.uint8, gen, device="cuda:0")
        static_src.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert gpu_bytes_equal(static_out, fresh)
    pyxfer.check_transfers()

    faulty = torch.cuda.CUDAGraph()  # a graph captured while a fault was active corrupts every replay
    with inject_fault("bitflip", path="direct"):
        with torch.cuda.graph(faulty):
            pyxfer.verified_copy(static_src, "cuda:1", route="direct", verify="deferred")
    faulty.replay()
    faulty.replay()
    with pytest.raises(pyxfer.TransferError, match=r"2 deferred verified copies failed verification; the first: "
                                                  r"copy cuda:0 -> cuda:1"):
        pyxfer.check_transfers()
    with pytest.raises(RuntimeError, match=r"verify='sync' .* CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pyxfer.verified_copy(static_src, "cuda:1", verify="sync")


def test_autograd_through_a_two_device_model(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    first, second = torch.nn.Linear(64, 128).to("cuda:0"), torch.nn.Linear(128, 8).to("cuda:1")
    x = torch.randn(32, 64, device="cuda:0")

    def run(move):
        for p in (*first.parameters(), *second.parameters()):
            p.grad = None
        h = torch.relu(first(x))
        loss = second(move(h, "cuda:1")).square().mean()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in (*first.parameters(), *second.parameters())]

    ref_loss, ref_grads = run(lambda t, d: t.to(d))
    loss, grads = run(lambda t, d: pyxfer.verified_copy(t, d))
    assert loss == ref_loss
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


# Across the one-block hash (<= 64 KiB), the reference kernel, the beside/pipelined paths (>= 4 MiB);
# offset 3: a misaligned source.
HASH_SIZES = [1, 7, 4096 + 3, 64 << 10, (64 << 10) + 1, (1 << 20) + 5, (6 << 20) + 3, (40 << 20) + 1]


@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
def test_reported_hashes_are_the_checksums_of_both_ends(src_dev, dst_dev, gen):
    # zeros on both paths: the first try's destination hash is that of n zero bytes (the source holds
    # no zero byte: on an all-zero source the fault flips a bit as well, so that it stays a fault)
    base = random_tensor((max(HASH_SIZES) + 3,), torch.uint8, gen, device=src_dev)
    base[base == 0] = 1
    for n in HASH_SIZES:
        for offset in (0, 3):
            src = base[offset:offset + n]
            want = (pyxfer.checksum(src), pyxfer.checksum(torch.zeros(n, dtype=torch.uint8, device=dst_dev)))
            with inject_fault("zeros", path="direct"), inject_fault("zeros", path="staged"):
                with pytest.raises(pyxfer.TransferError) as info:
                    pyxfer.verified_copy(src, dst_dev, route="direct")
            assert (info.value.src_hash, info.value.dst_hash) == want, (n, offset)
            with inject_fault("zeros", path="direct"):
                pyxfer.verified_copy(src, dst_dev, route="direct", verify="deferred")
            with pytest.raises(pyxfer.TransferError) as info:
                pyxfer.check_transfers()
            assert (info.value.src_hash, info.value.dst_hash) == want, (n, offset, "deferred")
            pyxfer.health.reset()


def test_source_overwritten_right_after_a_deferred_copy(gen):
    # the source hash beside the copy must finish before later work on the source's stream writes src
    for n in ((6 << 20) + 3, (64 << 20) + 1):
        src = random_tensor((n,), torch.uint8, gen, device="cuda:0")
        ref = src.clone()
        out = pyxfer.verified_copy(src, "cuda:1", verify="deferred")
        src.zero_()
        pyxfer.check_transfers()  # no false mismatch
        assert gpu_bytes_equal(out, ref)


# The copy-engine pipeline under several chunk schedules (fused kernel off), and the fused kernel
# (pull + hash in one kernel) for every size.
@pytest.mark.parametrize("knobs", [{"PYXFER_PEER_CHUNKS": s, "PYXFER_PEER_FUSED_MIB": "0"}
                                   for s in ("2,8", "8,1", "1,1", "3,0.5")] +
                         [{"PYXFER_PEER_FUSED_MIB": "0"}, {"PYXFER_PEER_FUSED_MIB": "1024"}])
def test_peer_chunk_schedules_and_the_fused_kernel(knobs):
    code = """
import torch, pyxfer
for n in (5 << 20, (64 << 20) + 3, (300 << 20) + 7):
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    for verify in ("sync", "deferred"):
        out = pyxfer.verified_copy(src, "cuda:1", route="direct", verify=verify)
        assert torch.equal(out.cpu(), src.cpu())
pyxfer.check_transfers()
print("ok")
"""
    r = run_python(code, env=knobs)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr
    for name in knobs:
        r = run_python(code, env={name: "fast"})
        assert r.returncode != 0 and f"{name} must be" in r.stderr


def test_staged_copy_keeps_bounded_pinned_memory(gen):
    src = random_tensor(((256 << 20) + 9,), torch.uint8, gen, device="cuda:0")
    try:
        pyxfer.configure_staging(1 << 20, 3)  # 3 MiB of pinned memory for a 256 MiB copy
        out = pyxfer.staged_copy(src, "cuda:1")
        assert gpu_bytes_equal(out, src)
    finally:
        pyxfer.configure_staging()

# (The unknown-device check needs one GPU: tests/test_argument_checks.py, marked gpu.)
