"""Verified transfers on real GPUs. Two GPUs (``multigpu``): peer copies both ways, host <-> device,
faults on the real peer path, concurrency across streams, deferred verification inside a CUDA graph,
autograd over two GPUs. Then regressions of the transfer review (issue 28) and of issue 22 items 1
and 4, on one GPU (``gpu``) and two (``multigpu``). Anything that may leave a sticky CUDA error (or
a broken capture) runs in a fresh interpreter."""
import threading

import pytest
import torch

import pyxfer
from pyxfer.buffers import pack
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.processes import run_python
from support.tensors import conj_views, logical_bytes, random_tensor

# cuda:0 current and health reset around each test; no latched mismatch left behind (conftest.py)
pytestmark = pytest.mark.usefixtures("clean_transfers")


def gpu_bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.to(a.device).contiguous().reshape(-1).view(torch.uint8))


SIZES = [0, 1, 7, 4096 + 3, (1 << 20) + 5, (64 << 20) + 3, (192 << 20) + 11]  # bytes; > 64 MiB: copy engine, chunks
PAIRS = [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]


@pytest.mark.multigpu
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


@pytest.mark.multigpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.bfloat16,
                                   torch.complex64, torch.int64])
def test_dtypes_and_non_contiguous_views(dtype, gen):
    base = random_tensor((37, 1029), dtype, gen, device="cuda:0")
    for view in (base, base.t(), base[3:, 5::3], base[1:2], base.view(-1)[1:]):
        out = pyxfer.verified_copy(view, "cuda:1")
        assert out.is_contiguous() and gpu_bytes_equal(out, view.contiguous())
        back = pyxfer.verified_copy(out.t() if out.dim() == 2 else out, "cuda:0")
        assert gpu_bytes_equal(back, (out.t() if out.dim() == 2 else out).contiguous())


@pytest.mark.multigpu
def test_one_gib_both_directions(gen):
    src = torch.randint(-2**31, 2**31 - 1, ((1 << 30) // 4 + 3,), dtype=torch.int32, device="cuda:0")
    out = pyxfer.verified_copy(src, "cuda:1")
    back = pyxfer.verified_copy(out, "cuda:0")
    assert torch.equal(back, src)
    assert pyxfer.checksum(out) == pyxfer.checksum(src)


@pytest.mark.multigpu
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


@pytest.mark.multigpu
def test_faults_on_both_paths_raise(gen):
    src = random_tensor((123457,), torch.uint8, gen, device="cuda:1")
    with inject_fault("zeros", path="direct"), inject_fault("truncate", path="staged"):
        with pytest.raises(pyxfer.TransferError, match=r"copy cuda:1 -> cuda:0 of 123457 bytes"):
            pyxfer.verified_copy(src, "cuda:0")


@pytest.mark.multigpu
def test_unverified_fault_really_lands_in_peer_memory(gen):
    src = random_tensor((1 << 20,), torch.uint8, gen, device="cuda:0")
    with inject_fault("bitflip", path="direct"):
        out = pyxfer.verified_copy(src, "cuda:1", route="direct", verify="none")
    diff = (out.cpu() ^ src.cpu()).nonzero()
    assert diff.numel() == 1  # exactly one byte, one bit
    assert bin(int((out.cpu() ^ src.cpu())[diff[0, 0]])).count("1") == 1


@pytest.mark.multigpu
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


@pytest.mark.multigpu
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


@pytest.mark.multigpu
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


@pytest.mark.multigpu
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


@pytest.mark.multigpu
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


@pytest.mark.multigpu
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
@pytest.mark.multigpu
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


@pytest.mark.multigpu
def test_staged_copy_keeps_bounded_pinned_memory(gen):
    src = random_tensor(((256 << 20) + 9,), torch.uint8, gen, device="cuda:0")
    try:
        pyxfer.configure_staging(1 << 20, 3)  # 3 MiB of pinned memory for a 256 MiB copy
        out = pyxfer.staged_copy(src, "cuda:1")
        assert gpu_bytes_equal(out, src)
    finally:
        pyxfer.configure_staging()

# (The unknown-device check needs one GPU: tests/ops/test_checks.py, marked gpu.)


# ---- regressions of the transfer review (issue 28) and of issue 22 items 1 and 4 -----------------

SLOW = 50_000_000  # cycles of torch.cuda._sleep: tens of milliseconds, far longer than any copy here


def bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


# ---- one GPU ------------------------------------------------------------------------------------

# Issue 28 item 2: check_transfers() waits for graph replays; it never reads (or clears) the latch
# while a replay's comparison may still run.
@pytest.mark.gpu
def test_check_transfers_waits_for_graph_replays(gen):
    src = random_tensor(((1 << 20) + 3,), torch.uint8, gen, device="cuda:0")
    pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with inject_fault("bitflip", path="direct"):  # captured: every replay flips a bit
        with torch.cuda.graph(graph):
            torch.cuda._sleep(SLOW)  # the replay's comparison runs long after replay() returned
            pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")
    pyxfer.check_transfers()  # the capture ran nothing
    graph.replay()
    with pytest.raises(pyxfer.TransferError, match=r"^1 deferred verified copy failed verification; the first: "
                                                  r"copy cuda:0 -> cuda:0"):
        pyxfer.check_transfers()
    graph.replay()
    graph.replay()
    with pytest.raises(pyxfer.TransferError, match=r"^2 deferred verified copies failed verification"):
        pyxfer.check_transfers()
    torch.cuda.synchronize()
    pyxfer.check_transfers()  # every mismatch was reported exactly once
    pyxfer.health.reset()


# Issue 28 items 4 and 7, and the CPU ends of item 3: what a CUDA graph cannot hold is refused with a
# clear error before anything is queued, and the capture goes on.
@pytest.mark.gpu
def test_capture_refuses_what_replays_cannot_repeat(gen):
    src = random_tensor((4099,), torch.uint8, gen, device="cuda:0")
    host = random_tensor((4099,), torch.uint8, gen).pin_memory()
    pyxfer.verified_copy(src, "cuda:0", verify="deferred")
    torch.cuda.synchronize()
    refusals = [
        (lambda: pyxfer.verified_copy(src, "cuda:0", route="staged", verify="deferred"),
         r"pyxfer.verified_copy: the staged route cannot be captured in a CUDA graph"),
        (lambda: pyxfer.staged_copy(src, "cuda:0"), r"pyxfer.staged_copy: the staged route cannot be captured"),
        (lambda: pyxfer.verified_copy(host, "cuda:0", route="direct", verify="deferred"),
         r"verify='deferred' with a CPU source cannot be captured in a CUDA graph"),
        (lambda: pyxfer.verified_copy(src, "cpu", route="direct", verify="none"),
         r"a CPU destination cannot be captured in a CUDA graph"),
        (lambda: pyxfer.verified_copy(host[1:].view(-1)[::2], "cuda:0", route="direct", verify="none"),
         r"a non-contiguous source on cpu cannot be captured in a CUDA graph"),
    ]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for copy, message in refusals:
            with pytest.raises(RuntimeError, match=message):
                copy()
        pyxfer.health.mark("cuda:0", "cuda:0", "corrupt")  # route="auto" would pick the staged route
        with pytest.raises(RuntimeError, match=r"route='auto' resolves to the staged route for cuda:0 -> cuda:0 "
                                               r"\(the pair is marked corrupt\), which cannot be captured"):
            pyxfer.verified_copy(src, "cuda:0", route="auto", verify="deferred")
        pyxfer.health.reset()
        out = pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")  # still capturable
    graph.replay()
    torch.cuda.synchronize()
    assert bytes_equal(out, src)
    pyxfer.check_transfers()


# Issue 28 item 6 on a GPU: conjugate / negative views are copied and hashed as their values.
@pytest.mark.gpu
def test_conjugate_views_on_the_gpu(gen):
    for src_dev, dst_dev in (("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cuda:0", "cuda:0")):
        for name, view, want in conj_views(gen, src_dev):
            for route in ("direct", "staged"):
                for verify in ("sync", "deferred", "none"):
                    out = pyxfer.verified_copy(view, dst_dev, route=route, verify=verify)
                    assert bytes_equal(out, want), (src_dev, dst_dev, name, route, verify)
            assert bytes_equal(pyxfer.staged_copy(view, dst_dev), want), name
            assert pyxfer.checksum(view) == pyxfer.checksum(want), name
    torch.cuda.synchronize()
    pyxfer.check_transfers()


# Issue 28, faults that must always write wrong bytes: the caching allocator hands a same-size
# destination back with the last copy's bytes still in it, so "stale" / "truncate" / "shift" of a
# constant source (and "zeros" of an all-zero one) would otherwise leave exactly the source's bytes.
@pytest.mark.gpu
@pytest.mark.parametrize("src_dev,dst_dev", [("cpu", "cuda:0"), ("cuda:0", "cuda:0"), ("cuda:0", "cpu")])
def test_faults_always_write_wrong_bytes_on_the_gpu(src_dev, dst_dev):
    for n in (4099, (5 << 20) + 3):  # the one-kernel hashes and the side-stream ones
        for route in ("direct", "staged"):
            for kind in FAULT_KINDS:
                src = torch.full((n,), 0 if kind == "zeros" else 0x5A, dtype=torch.uint8, device=src_dev)
                out = pyxfer.verified_copy(src, dst_dev, route=route, verify="none")
                del out  # recycled by the next copy's destination
                with inject_fault(kind, path=route) as fault:
                    out = pyxfer.verified_copy(src, dst_dev, route=route, verify="none")
                assert fault.used == 1 and not bytes_equal(out, src), (n, route, kind)
                del out
                pyxfer.health.reset()
                with inject_fault(kind, path="direct") as fault:  # verified: seen and repaired
                    out = pyxfer.verified_copy(src, dst_dev, route="direct")
                assert fault.used == 1 and bytes_equal(out, src), (n, kind)
                assert pyxfer.health.status(src_dev, dst_dev) == "corrupt", (n, kind)


# Issue 28 item 12: every pair with a deferred mismatch is marked corrupt, not just the first.
@pytest.mark.gpu
def test_check_transfers_marks_every_failing_pair(gen):
    host = random_tensor((4099,), torch.uint8, gen)
    dev = random_tensor((5001,), torch.uint8, gen, device="cuda:0")
    with inject_fault("bitflip", path="direct", times=3):
        pyxfer.verified_copy(host, "cuda:0", route="direct", verify="deferred")
        pyxfer.verified_copy(dev, "cpu", route="direct", verify="deferred")
        pyxfer.verified_copy(dev, "cuda:0", route="direct", verify="deferred")
    with pytest.raises(pyxfer.TransferError, match=r"^3 deferred verified copies failed verification"):
        pyxfer.check_transfers()
    for pair in (("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cuda:0", "cuda:0")):
        assert pyxfer.health.status(*pair) == "corrupt", pair


# Issue 28 item 8: offload() must not rewrite the pinned buffer under a reload still reading it.
@pytest.mark.gpu
def test_offload_waits_for_an_in_flight_reload(gen):
    old = random_tensor(((1 << 20) + 5,), torch.uint8, gen, device="cuda:0")
    packed = pack([old])
    host = packed.offload().result()
    first = bytes(host.data.numpy())
    slow = torch.cuda.Stream(0)
    with torch.cuda.stream(slow):
        torch.cuda._sleep(SLOW)  # the reload below starts only after this
    reload = host.reload("cuda:0", stream=slow)
    packed.data.copy_(random_tensor(packed.data.shape, torch.uint8, gen, device="cuda:0"))
    packed.offload().result()  # on its own side stream: must wait for the reload's read
    reloaded = reload.result()
    torch.cuda.synchronize()
    assert bytes(reloaded.data.cpu().numpy()) == first


# Issue 28 item 10: configure_staging shrinking the pool while copies wait for slots.
@pytest.mark.gpu
def test_staging_pool_resized_under_concurrent_copies():
    code = """
import threading, torch, pyxfer
src = torch.randint(0, 256, ((3 << 20) + 7,), dtype=torch.uint8, device="cuda:0")
want = src.cpu()
stop, errors = threading.Event(), []
def copier():
    try:
        while not stop.is_set():
            out = pyxfer.staged_copy(src, "cpu")
            if not torch.equal(out, want):
                errors.append("wrong bytes")
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=copier) for _ in range(4)]
for t in threads:
    t.start()
for k in range(300):
    pyxfer.configure_staging(4096 * (1 + k % 5), 2 + (k * 7) % 6)
stop.set()
for t in threads:
    t.join()
pyxfer.configure_staging()
print(errors or "ok")
"""
    r = run_python(code, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], (r.stdout, r.stderr)


# Issue 28 item 13: pyxfer's side streams are its own: never a stream another thread is capturing on.
@pytest.mark.gpu
def test_side_streams_never_join_another_threads_capture():
    code = """
import threading, torch, pyxfer
src = torch.randint(0, 256, ((6 << 20) + 3,), dtype=torch.uint8, device="cuda:0")
host = src.cpu()
pyxfer.verified_copy(src, "cuda:0")
torch.cuda.synchronize()
capturing, copied, errors = threading.Event(), threading.Event(), []
def copier():
    capturing.wait(30)
    try:
        for k in range(100):  # more copies than torch's pool has streams per device
            out = pyxfer.verified_copy(src, "cuda:0" if k % 2 else "cpu", route="direct" if k % 3 else "staged")
            assert torch.equal(out.cpu(), host)
    except Exception as e:
        errors.append(repr(e))
    finally:
        copied.set()
t = threading.Thread(target=copier)
t.start()
x = torch.ones(1 << 20, device="cuda:0")
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # torch's capture stream is a pool stream
    capturing.set()
    copied.wait(120)
    y = x * 2
t.join()
graph.replay()
torch.cuda.synchronize()
assert torch.equal(y, x * 2)
print(errors or "ok")
"""
    r = run_python(code, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], (r.stdout, r.stderr)


# Issue 22 item 1 on a GPU: the gradient of a staged copy goes back to the source's device.
@pytest.mark.gpu
def test_staged_copy_gradient_crosses_devices():
    x = torch.randn(33, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(33, 7, dtype=torch.float64, device="cuda:0")
    y = pyxfer.staged_copy(x, "cuda:0")
    (y * w).sum().backward()
    assert x.grad.device.type == "cpu" and torch.equal(x.grad, w.cpu())


# Issue 22 item 4 on a GPU: faults and deferred errors of GPU copies belong to their thread.
@pytest.mark.gpu
def test_faults_and_deferred_errors_stay_in_their_thread_on_the_gpu(gen):
    src = random_tensor(((1 << 20) + 3,), torch.uint8, gen, device="cuda:0")
    armed, done = threading.Event(), threading.Event()
    seen, errors = {}, []

    def armer():
        try:
            with inject_fault("bitflip", path="direct", times=4):
                armed.set()
                done.wait(30)
                pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")
            with pytest.raises(pyxfer.TransferError, match=r"^1 deferred verified copy failed"):
                pyxfer.check_transfers()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def other():
        armed.wait(30)
        try:
            seen["out"] = [pyxfer.verified_copy(src, dst, route="direct", verify=v)
                           for dst in ("cuda:0", "cpu") for v in ("none", "deferred")]
            torch.cuda.synchronize()
            pyxfer.check_transfers()  # nothing of this thread's copies mismatched
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done.set()

    threads = [threading.Thread(target=armer), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(bytes_equal(out, src) for out in seen["out"])
    pyxfer.health.reset()


# ---- two GPUs -------------------------------------------------------------------------------------

# Issue 28 item 1: a dropped deferred copy into a recycled destination that holds the previous
# copy's bytes is caught: the source hash never crosses the link under test (it reaches the
# comparison through mapped host memory), so it cannot be left stale by the same dropped writes.
@pytest.mark.multigpu
def test_deferred_copy_dropped_into_a_recycled_destination_is_caught(gen):
    for n in ((1 << 20) + 3, (96 << 20) + 5):  # the fused kernel, the copy-engine pipeline
        previous = random_tensor((n,), torch.uint8, gen, device="cuda:0")
        out = pyxfer.verified_copy(previous, "cuda:1", route="direct", verify="deferred")
        torch.cuda.synchronize(1)
        pyxfer.check_transfers()
        del out  # the next destination of this size is the same memory, holding `previous`
        src = random_tensor((n,), torch.uint8, gen, device="cuda:0")
        with inject_fault("stale", src="cuda:0", dst="cuda:1", path="direct") as fault:
            pyxfer.verified_copy(src, "cuda:1", route="direct", verify="deferred")
        assert fault.used == 1
        with pytest.raises(pyxfer.TransferError, match=r"^1 deferred verified copy failed verification; the first: "
                                                      rf"copy cuda:0 -> cuda:1 of {n} bytes"):
            pyxfer.check_transfers()
    # a pair marked corrupt: deferred copies route staged and verify clean, whatever the direct link does
    with inject_fault("zeros", src="cuda:0", dst="cuda:1", path="direct", times=10) as fault:
        for n in (4099, (5 << 20) + 1):
            src = random_tensor((n,), torch.uint8, gen, device="cuda:0")
            out = pyxfer.verified_copy(src, "cuda:1", verify="deferred")
            torch.cuda.synchronize(1)
            pyxfer.check_transfers()
            assert bytes_equal(out, src)
    assert fault.used == 0 and pyxfer.health.status("cuda:0", "cuda:1") == "corrupt"


# Issue 28 item 3: a copy captured across two GPUs keeps its temporaries on the other GPU alive for
# the replays (they must not be handed to other tensors), and a non-contiguous source on a device
# that is not capturing is refused (its contiguous copy would be made once, at capture).
@pytest.mark.multigpu
@pytest.mark.parametrize("capture_on", [0, 1])
def test_capture_across_two_gpus_keeps_its_temporaries(capture_on, gen):
    src = random_tensor(((1 << 20) + 3,), torch.uint8, gen, device="cuda:0")
    big = random_tensor(((80 << 20) + 3,), torch.uint8, gen, device="cuda:0")
    for s in (src, big):
        pyxfer.verified_copy(s, "cuda:1", route="direct", verify="deferred")  # warm-up
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.set_device(capture_on)
    graph = torch.cuda.CUDAGraph()
    # a capture stream of its own on the capturing device (torch.cuda.graph's default capture stream
    # is made once per process, on the device current at the first capture)
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(capture_on)):
        assert torch.cuda.current_device() == capture_on
        outs = [pyxfer.verified_copy(s, "cuda:1", route="direct", verify="deferred") for s in (src, big)]
        if capture_on == 1:
            with pytest.raises(RuntimeError, match=r"a non-contiguous source on cuda:0 cannot be captured"):
                pyxfer.verified_copy(src[::2], "cuda:1", verify="deferred")
    torch.cuda.set_device(0)
    other = 1 - capture_on
    guards = [torch.full((64,), 7, dtype=torch.int64, device=f"cuda:{other}") for _ in range(256)]
    torch.cuda.synchronize(other)
    for _ in range(3):
        src.copy_(random_tensor(src.shape, torch.uint8, gen, device="cuda:0"))
        # a replay runs on the capturing GPU's current stream: writes of the source queued on another
        # GPU are ordered before it by the caller (capture_on=1 raced without this: the source hash and
        # the copy read different bytes, and the replay latched a mismatch)
        torch.cuda.synchronize(0)
        graph.replay()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert bytes_equal(outs[0], src) and bytes_equal(outs[1], big)
    assert all(bool((g == 7).all()) for g in guards)  # no replay wrote into memory reused by others
    pyxfer.check_transfers()


# Issue 28 item 5(a): peer access goes through PyTorch's allocator, which also maps expandable
# segments; the first peer operation of the process is pyxfer's own.
@pytest.mark.multigpu
def test_peer_copies_with_expandable_segments():
    code = """
import torch, pyxfer
for n in ((5 << 20) + 3, (300 << 20) + 7):  # the fused pull kernel, the copy engine
    for a, b in ((0, 1), (1, 0)):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{a}")
        for verify in ("sync", "deferred"):
            out = pyxfer.verified_copy(src, f"cuda:{b}", route="direct", verify=verify)
            assert torch.equal(out.cpu(), src.cpu()), (n, a, b, verify)
pyxfer.check_transfers()
print("ok")
"""
    r = run_python(code, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr
