"""Verified GPU copies on real GPUs, issue 34's device legs: the GPU-local fused copy-and-hash kernel, the
two-kernel peer protocol (in a row up to limits[0], side by side up to limits[1]), the copy-engine
pipeline scheduled from the pair's measured rates, the guards that catch a hashing kernel that did not
run, CUDA graphs (graph-owned workspaces beside eager copies on the capture stream), and threads that
share a stream's workspace. One-GPU tests carry the ``gpu`` marker, two-GPU tests ``multigpu``."""
import threading

import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.processes import run_python
from support.tensors import random_tensor

# [largest peer copy whose two kernels run in a row, largest one-kernel pull, largest copy whose sync
# wait polls the published words] (csrc/torch_bindings.cpp, verified_copy_limits)
SERIAL, FUSED, SPIN = torch.ops.pyxfer.verified_copy_limits()
KIB, MIB = 1 << 10, 1 << 20
SMALL_HASH = 64 * KIB  # the one-block source hash (kSmallHashBytes in csrc/include/pyxfer/launch.h)
LOCAL_SIZES = [0, 1, 7, 15, 16, 17, 4095, 4096, 4097, SMALL_HASH + 1, MIB + 3, 6 * MIB + 5, SPIN, SPIN + 1]
PEER_SIZES = [0, 1, 7, 4095, 4096, SMALL_HASH, SMALL_HASH + 1, SERIAL - 8, SERIAL, SERIAL + 3, SERIAL + 16,
              FUSED - 8, FUSED, FUSED + 3, FUSED + 64 * MIB + 8]
PEER_PROTOCOLS = [5, SMALL_HASH + 5, SERIAL + 16, FUSED + 8]  # in a row (one-block / multi-block source
# hash), side by side, copy engine
OFFSETS = (0, 1, 3, 8)  # storage offsets: 16-, 1-, 3- and 8-byte aligned sources
PAIRS = [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]


@pytest.fixture(autouse=True)
def clean_state():
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    pyxfer.health.reset()
    yield
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
        torch.cuda.set_device(0)
    pyxfer.check_transfers()  # no test may leave a latched mismatch behind
    pyxfer.health.reset()


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8).cpu(),
        b.detach().contiguous().reshape(-1).view(torch.uint8).cpu())


def source(n, offset, gen, device):
    """n fresh random bytes at storage offset `offset` of a buffer on `device`."""
    return random_tensor((n + offset + 16,), torch.uint8, gen, device=device)[offset:offset + n]


def leave_sentinel(n, device):
    """The next n-byte allocation on device's current stream (a copy's destination) starts as 0xA5 bytes."""
    block = torch.full((n,), 0xA5, dtype=torch.uint8, device=device)
    del block


def deferred_failure(n, src, dst):
    return rf"^1 deferred verified copy failed verification; the first: copy {src} -> {dst} of {n} bytes"


# ---- GPU-local: the fused copy-and-hash kernel ------------------------------------------------------

@pytest.mark.gpu
def test_local_copies_every_size_offset_and_mode(gen):
    for n in LOCAL_SIZES:
        for offset in OFFSETS:
            src = source(n, offset, gen, "cuda:0")
            for verify in ("sync", "deferred"):
                leave_sentinel(n, "cuda:0")
                out = pyxfer.verified_copy(src, "cuda:0", route="direct", verify=verify)
                assert out.device == torch.device("cuda:0") and same(out, src), (n, offset, verify)
    pyxfer.check_transfers()
    assert pyxfer.health.status("cuda:0", "cuda:0") == "healthy"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool,
                                   torch.float8_e4m3fn])
def test_local_dtypes_and_non_contiguous_sources(dtype, gen):
    base = random_tensor((37, 1029), dtype, gen, device="cuda:0")
    for view in (base, base.t(), base[3:, 5::3], base[1:2], base.view(-1)[1:]):
        for verify in ("sync", "deferred"):
            out = pyxfer.verified_copy(view, "cuda:0", route="auto", verify=verify)
            assert out.is_contiguous() and same(out, view.contiguous()), verify
    pyxfer.check_transfers()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_local_faults_are_caught_sync_and_deferred(kind, gen):
    for n in (5, 4099, SMALL_HASH + 1, MIB + 3, 6 * MIB + 5):
        for offset in (0, 3):
            src = source(n, offset, gen, "cuda:0")
            pyxfer.health.reset()
            with inject_fault(kind, src="cuda:0", dst="cuda:0") as fault:
                out = pyxfer.verified_copy(src, "cuda:0", route="direct")
            assert fault.used == 1 and same(out, src), (n, offset)  # caught, repaired staged
            assert pyxfer.health.status("cuda:0", "cuda:0") == "corrupt", (n, offset)
            pyxfer.health.reset()
            with inject_fault(kind, src="cuda:0", dst="cuda:0") as fault:
                out = pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")
            assert fault.used == 1 and not same(out, src), (n, offset)  # what landed is returned ...
            with pytest.raises(pyxfer.TransferError, match=deferred_failure(n, "cuda:0", "cuda:0")):
                pyxfer.check_transfers()  # ... and reported


# The guard test: the destination recycles the last copy's memory, which holds the source's bytes, and
# the thread's words hold that copy's (equal) hashes. A kernel that did not run leaves exactly the
# right bytes and an earlier call's proof behind: only the prefill and the run token tell.
@pytest.mark.gpu
@pytest.mark.parametrize("verify", ["sync", "deferred"])
def test_local_kernel_that_did_not_run_is_caught(verify, gen):
    for n in (1, 4096, MIB + 3, 6 * MIB + 5, SPIN + 1):  # SPIN + 1: the host waits on the event, not the words
        src = source(n, 0, gen, "cuda:0")
        earlier = pyxfer.verified_copy(src, "cuda:0", route="direct", verify=verify)
        torch.cuda.synchronize()
        pyxfer.check_transfers()
        del earlier
        pyxfer.health.reset()
        with inject_fault("skip_kernel", src="cuda:0", dst="cuda:0") as fault:
            out = pyxfer.verified_copy(src, "cuda:0", route="direct", verify=verify)
        assert fault.used == 1, n
        if verify == "sync":
            assert pyxfer.health.status("cuda:0", "cuda:0") == "corrupt" and same(out, src), n  # caught, repaired
        else:
            with pytest.raises(pyxfer.TransferError, match=deferred_failure(n, "cuda:0", "cuda:0")):
                pyxfer.check_transfers()


@pytest.mark.gpu
def test_local_reported_hashes_are_the_checksums_of_both_ends(gen):
    for n in (1, 4099, MIB + 3, SPIN + 1):
        for offset in (0, 3):
            src = source(n, offset, gen, "cuda:0")
            src[src == 0] = 1  # zeros must change it, so the fault writes nothing else
            want = (pyxfer.checksum(src), pyxfer.checksum(torch.zeros(n, dtype=torch.uint8, device="cuda:0")))
            with inject_fault("zeros", path="direct"), inject_fault("zeros", path="staged"):
                with pytest.raises(pyxfer.TransferError) as info:
                    pyxfer.verified_copy(src, "cuda:0", route="direct")
            assert (info.value.src_hash, info.value.dst_hash) == want, (n, offset)
            with inject_fault("zeros", path="direct"):
                pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")
            with pytest.raises(pyxfer.TransferError) as info:
                pyxfer.check_transfers()
            assert (info.value.src_hash, info.value.dst_hash) == want, (n, offset, "deferred")
            pyxfer.health.reset()


@pytest.mark.gpu
def test_local_copy_orders_with_the_callers_stream(gen):
    s = torch.cuda.Stream(0)
    for n in (4099, 6 * MIB + 5):
        src = source(n, 0, gen, "cuda:0")
        want = src.clone()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)  # the copy waits behind it, on s
            out = pyxfer.verified_copy(src, "cuda:0", route="direct", verify="deferred")
            seen = out.clone()  # ordered after the copy on s
            src.zero_()  # ordered after the copy read it
        torch.cuda.synchronize()
        assert same(seen, want) and same(out, want)
    pyxfer.check_transfers()


@pytest.mark.gpu
def test_local_copies_in_a_cuda_graph_beside_eager_copies(gen):
    sizes = (5, MIB + 3, 6 * MIB + 5)
    statics = [random_tensor((n,), torch.uint8, gen, device="cuda:0") for n in sizes]
    for s in statics:
        pyxfer.verified_copy(s, "cuda:0", route="direct", verify="deferred")  # warm-up outside the capture
    capture = torch.cuda.Stream(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        outs = [pyxfer.verified_copy(s, "cuda:0", route="direct", verify="deferred") for s in statics]
    for _ in range(4):
        fresh = [random_tensor(s.shape, torch.uint8, gen, device="cuda:0") for s in statics]
        for s, f in zip(statics, fresh):
            s.copy_(f)
        torch.cuda.synchronize()
        graph.replay()  # on the current stream, while eager copies run on the capture stream: a graph that
        with torch.cuda.stream(capture):  # used that stream's workspace would share it with them
            eager = [pyxfer.verified_copy(f, "cuda:0", route="direct", verify="deferred") for f in fresh]
        torch.cuda.synchronize()
        assert all(same(o, f) for o, f in zip(outs, fresh)) and all(same(e, f) for e, f in zip(eager, fresh))
    pyxfer.check_transfers()
    for kind in ("bitflip", "shift", "skip_kernel"):  # captured with the fault: every replay is caught
        faulty = torch.cuda.CUDAGraph()
        with inject_fault(kind, src="cuda:0", dst="cuda:0") as fault:
            with torch.cuda.graph(faulty, stream=capture):
                pyxfer.verified_copy(statics[1], "cuda:0", route="direct", verify="deferred")
        assert fault.used == 1
        faulty.replay()
        faulty.replay()
        with pytest.raises(pyxfer.TransferError, match=r"^2 deferred verified copies failed verification; the "
                                                      r"first: copy cuda:0 -> cuda:0"):
            pyxfer.check_transfers()
        del faulty


@pytest.mark.gpu
def test_threads_copying_on_one_stream(gen):
    # every thread's current stream is cuda:0's default stream: they share its scratch, each its own words
    sizes = [int(x) for x in torch.randint(1, 3 * MIB, (40,), generator=gen)]
    sources = [source(n, n % 5, gen, "cuda:0") for n in sizes]
    errors = []

    def worker(k):
        try:
            outs = [pyxfer.verified_copy(s, "cuda:0", route="direct", verify=("sync", "deferred")[(i + k) % 2])
                    for i, s in enumerate(sources)]
            torch.cuda.synchronize()
            errors.extend((k, i) for i, (o, s) in enumerate(zip(outs, sources)) if not same(o, s))
            pyxfer.check_transfers()  # no false mismatch from another thread's copies
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- GPU -> GPU ---------------------------------------------------------------------------------------

@pytest.mark.multigpu
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
@pytest.mark.parametrize("current", [0, 1])
def test_peer_copies_every_size_offset_and_mode(src_dev, dst_dev, current, gen):
    torch.cuda.set_device(current)
    for n in PEER_SIZES:
        for offset in (0, 3, 8):
            src = source(n, offset, gen, src_dev)
            for verify in ("sync", "deferred"):
                leave_sentinel(n, dst_dev)
                out = pyxfer.verified_copy(src, dst_dev, route="direct", verify=verify)
                assert out.device == torch.device(dst_dev) and same(out, src), (n, offset, verify)
        assert torch.cuda.current_device() == current
    pyxfer.check_transfers()
    assert pyxfer.health.status(src_dev, dst_dev) == "healthy"


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
def test_peer_faults_are_caught_on_every_protocol(kind, src_dev, dst_dev, gen):
    for n in PEER_PROTOCOLS:
        src = source(n, 3 if n < FUSED else 0, gen, src_dev)
        pyxfer.health.reset()
        with inject_fault(kind, src=src_dev, dst=dst_dev) as fault:
            out = pyxfer.verified_copy(src, dst_dev, route="direct")
        assert fault.used == 1 and same(out, src), n  # caught, repaired staged
        assert pyxfer.health.status(src_dev, dst_dev) == "corrupt", n
        pyxfer.health.reset()
        with inject_fault(kind, src=src_dev, dst=dst_dev) as fault:
            out = pyxfer.verified_copy(src, dst_dev, route="direct", verify="deferred")
        assert fault.used == 1 and not same(out, src), n
        with pytest.raises(pyxfer.TransferError, match=deferred_failure(n, src_dev, dst_dev)):
            pyxfer.check_transfers()


@pytest.mark.multigpu
@pytest.mark.parametrize("verify", ["sync", "deferred"])
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
def test_peer_kernel_that_did_not_run_is_caught(verify, src_dev, dst_dev, gen):
    for n in PEER_PROTOCOLS:
        src = source(n, 0, gen, src_dev)
        earlier = pyxfer.verified_copy(src, dst_dev, route="direct", verify=verify)
        torch.cuda.synchronize(torch.device(dst_dev))
        pyxfer.check_transfers()
        del earlier  # the next destination recycles memory holding the source's bytes
        pyxfer.health.reset()
        with inject_fault("skip_kernel", src=src_dev, dst=dst_dev) as fault:
            out = pyxfer.verified_copy(src, dst_dev, route="direct", verify=verify)
        assert fault.used == 1, n
        if verify == "sync":
            assert pyxfer.health.status(src_dev, dst_dev) == "corrupt" and same(out, src), n
        else:
            with pytest.raises(pyxfer.TransferError, match=deferred_failure(n, src_dev, dst_dev)):
                pyxfer.check_transfers()


@pytest.mark.multigpu
@pytest.mark.parametrize("src_dev,dst_dev", PAIRS)
def test_peer_reported_hashes_are_the_checksums_of_both_ends(src_dev, dst_dev, gen):
    for n in PEER_PROTOCOLS:
        src = source(n, 0, gen, src_dev)
        src[src == 0] = 1
        want = (pyxfer.checksum(src), pyxfer.checksum(torch.zeros(n, dtype=torch.uint8, device=dst_dev)))
        with inject_fault("zeros", path="direct"), inject_fault("zeros", path="staged"):
            with pytest.raises(pyxfer.TransferError) as info:
                pyxfer.verified_copy(src, dst_dev, route="direct")
        assert (info.value.src_hash, info.value.dst_hash) == want, n
        with inject_fault("zeros", path="direct"):
            pyxfer.verified_copy(src, dst_dev, route="direct", verify="deferred")
        with pytest.raises(pyxfer.TransferError) as info:
            pyxfer.check_transfers()
        assert (info.value.src_hash, info.value.dst_hash) == want, (n, "deferred")
        pyxfer.health.reset()


@pytest.mark.multigpu
def test_peer_source_overwritten_right_after_a_deferred_copy(gen):
    for n in PEER_PROTOCOLS:
        for a, b in ((0, 1), (1, 0)):
            src = source(n, 0, gen, f"cuda:{a}")
            want = src.clone()
            out = pyxfer.verified_copy(src, f"cuda:{b}", route="direct", verify="deferred")
            with torch.cuda.device(a):
                src.zero_()  # on cuda:a's current stream: after the copy's reads
            pyxfer.check_transfers()  # no false mismatch
            assert same(out, want), (n, a, b)


@pytest.mark.multigpu
@pytest.mark.parametrize("capture_on", [0, 1])
def test_peer_copies_in_a_cuda_graph_beside_eager_copies(capture_on, gen):
    sizes = (4099, SERIAL + 16, FUSED + 8)
    statics = [random_tensor((n,), torch.uint8, gen, device="cuda:0") for n in sizes]
    for s in statics:  # warm-up outside the capture (the first large copy measures the pair)
        pyxfer.verified_copy(s, "cuda:1", route="direct", verify="deferred")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.set_device(capture_on)
    capture = torch.cuda.Stream(capture_on)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        outs = [pyxfer.verified_copy(s, "cuda:1", route="direct", verify="deferred") for s in statics]
    torch.cuda.set_device(0)
    for _ in range(3):
        fresh = [random_tensor(s.shape, torch.uint8, gen, device="cuda:0") for s in statics]
        for s, f in zip(statics, fresh):
            s.copy_(f)
        torch.cuda.synchronize(0)
        graph.replay()
        with torch.cuda.device(capture_on), torch.cuda.stream(capture):
            eager = [pyxfer.verified_copy(f, "cuda:1", route="direct", verify="deferred") for f in fresh]
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert all(same(o, f) for o, f in zip(outs, fresh)) and all(same(e, f) for e, f in zip(eager, fresh))
    pyxfer.check_transfers()
    for kind in ("bitflip", "skip_kernel"):
        for s in statics:  # each protocol, captured with the fault: every replay is caught
            torch.cuda.set_device(capture_on)
            faulty = torch.cuda.CUDAGraph()
            with inject_fault(kind, src="cuda:0", dst="cuda:1") as fault:
                with torch.cuda.graph(faulty, stream=capture):
                    pyxfer.verified_copy(s, "cuda:1", route="direct", verify="deferred")
            torch.cuda.set_device(0)
            assert fault.used == 1
            faulty.replay()
            faulty.replay()
            torch.cuda.synchronize(0)
            with pytest.raises(pyxfer.TransferError, match=r"^2 deferred verified copies failed verification; "
                                                          r"the first: copy cuda:0 -> cuda:1"):
                pyxfer.check_transfers()
            del faulty


@pytest.mark.multigpu
def test_threads_copying_between_the_same_streams(gen):
    sizes = [int(x) for x in torch.randint(1, 2 * SERIAL, (30,), generator=gen)]
    sources = [source(n, n % 7, gen, "cuda:0") for n in sizes]
    errors = []

    def worker(k):
        try:
            outs = [pyxfer.verified_copy(s, "cuda:1", route="direct", verify=("sync", "deferred")[(i + k) % 2])
                    for i, s in enumerate(sources)]
            torch.cuda.synchronize(1)
            errors.extend((k, i) for i, (o, s) in enumerate(zip(outs, sources)) if not same(o, s))
            pyxfer.check_transfers()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# The copy-engine pipeline under schedules from measured rates (no PYXFER_PEER_RATES: the first large
# copy of each pair measures it), from given rates (shrink 2 with a full grid, the cap of 16), and
# under the knobs; faults are caught under each. The knobs are read once per process: a subprocess each.
@pytest.mark.multigpu
@pytest.mark.parametrize("knobs", [{}, {"PYXFER_PEER_RATES": "400,3000"}, {"PYXFER_PEER_RATES": "400,800"},
                                   {"PYXFER_PEER_RATES": "100,10000"}, {"PYXFER_PEER_HASH_GRID": "0.02"},
                                   {"PYXFER_PEER_HASH_GRID": "1", "PYXFER_PEER_CHUNKS": "2,1"},
                                   {"PYXFER_PEER_FUSED_MIB": "0", "PYXFER_PEER_CHUNKS": "3,0.5"}])
def test_pipelined_copies_under_every_schedule(knobs):
    code = """
import torch, pyxfer
from pyxfer.testing import inject_fault
for n in ((64 << 20) + 8, (300 << 20) + 7, 4099):
    for a, b in ((0, 1), (1, 0)):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{a}")
        for verify in ("sync", "deferred"):
            out = pyxfer.verified_copy(src, f"cuda:{b}", route="direct", verify=verify)
            assert torch.equal(out.cpu(), src.cpu()), (n, a, b, verify)
        pyxfer.check_transfers()
        for kind in ("bitflip", "skip_kernel"):
            with inject_fault(kind, path="direct"):
                pyxfer.verified_copy(src, f"cuda:{b}", route="direct", verify="deferred")
            try:
                pyxfer.check_transfers()
                raise SystemExit(f"missed {kind} {n} {a} {b}")
            except pyxfer.TransferError:
                pass
print("ok")
"""
    r = run_python(code, env=knobs)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr
