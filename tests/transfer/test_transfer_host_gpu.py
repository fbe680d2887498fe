"""Verified copies with a host end on a real GPU (issue 34, the host legs): GPU -> pinned result (the DMA
in chunks, each hashed by the host hashing pool as it lands), GPU -> pageable result and the staged route
(through the pinned slots, the next piece queued before the host handles the last), host -> GPU from
pinned and pageable memory (the source hashed by the pool beside the copy). Exact bytes, every fault kind
on every leg caught and repaired (sync) or reported (deferred), the hashes reported exactly, streams, the
pin_memory option, failures of the host legs' waits, a pool without workers. One GPU (cuda:0)."""
import threading

import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.processes import run_python
from support.tensors import logical_bytes, random_tensor

pytestmark = pytest.mark.gpu
MiB = 1 << 20
GPU = "cuda:0"
# Around the host item (1 MiB) and the landing chunk (8 MiB), with odd tails; 40 MiB: many chunks.
SIZES = [0, 1, 7, 4099, MiB + 3, 8 * MiB - 8, 8 * MiB, 8 * MiB + 5, (40 << 20) + 3]
DIRECTIONS = [(GPU, "cpu"), ("cpu", GPU)]


@pytest.fixture(autouse=True)
def clean_state():
    torch.cuda.set_device(0)
    pyxfer.health.reset()
    yield
    torch.cuda.synchronize()
    pyxfer.check_transfers()  # no test may leave a latched mismatch behind
    pyxfer.health.reset()
    pyxfer.configure_staging()


def bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and logical_bytes(a.cpu()) == logical_bytes(b.cpu())


def source(src_dev, n, gen, pinned, offset=0):
    """n fresh random bytes on src_dev (a view at `offset`: misaligned); on the CPU pinned or pageable."""
    t = random_tensor((n + offset,), torch.uint8, gen)
    if src_dev == "cpu":
        t = t.pin_memory() if pinned else t
    else:
        t = t.to(src_dev)
    return t[offset:]


@pytest.mark.parametrize("pin_memory", [True, False])
@pytest.mark.parametrize("route", ["direct", "staged", "auto"])
def test_gpu_to_host_results_are_exact_and_pinned_as_asked(pin_memory, route, gen):
    for n in SIZES:
        src = source(GPU, n, gen, pinned=False, offset=3)
        for verify in ("sync", "deferred", "none"):
            out = pyxfer.verified_copy(src, "cpu", route=route, verify=verify, pin_memory=pin_memory)
            # deferred into host memory is synchronous: the bytes are there when the call returns
            assert out.device.type == "cpu" and out.is_contiguous() and bytes_equal(out, src), (n, verify)
            assert out.is_pinned() == (pin_memory and n > 0), (n, verify)  # no memory to pin for 0 bytes
    pyxfer.check_transfers()


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("route", ["direct", "staged"])
def test_host_to_gpu_from_pinned_and_pageable_sources(pinned, route, gen):
    for n in SIZES:
        src = source("cpu", n, gen, pinned=pinned, offset=5 if n > 8 else 0)
        for verify in ("sync", "deferred", "none"):
            out = pyxfer.verified_copy(src, GPU, route=route, verify=verify, pin_memory=False)  # ignored here
            assert out.device == torch.device(GPU) and bytes_equal(out, src), (n, verify)
    torch.cuda.synchronize()
    pyxfer.check_transfers()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bool, torch.bfloat16, torch.complex64, torch.int64])
def test_non_contiguous_sources_both_ways(dtype, gen):
    base = random_tensor((37, 1029 * 41), dtype, gen, device=GPU)  # ~1.5-12 MiB: several items
    for view in (base.t(), base[3:, 5::3], base.view(-1)[1:]):
        for pin_memory in (True, False):
            for route in ("direct", "staged"):
                out = pyxfer.verified_copy(view, "cpu", route=route, pin_memory=pin_memory)
                assert out.is_contiguous() and out.is_pinned() == pin_memory and bytes_equal(out, view.contiguous())
                back = pyxfer.verified_copy(out.t() if out.dim() == 2 else out, GPU, route=route)
                assert bytes_equal(back, (out.t() if out.dim() == 2 else out).contiguous())


def test_staged_copy_to_the_host_is_pinned(gen):
    src = source(GPU, 3 * MiB + 1, gen, pinned=False)
    out = pyxfer.staged_copy(src, "cpu")
    assert out.is_pinned() and bytes_equal(out, src)


# Every fault kind on every leg with a host end: detected and repaired (sync), reported (deferred).
@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("src_dev,dst_dev", DIRECTIONS)
@pytest.mark.parametrize("host_memory", ["pinned", "pageable"])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_every_fault_on_every_host_leg_is_caught(kind, src_dev, dst_dev, host_memory, path, gen):
    pinned = host_memory == "pinned"
    for n in (4099, (24 << 20) + 5):  # one item; several chunks and items
        # sync: caught, the pair marked corrupt (a direct fault), repaired through the staged route
        for _ in range(4):  # "stale" / "truncate" may leave the source's bytes by chance on recycled memory
            pyxfer.health.reset()
            src = source(src_dev, n, gen, pinned)
            with inject_fault(kind, path=path) as fault:
                out = pyxfer.verified_copy(src, dst_dev, route=path, pin_memory=pinned)
            assert fault.used == 1 and bytes_equal(out, src), (n, "sync")
            if path == "staged" or pyxfer.health.status(src_dev, dst_dev) == "corrupt":
                break
        if path == "direct":
            assert pyxfer.health.status(src_dev, dst_dev) == "corrupt", n
        if dst_dev == "cpu":
            assert out.is_pinned() == pinned  # the repaired result too
        # deferred: returned as written, reported by check_transfers with the source's hash
        pyxfer.health.reset()
        src = source(src_dev, n, gen, pinned)
        with inject_fault(kind, path=path) as fault:
            out = pyxfer.verified_copy(src, dst_dev, route=path, verify="deferred", pin_memory=pinned)
        assert fault.used == 1
        torch.cuda.synchronize()
        with pytest.raises(pyxfer.TransferError, match=rf"^1 deferred verified copy failed verification; the first: "
                                                      rf"copy {src_dev} -> {dst_dev} of {n} bytes") as info:
            pyxfer.check_transfers()
        assert info.value.src_hash == pyxfer.checksum(src) and info.value.dst_hash == pyxfer.checksum(out), n
        assert not bytes_equal(out, src), n  # a fault always writes wrong bytes


@pytest.mark.parametrize("src_dev,dst_dev", DIRECTIONS)
@pytest.mark.parametrize("pinned", [True, False])
def test_reported_hashes_are_the_checksums_of_both_ends(src_dev, dst_dev, pinned, gen):
    # zeros on both routes: the first try's destination hash is that of n zero bytes (the source holds no
    # zero byte, so the fault never leaves the source's bytes)
    for n in (1, 7, 4099, MiB + 5, (8 << 20) + 3, (19 << 20) + 1):
        for offset in (0, 3):
            src = source(src_dev, n, gen, pinned, offset)
            src[src == 0] = 1
            want = (pyxfer.checksum(src), pyxfer.checksum(torch.zeros(n, dtype=torch.uint8)))
            with inject_fault("zeros", path="direct"), inject_fault("zeros", path="staged"):
                with pytest.raises(pyxfer.TransferError) as info:
                    pyxfer.verified_copy(src, dst_dev, route="direct", pin_memory=pinned)
            e = info.value
            assert (e.src_hash, e.dst_hash, e.retry_dst_hash) == (*want, want[1]), (n, offset)
            with inject_fault("zeros", path="direct"):
                pyxfer.verified_copy(src, dst_dev, route="direct", verify="deferred", pin_memory=pinned)
            with pytest.raises(pyxfer.TransferError) as info:
                pyxfer.check_transfers()
            assert (info.value.src_hash, info.value.dst_hash) == want, (n, offset, "deferred")
            pyxfer.health.reset()


def test_the_copy_to_the_host_follows_the_work_queued_before_it(gen):
    # the source is written on a side stream made current (a long kernel first): the copy must see the
    # write, and a write queued after the call must not reach the result
    n = (24 << 20) + 7
    stream = torch.cuda.Stream(0)
    for pin_memory in (True, False):
        for route in ("direct", "staged"):
            src = source(GPU, n, gen, pinned=False)
            fresh = source(GPU, n, gen, pinned=False)
            torch.cuda.synchronize()  # both made on the default stream
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20_000_000)
                src.copy_(fresh)
                out = pyxfer.verified_copy(src, "cpu", route=route, pin_memory=pin_memory)
                src.zero_()
            assert bytes_equal(out, fresh), (pin_memory, route)
            torch.cuda.synchronize()


def test_host_to_gpu_result_is_ready_on_the_current_stream(gen):
    stream = torch.cuda.Stream(0)
    for pinned in (True, False):
        for route in ("direct", "staged"):
            src = source("cpu", (24 << 20) + 3, gen, pinned)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20_000_000)
                out = pyxfer.verified_copy(src, GPU, route=route, verify="deferred")
                total = out.to(torch.int64).sum()  # on the same stream: sees every byte
            assert int(total) == int(src.to(torch.int64).sum()), (pinned, route)
    torch.cuda.synchronize()
    pyxfer.check_transfers()


def test_staging_pool_small_and_resized_under_concurrent_host_copies(gen):
    sources = {"d2h": source(GPU, (3 << 20) + 7, gen, pinned=False),
               "h2d": source("cpu", (3 << 20) + 5, gen, pinned=False)}
    want = {k: logical_bytes(v.cpu()) for k, v in sources.items()}
    stop, errors = threading.Event(), []

    def copier(k):
        try:
            while not stop.is_set():
                for pin_memory in (True, False):
                    if k % 2:
                        out = pyxfer.verified_copy(sources["d2h"], "cpu", route="staged" if k % 4 == 1 else "direct",
                                                   pin_memory=pin_memory)
                        ok = logical_bytes(out) == want["d2h"]
                    else:
                        out = pyxfer.verified_copy(sources["h2d"], GPU, route="staged")
                        ok = logical_bytes(out.cpu()) == want["h2d"]
                    if not ok:
                        errors.append(f"wrong bytes in copier {k}")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=copier, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for k in range(200):
        pyxfer.configure_staging(4096 * (1 + k % 5), 2 + (k * 7) % 6)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []


def test_host_legs_without_pool_workers():
    # PYXFER_HOST_HASH_THREADS=0: the waiting threads do all the host work; nothing waits forever
    code = """
import threading, torch, pyxfer
pyxfer.configure_staging(1 << 20, 2)  # few slots: the ring wraps many times
g = torch.Generator(device="cuda:0").manual_seed(5)
src = torch.randint(0, 256, ((24 << 20) + 3,), dtype=torch.uint8, device="cuda:0", generator=g)
host = src.cpu()
def run():
    for pin in (True, False):
        for route in ("direct", "staged"):
            out = pyxfer.verified_copy(src, "cpu", route=route, pin_memory=pin)
            assert torch.equal(out, host) and out.is_pinned() == pin
            back = pyxfer.verified_copy(host, "cuda:0", route=route)
            assert torch.equal(back, src)
threads = [threading.Thread(target=run) for _ in range(3)]
for t in threads: t.start()
for t in threads: t.join()
run()
print("ok")
"""
    r = run_python(code, env={"PYXFER_HOST_HASH_THREADS": "0"}, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr[-3000:]


@pytest.mark.parametrize("pin_memory", [True, False])
def test_a_failed_wait_in_the_host_legs_raises_without_hanging(pin_memory):
    # A device-side assert behind a long kernel on the source's stream: the chunks' events fail after
    # the copy was queued, in the pool's waits; the error reaches the caller, nothing hangs.
    code = f"""
import torch, pyxfer
src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:0")
index = torch.tensor([1 << 40], device="cuda:0")
torch.cuda.synchronize()
torch.cuda._sleep(300_000_000)
bad = src[index]  # asserts when it runs, long after the copy was queued
try:
    pyxfer.verified_copy(src, "cpu", pin_memory={pin_memory})
    print("no-error")
except RuntimeError as e:
    print("raised", "CUDA" in str(e) or "device-side assert" in str(e))
"""
    r = run_python(code, timeout=120)
    assert r.stdout.split()[:2] == ["raised", "True"], (r.stdout, r.stderr[-3000:])


def test_pin_memory_applies_to_gpu_to_host_only(gen):
    src = source(GPU, 4099, gen, pinned=False)
    host = source("cpu", 4099, gen, pinned=True)
    for pin_memory in (True, False):
        assert pyxfer.verified_copy(src, "cpu", pin_memory=pin_memory).is_pinned() == pin_memory
        assert not pyxfer.verified_copy(host, "cpu", pin_memory=pin_memory).is_pinned()  # CPU -> CPU: pageable
        assert pyxfer.verified_copy(host, GPU, pin_memory=pin_memory).is_cuda
        assert pyxfer.verified_copy(src, GPU, pin_memory=pin_memory).is_cuda


def test_gradient_of_a_host_to_gpu_copy_comes_back_exact(gen):
    x = torch.randn(3, 1 << 19, dtype=torch.float64, requires_grad=True)  # 12 MiB: several host items
    w = torch.randn(3, 1 << 19, dtype=torch.float64, device=GPU)
    y = pyxfer.verified_copy(x, GPU)
    (y * w).sum().backward()
    assert x.grad.device.type == "cpu" and torch.equal(x.grad, w.cpu())
