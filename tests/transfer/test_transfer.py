"""Verified transfers on the CPU: the whole protocol (faults, repair, routing, deferred errors,
autograd, thread safety) runs here through CPU -> CPU copies; conjugate / negative views, faults that
always write wrong bytes, the deferred-error record of several pairs, staged_copy differentiable like
verified_copy."""
import re
import threading

import numpy as np
import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.processes import run_python
from support.pxh64_reference import M1, K, _mix_np, mix
from support.tensors import ALL_DTYPES, conj_views, layouts, logical_bytes, random_tensor

# health reset around each test; no latched deferred mismatch left behind (conftest.py)
pytestmark = pytest.mark.usefixtures("clean_transfers")


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and logical_bytes(a) == logical_bytes(b)


def one_bit_flip_hashes(data: bytes, seed: int = 0) -> set:
    """PXH64 (by the reference) of ``data`` with one of its bits flipped, for every bit: what a
    "bitflip" fault's destination can hash to. Only the flipped word's term changes."""
    words = np.frombuffer(data + b"\0" * (-len(data) % 8), dtype="<u8")
    with np.errstate(over="ignore"):
        keys = np.uint64(seed) + np.arange(1, words.size + 1, dtype=np.uint64) * np.uint64(K)
        terms = _mix_np(words ^ keys)
        pos = np.arange(8 * len(data), dtype=np.uint64)  # byte i bit b is bit 8 * i + b of the stream
        j, bit = (pos >> np.uint64(6)).astype(np.int64), pos & np.uint64(63)
        acc = terms.sum(dtype=np.uint64) - terms[j] + _mix_np((words[j] ^ (np.uint64(1) << bit)) ^ keys[j])
        final = _mix_np(acc ^ np.uint64(mix(len(data) ^ seed ^ M1)))
    return set(final.tolist())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_layout_route_and_mode(dtype, gen):
    for name, t in layouts(dtype, gen):
        for route in ("direct", "staged", "auto"):
            for verify in ("sync", "deferred", "none"):
                out = pyxfer.verified_copy(t, "cpu", route=route, verify=verify)
                assert out.is_contiguous() and same_bits(out, t), (name, route, verify)
                assert out.data_ptr() != t.data_ptr() or t.numel() == 0
    pyxfer.check_transfers()  # nothing latched


def test_successful_direct_copy_marks_the_pair_healthy(gen):
    assert pyxfer.health.status("cpu", "cpu") == "unknown"
    pyxfer.verified_copy(random_tensor((100,), torch.float32, gen), "cpu")
    assert pyxfer.health.status("cpu", "cpu") == "healthy"


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("numel", [1, 7, 4099, (1 << 20) + 3])
def test_direct_fault_is_detected_repaired_and_rerouted(kind, numel, gen):
    # "stale" / "truncate" leave destination bytes as they were; for a 1-byte copy those may equal
    # the source by chance (1 in 256), and then nothing wrong was written: try fresh data again.
    for _ in range(4):
        src = random_tensor((numel,), torch.uint8, gen)
        with inject_fault(kind, path="direct") as fault:
            out = pyxfer.verified_copy(src, "cpu")
        assert fault.used == 1  # the direct copy really was hit ...
        assert same_bits(out, src)  # ... and the result has the right bits either way
        if pyxfer.health.status("cpu", "cpu") == "corrupt":
            break
        pyxfer.health.reset()
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"  # detected and repaired through the staged path
    with inject_fault(kind, path="direct") as fault:  # the next copy of this pair routes staged
        out = pyxfer.verified_copy(src, "cpu")
    assert fault.used == 0 and same_bits(out, src)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_fault_without_verification_really_writes_wrong_bytes(kind, gen):
    src = random_tensor((4099,), torch.uint8, gen)
    with inject_fault(kind, path="direct") as fault:
        out = pyxfer.verified_copy(src, "cpu", route="direct", verify="none")
    assert fault.used == 1
    # stale leaves whatever the fresh allocation held: that too must differ from fresh random data
    assert not same_bits(out, src)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_faults_on_both_paths_raise_and_return_nothing(kind, gen):
    src = random_tensor((3, 1001), torch.float16, gen)
    with inject_fault(kind, path="direct"), inject_fault("bitflip", path="staged"):
        with pytest.raises(pyxfer.TransferError, match=r"copy cpu -> cpu of 6006 bytes failed verification") as info:
            pyxfer.verified_copy(src, "cpu")
    e = info.value
    assert isinstance(e, RuntimeError)
    assert (e.src, e.dst, e.num_bytes, e.route, e.attempt) == ("cpu", "cpu", 6006, "direct", 2)
    assert e.src_hash == pyxfer.checksum(src)
    assert e.retry_dst_hash in one_bit_flip_hashes(logical_bytes(src))  # the staged retry: one bit flipped
    if kind == "zeros":
        assert e.dst_hash == pyxfer.checksum(torch.zeros(3, 1001, dtype=torch.float16))
    elif kind == "bitflip":
        assert e.dst_hash in one_bit_flip_hashes(logical_bytes(src))
    else:  # stale / truncate / shift keep bytes of the fresh destination allocation: unknowable here
        assert e.dst_hash != e.src_hash


@pytest.mark.parametrize("route", ["auto", "staged"])
def test_sync_error_carries_the_structured_record(route, gen):
    # zeros on both paths: both destinations are known exactly (all zero bytes)
    src = random_tensor((3, 1001), torch.float16, gen)[:, 5:].t()  # non-contiguous: 2988 elements
    zeros = pyxfer.checksum(torch.zeros(src.shape, dtype=src.dtype))
    first = "direct" if route == "auto" else "staged"
    with inject_fault("zeros", path=first, times=2), inject_fault("zeros", path="staged", times=2):
        with pytest.raises(pyxfer.TransferError) as info:
            pyxfer.verified_copy(src, "cpu", route=route)
    e = info.value
    assert (e.src, e.dst, e.num_bytes, e.route, e.attempt) == ("cpu", "cpu", 5976, first, 2)
    assert (e.src_hash, e.dst_hash, e.retry_dst_hash) == (pyxfer.checksum(src), zeros, zeros)
    assert str(e) == (f"copy cpu -> cpu of 5976 bytes failed verification on the {first} path and again on the "
                      f"staged path: source PXH64 {e.src_hash:#x}, destination PXH64 {zeros:#x} (first try), "
                      f"{zeros:#x} (staged retry)")
    assert torch.ops.pyxfer.take_sync_transfer_error() == []  # the wrapper took this thread's record


def test_sync_error_record_through_the_raw_op(gen):
    src = random_tensor((4099,), torch.uint8, gen)
    with inject_fault("bitflip", path="direct"), inject_fault("zeros", path="staged"):
        with pytest.raises(RuntimeError, match=r"^pyxfer.TransferError: copy cpu -> cpu of 4099 bytes"):
            torch.ops.pyxfer.verified_copy(src, torch.device("cpu"), "direct", "sync")
    record = torch.ops.pyxfer.take_sync_transfer_error()
    mask = (1 << 64) - 1
    count, s, d, n, src_hash, dst_hash, route, attempt, retry_hash = record
    assert (count, s, d, n, route, attempt) == (1, -1, -1, 4099, 1, 2)  # route code 1: direct
    assert src_hash & mask == pyxfer.checksum(src)
    assert dst_hash & mask in one_bit_flip_hashes(logical_bytes(src))
    assert retry_hash & mask == pyxfer.checksum(torch.zeros(4099, dtype=torch.uint8))
    assert torch.ops.pyxfer.take_sync_transfer_error() == []  # taking clears it


def test_sync_error_records_are_per_thread(gen):
    sizes = [1001, 2003, 4099, 8191]
    sources = [random_tensor((n,), torch.uint8, gen) for n in sizes]
    results, barrier = {}, threading.Barrier(len(sizes))

    def copier(i):
        barrier.wait()
        try:
            pyxfer.verified_copy(sources[i], "cpu", route="direct")
            results[i] = None
        except pyxfer.TransferError as e:
            results[i] = e

    threads = [threading.Thread(target=copier, args=(i,)) for i in range(len(sizes))]
    with inject_fault("zeros", path="direct", times=len(sizes), process_wide=True), \
            inject_fault("zeros", path="staged", times=len(sizes), process_wide=True):  # the threads' copies
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, n in enumerate(sizes):  # each thread got its own copy's record, not another's
        e = results[i]
        assert isinstance(e, pyxfer.TransferError), (i, e)
        assert (e.num_bytes, e.src_hash, e.route, e.attempt) == (n, pyxfer.checksum(sources[i]), "direct", 2)
        assert e.dst_hash == e.retry_dst_hash == pyxfer.checksum(torch.zeros(n, dtype=torch.uint8))


def test_staged_route_faults_retry_staged_once(gen):
    src = random_tensor((777,), torch.int32, gen)
    with inject_fault("zeros", path="staged", times=1) as fault:  # a transient staged fault
        out = pyxfer.verified_copy(src, "cpu", route="staged")
    assert fault.used == 1 and same_bits(out, src)


def test_deferred_mode_latches_and_check_transfers_raises(gen):
    src = random_tensor((5000,), torch.uint8, gen)
    good = random_tensor((64,), torch.uint8, gen)
    pyxfer.verified_copy(good, "cpu", verify="deferred")
    with inject_fault("bitflip", path="direct", times=2):
        pyxfer.verified_copy(src, "cpu", route="direct", verify="deferred")  # returns without raising
        pyxfer.verified_copy(src, "cpu", route="direct", verify="deferred")
    with pytest.raises(pyxfer.TransferError, match=r"2 deferred verified copies failed verification; the first: "
                                                  r"copy cpu -> cpu of 5000 bytes") as info:
        pyxfer.check_transfers()
    assert info.value.src_hash == pyxfer.checksum(src) and info.value.num_bytes == 5000
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"
    pyxfer.check_transfers()  # the latch was cleared


def test_deferred_error_carries_the_same_record_fields(gen):
    src = random_tensor((7, 333), torch.int16, gen)[:, 1:]  # a view at an offset: 7 * 332 * 2 bytes
    with inject_fault("zeros", path="staged"):
        out = pyxfer.verified_copy(src, "cpu", route="staged", verify="deferred")
    assert not same_bits(out, src)  # returned unrepaired: deferred copies are checked later
    with pytest.raises(pyxfer.TransferError, match=r"^1 deferred verified copy failed verification") as info:
        pyxfer.check_transfers()
    e = info.value
    assert (e.src, e.dst, e.num_bytes, e.attempt, e.route, e.retry_dst_hash) == ("cpu", "cpu", 4648, 1, None, None)
    assert (e.src_hash, e.dst_hash) == (pyxfer.checksum(src), pyxfer.checksum(torch.zeros(7, 332, dtype=torch.int16)))


def test_zero_element_tensors(gen):
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        t = torch.empty(shape, dtype=torch.bfloat16)
        with inject_fault("zeros", path="direct") as fault:
            out = pyxfer.verified_copy(t, "cpu")
        assert out.shape == t.shape and out.dtype == t.dtype and fault.used == 0
    assert pyxfer.staged_copy(torch.empty(0), "cpu").shape == (0,)


def test_staged_copy_through_a_small_pool(gen):
    try:
        pyxfer.configure_staging(4096, 2)
        for numel in (0, 1, 4095, 4096, 4097, 3 * 4096 + 11, (1 << 20) + 3):
            src = random_tensor((numel,), torch.uint8, gen)
            assert same_bits(pyxfer.staged_copy(src, "cpu"), src)
            assert same_bits(pyxfer.verified_copy(src, "cpu", route="staged"), src)
        src = random_tensor((40, 33), torch.complex64, gen).t()
        assert same_bits(pyxfer.staged_copy(src, "cpu"), src)
    finally:
        pyxfer.configure_staging()


def test_autograd_moves_the_gradient_back(gen):
    x = torch.randn(17, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, 5, dtype=torch.float64)
    y = pyxfer.verified_copy(x.t(), "cpu")
    assert y.requires_grad
    (y * w.t()).sum().backward()
    assert torch.equal(x.grad, w)
    torch.autograd.gradcheck(lambda a: pyxfer.verified_copy(a, "cpu") * 3, (torch.randn(4, 3, dtype=torch.float64,
                                                                                       requires_grad=True),))


def test_opcheck_and_compile(gen):
    for _name, t in layouts(torch.int32, gen):  # integer data: opcheck compares values (NaN != NaN)
        torch.library.opcheck(torch.ops.pyxfer.verified_copy.default, (t, torch.device("cpu"), "auto", "sync"))
        torch.library.opcheck(torch.ops.pyxfer.staged_copy.default, (t, torch.device("cpu")))
    f = torch.compile(lambda a: torch.ops.pyxfer.verified_copy(a * 2, torch.device("cpu"), "direct", "sync") + 1,
                      fullgraph=True)
    a = torch.randn(33)
    assert torch.equal(f(a), a * 2 + 1)


def test_health_registry_is_thread_safe_under_concurrent_copies(gen):
    sources = [random_tensor((int(n),), torch.uint8, gen) for n in torch.randint(1, 200_000, (16,), generator=gen)]
    errors, stop = [], threading.Event()

    def copier(i):
        try:
            for k in range(40):
                src = sources[(i + k) % len(sources)]
                out = pyxfer.verified_copy(src, "cpu", route="auto")
                if not same_bits(out, src):
                    errors.append(f"wrong bits in thread {i}")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    def flipper():
        while not stop.is_set():
            pyxfer.health.mark("cpu", "cpu", "corrupt")
            pyxfer.health.mark("cpu", "cpu", "healthy")
            pyxfer.health.reset()

    threads = [threading.Thread(target=copier, args=(i,)) for i in range(6)] + [threading.Thread(target=flipper)]
    # armed before any copy can finish, for the copier threads' copies
    with inject_fault("bitflip", path="direct", times=25, process_wide=True) as fault:
        for t in threads:
            t.start()
        for t in threads[:-1]:
            t.join()
    stop.set()
    threads[-1].join()
    assert errors == []
    assert fault.used >= 1  # some copies were corrupted and repaired while the registry churned


def test_bad_input_is_rejected_before_any_work(gen):
    t = torch.arange(8.0)
    with pytest.raises(ValueError, match=r"pyxfer.verified_copy: src must be a dense strided tensor, got layout"):
        pyxfer.verified_copy(t.to_sparse(), "cpu")
    with pytest.raises(ValueError, match=r"pyxfer.verified_copy: src is on the meta device"):
        pyxfer.verified_copy(torch.empty(3, device="meta"), "cpu")
    with pytest.raises(ValueError, match=r"nested"):
        pyxfer.verified_copy(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "cpu")
    with pytest.raises(ValueError, match=r"pyxfer.verified_copy: route must be one of"):
        pyxfer.verified_copy(t, "cpu", route="teleport")
    with pytest.raises(ValueError, match=r"pyxfer.verified_copy: verify must be one of"):
        pyxfer.verified_copy(t, "cpu", verify="maybe")
    with pytest.raises(ValueError, match=r"pyxfer.verified_copy: device must be a CPU or CUDA device, got meta"):
        pyxfer.verified_copy(t, "meta")
    with pytest.raises(TypeError, match=r"pyxfer.verified_copy: device must be a torch.device"):
        pyxfer.verified_copy(t, 1.5)
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"pyxfer.verified_copy: device is cuda:{n + 3}, which does not exist"):
        pyxfer.verified_copy(t, f"cuda:{n + 3}")
    with pytest.raises(RuntimeError, match=r"route must be 'auto', 'direct' or 'staged', got 'x'"):
        torch.ops.pyxfer.verified_copy(t, torch.device("cpu"), "x", "sync")
    with pytest.raises(ValueError, match=r"inject_fault: kind must be one of"):
        with inject_fault("gremlins"):
            pass
    with pytest.raises(ValueError, match=r"inject_fault: path must be"):
        with inject_fault("zeros", path="carrier-pigeon"):
            pass
    with pytest.raises(ValueError, match=r"inject_fault: times must be an int >= 1"):
        with inject_fault("zeros", times=0):
            pass
    with pytest.raises(RuntimeError, match=r"configure_staging: chunk_bytes must be a positive multiple of 4096"):
        pyxfer.configure_staging(1000, 4)
    with pytest.raises(RuntimeError, match=r"configure_staging: num_slots must be in \[2, 64\]"):
        pyxfer.configure_staging(4096, 1)
    with pytest.raises(ValueError, match=r"pyxfer.health.mark: state must be one of"):
        pyxfer.health.mark("cpu", "cpu", "fine")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA devices")
def test_cuda_destination_without_cuda_is_a_clear_error():
    # the wrapper checks the index against the devices torch sees; the raw op, against the build
    why = "0 CUDA devices visible" if torch.backends.cuda.is_built() else "torch was built without CUDA"
    msg = f"device is cuda:0, which does not exist ({why}); expected 'cpu' or a CUDA device of this process"
    with pytest.raises(ValueError, match="^" + re.escape("pyxfer.verified_copy: " + msg) + "$"):
        pyxfer.verified_copy(torch.ones(3), "cuda:0")
    native = (r"device is cuda:0, which does not exist \(0 CUDA devices visible\)" if pyxfer.build_info()["cuda"]
              else r"device is cuda:0 but pyxfer was built without CUDA \(pyxfer.build_info\(\)\['cuda'\] is False\)")
    with pytest.raises(RuntimeError, match=r"pyxfer.verified_copy: " + native):
        torch.ops.pyxfer.verified_copy(torch.ones(3), torch.device("cuda", 0), "auto", "sync")


def test_environment_sets_the_default_route_and_a_fault():
    code = """
import torch, pyxfer
src = torch.arange(1000, dtype=torch.int64)
out = pyxfer.verified_copy(src, "cpu")   # PYXFER_INJECT_FAULT corrupts the direct copy, repaired
assert torch.equal(out, src)
print(pyxfer.health.status("cpu", "cpu"), pyxfer.transfer.default_route())
"""
    r = run_python(code, env={"PYXFER_INJECT_FAULT": "shift,src=cpu,dst=cpu,times=1", "PYXFER_ROUTE": "direct"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["corrupt", "direct"]
    r = run_python("import pyxfer, torch; pyxfer.verified_copy(torch.ones(2), 'cpu')", env={"PYXFER_ROUTE": "warp"})
    assert r.returncode != 0 and "PYXFER_ROUTE must be one of" in r.stderr


# ---- regressions of the transfer review (issue 28), staged_copy's autograd (issue 22) ------------

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
