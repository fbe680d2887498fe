"""Fault injection, health and deferred errors across threads (issue 22 item 4): a fault hits only
copies made by the thread that armed it, inside its ``with`` block, unless armed process-wide (the
explicit option, and PYXFER_INJECT_FAULT); health is per process (a pair is a physical link);
deferred mismatches are reported to the thread that made the copy."""
import threading

import pytest
import torch

import pyxfer
from pyxfer.testing import inject_fault

from conftest import run_python
from tensors import logical_bytes, random_tensor


@pytest.fixture(autouse=True)
def clean_state():
    pyxfer.health.reset()
    yield
    pyxfer.check_transfers()
    pyxfer.health.reset()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and logical_bytes(a) == logical_bytes(b)


def run_threads(*targets):
    """Run each target in its own thread; re-raise the first exception one of them raised."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_a_fault_hits_only_the_arming_threads_copies(gen):
    src = random_tensor((4099,), torch.uint8, gen)
    armed, copied = threading.Event(), threading.Event()
    results = {}

    def armer():
        with inject_fault("bitflip", path="direct", times=5) as fault:
            armed.set()
            copied.wait(30)  # the other thread copies while the fault is armed and unused
            results["mine"] = pyxfer.verified_copy(src, "cpu", route="direct", verify="none")
        results["used"] = fault.used

    def other():
        armed.wait(30)
        try:
            results["other"] = [pyxfer.verified_copy(src, "cpu", route=route, verify="none")
                                for route in ("direct", "staged", "auto")]
            results["other_verified"] = pyxfer.verified_copy(src, "cpu", route="direct")
        finally:
            copied.set()

    run_threads(armer, other)
    assert all(same_bits(out, src) for out in results["other"])
    assert same_bits(results["other_verified"], src)
    assert pyxfer.health.status("cpu", "cpu") == "healthy"  # the other thread's verified copy was clean
    assert not same_bits(results["mine"], src) and results["used"] == 1


def test_a_process_wide_fault_hits_every_thread(gen):
    src = random_tensor((4099,), torch.uint8, gen)
    outs = []
    with inject_fault("zeros", path="direct", times=2, process_wide=True) as fault:
        run_threads(*[lambda: outs.append(pyxfer.verified_copy(src, "cpu", route="direct", verify="none"))] * 2)
    assert fault.used == 2 and len(outs) == 2 and not any(same_bits(out, src) for out in outs)
    with pytest.raises(ValueError, match=r"inject_fault: process_wide must be True or False, got 'yes'"):
        with inject_fault("zeros", process_wide="yes"):
            pass


def test_the_fault_ends_with_its_with_block_in_its_thread(gen):
    src = random_tensor((777,), torch.uint8, gen)
    with inject_fault("zeros", path="direct", times=3) as fault:
        assert not same_bits(pyxfer.verified_copy(src, "cpu", route="direct", verify="none"), src)
    assert fault.used == 1 and fault.unused == 2
    assert same_bits(pyxfer.verified_copy(src, "cpu", route="direct", verify="none"), src)


def test_deferred_errors_go_to_the_thread_that_made_the_copy(gen):
    src = random_tensor((5000,), torch.uint8, gen)
    made, checked_elsewhere = threading.Event(), threading.Event()
    seen = {}

    def maker():
        with inject_fault("bitflip", path="direct"):
            pyxfer.verified_copy(src, "cpu", route="direct", verify="deferred")
        made.set()
        checked_elsewhere.wait(30)
        with pytest.raises(pyxfer.TransferError, match=r"^1 deferred verified copy failed verification") as info:
            pyxfer.check_transfers()
        seen["maker"] = info.value
        pyxfer.check_transfers()  # reported once

    def bystander():
        made.wait(30)
        try:
            pyxfer.check_transfers()  # not this thread's copy: nothing to raise
            seen["bystander"] = "clean"
        finally:
            checked_elsewhere.set()

    run_threads(maker, bystander)
    assert seen["bystander"] == "clean"
    assert seen["maker"].src_hash == pyxfer.checksum(src) and seen["maker"].num_bytes == 5000
    pyxfer.check_transfers()  # nor does the main thread see it


def test_health_is_per_process(gen):
    src = random_tensor((3001,), torch.uint8, gen)

    def detect():  # a verified copy in this thread catches its own fault and marks the pair corrupt
        with inject_fault("zeros", path="direct") as fault:
            assert same_bits(pyxfer.verified_copy(src, "cpu", route="direct"), src)
        assert fault.used == 1

    run_threads(detect)
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"  # seen by every thread
    seen = []
    run_threads(lambda: seen.append(pyxfer.health.status("cpu", "cpu")))
    assert seen == ["corrupt"]


def test_the_environment_variable_arms_a_process_wide_fault():
    code = """
import threading, torch, pyxfer
src = torch.arange(1000, dtype=torch.int64)
out = []
t = threading.Thread(target=lambda: out.append(pyxfer.verified_copy(src, "cpu", route="direct", verify="none")))
t.start(); t.join()
print(torch.equal(out[0], src))
"""
    r = run_python(code, env={"PYXFER_INJECT_FAULT": "zeros,path=direct,times=1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]  # a worker thread's copy was hit
