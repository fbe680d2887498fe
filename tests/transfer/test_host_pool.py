"""The host hashing pool (csrc/cpu/host_pool.h) and the SIMD PXH64 behind it (csrc/cpu/pxh64_host.h):
exact against the independent reference (tests/support/pxh64_reference.py) on fresh random data for every
instruction set this CPU runs, odd sizes, misaligned views and word offsets; concurrent callers; errors
of a task reach the caller; the knobs' bad values are refused; a process that used the pool exits
cleanly; the CPU <-> CPU verified copy that runs on it."""
import json
import os
import threading

import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.processes import run_python
from support.pxh64_reference import finalize, partial_np, pxh64_np
from support.tensors import logical_bytes, random_tensor

MiB = 1 << 20
# Across one item, the pool's threshold (two items) and several items, with odd tails.
SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 127, 129, 4099, MiB - 1, MiB + 3, 2 * MiB - 8, 2 * MiB + 3, 5 * MiB + 7]


@pytest.fixture(autouse=True)
def clean_state():
    pyxfer.health.reset()
    yield
    pyxfer.check_transfers()  # no test may leave a latched mismatch behind
    pyxfer.health.reset()


def info():
    return json.loads(torch.ops.pyxfer.host_hash_info())


def random_bytes(n, gen):
    return random_tensor((n,), torch.uint8, gen)


@pytest.mark.skipif(any(k in os.environ for k in ("PYXFER_HOST_HASH_THREADS", "PYXFER_HOST_HASH_ISA")),
                    reason="checks the defaults: a knob is set in this environment")
def test_info_names_the_threads_and_the_instruction_set():
    i = info()
    assert i["threads"] == max(1, min((os.cpu_count() or 1) // 2, 16))
    assert i["supported"][0] == "scalar" and set(i["supported"]) <= {"scalar", "avx2", "avx512"}
    assert i["isa"] == i["supported"][-1]  # the best this CPU runs
    assert i["item_bytes"] == MiB


def test_checksums_match_the_reference_on_odd_sizes_and_offsets(gen):
    base = random_bytes(max(SIZES) + 16, gen)
    for n in SIZES:
        for offset in (0, 1, 3, 7, 8):  # misaligned data: any byte address
            t = base[offset:offset + n]
            data = logical_bytes(t)
            assert pyxfer.checksum(t) == pxh64_np(data), (n, offset)
            seed = int(torch.randint(0, 2**62, (1,), generator=gen)) * 3 + 1
            assert pyxfer.checksum(t, seed=seed) == pxh64_np(data, seed), (n, offset)
            for word_offset in (0, 1, 5, (1 << 40) + 3):
                got = int(torch.ops.pyxfer.checksum_partial(t, word_offset, 0)) & ((1 << 64) - 1)
                assert got == partial_np(data, 0, word_offset), (n, offset, word_offset)


def test_partial_sums_of_large_chunks_compose(gen):
    n = 7 * MiB + 5
    data = random_bytes(n, gen)
    cut = 3 * MiB + 8  # on a word, inside an item
    first = int(torch.ops.pyxfer.checksum_partial(data[:cut], 0, 0))
    second = int(torch.ops.pyxfer.checksum_partial(data[cut:], cut // 8, 0))
    assert finalize((first + second) & ((1 << 64) - 1), n) == pyxfer.checksum(data) == pxh64_np(logical_bytes(data))


_ISA_CHECK = """
import json, os, torch, pyxfer
from support.pxh64_reference import partial_np, pxh64_np
info = json.loads(torch.ops.pyxfer.host_hash_info())
assert info["isa"] == os.environ["PYXFER_HOST_HASH_ISA"], info
assert info["threads"] == int(os.environ["PYXFER_HOST_HASH_THREADS"]), info
g = torch.Generator().manual_seed(int(os.environ["SEED"]))
base = torch.randint(0, 256, ((5 << 20) + 64,), dtype=torch.uint8, generator=g)
for n in (0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, (1 << 20) + 3, (2 << 20) + 3, (5 << 20) + 7):
    for offset in (0, 1, 5):
        t = base[offset:offset + n]
        data = t.numpy().tobytes()
        for seed in (0, 0x9E3779B97F4A7C15 - (1 << 64) + 12345):
            assert pyxfer.checksum(t, seed=seed % (1 << 64)) == pxh64_np(data, seed % (1 << 64)), (n, offset, seed)
        got = int(torch.ops.pyxfer.checksum_partial(t, 3, 0)) & ((1 << 64) - 1)
        assert got == partial_np(data, 0, 3), (n, offset)
out = pyxfer.verified_copy(base[3:], "cpu")
assert torch.equal(out, base[3:])
print("ok", info["isa"])
"""


@pytest.mark.parametrize("threads", ["0", "3"])
def test_every_instruction_set_this_cpu_runs_matches_the_reference(threads, gen):
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: support.*
    for isa in info()["supported"]:
        seed = str(int(torch.randint(0, 2**31, (1,), generator=gen)))
        env = {"PYXFER_HOST_HASH_ISA": isa, "PYXFER_HOST_HASH_THREADS": threads, "SEED": seed,
               "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
        r = run_python(_ISA_CHECK, env=env)
        assert r.returncode == 0 and r.stdout.split() == ["ok", isa], (isa, seed, r.stdout, r.stderr)


@pytest.mark.parametrize("name,value,message", [
    ("PYXFER_HOST_HASH_ISA", "sse9", "PYXFER_HOST_HASH_ISA must be 'auto', 'scalar', 'avx2' or 'avx512', got 'sse9'"),
    ("PYXFER_HOST_HASH_THREADS", "-1", "PYXFER_HOST_HASH_THREADS must be an integer in [0, 256]"),
    ("PYXFER_HOST_HASH_THREADS", "257", "PYXFER_HOST_HASH_THREADS must be an integer in [0, 256]"),
    ("PYXFER_HOST_HASH_THREADS", "4x", "PYXFER_HOST_HASH_THREADS must be an integer in [0, 256]"),
])
def test_bad_knob_values_are_refused_naming_the_variable(name, value, message):
    code = """
import torch, pyxfer
for call in (lambda: pyxfer.checksum(torch.ones(3 << 20, dtype=torch.uint8)), torch.ops.pyxfer.host_hash_info):
    try:
        call()
    except RuntimeError as e:
        print(str(e).splitlines()[0])
    else:
        print("accepted")
"""
    r = run_python(code, env={name: value})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(message in line for line in lines), lines


def test_an_instruction_set_this_cpu_lacks_is_refused():
    missing = [isa for isa in ("avx2", "avx512") if isa not in info()["supported"]]
    if not missing:
        pytest.skip("this CPU runs every instruction set pyxfer has")
    r = run_python("import torch, pyxfer; pyxfer.checksum(torch.ones(5))", env={"PYXFER_HOST_HASH_ISA": missing[0]})
    assert r.returncode != 0 and f"PYXFER_HOST_HASH_ISA is '{missing[0]}', which this CPU does not run" in r.stderr


def test_concurrent_callers_from_python_threads_get_their_own_results(gen):
    sources = [random_bytes(int(n), gen) for n in (3 * MiB + 5, 2 * MiB + 8, 4 * MiB + 1, 5 * MiB + 3, 1001, 7)]
    want = [pxh64_np(logical_bytes(t)) for t in sources]
    errors, barrier = [], threading.Barrier(len(sources))

    def caller(i):
        try:
            barrier.wait()
            for k in range(6):
                t = sources[(i + k) % len(sources)]
                if pyxfer.checksum(t) != want[(i + k) % len(sources)]:
                    errors.append(f"thread {i}: wrong checksum")
                out = pyxfer.verified_copy(t, "cpu", route="direct" if k % 2 else "staged")
                if not torch.equal(out, t):
                    errors.append(f"thread {i}: wrong copy")
                if torch.ops.pyxfer._host_pool_selftest(64, -1, 10) != 64:
                    errors.append(f"thread {i}: tasks lost")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_failing_task_raises_in_the_caller_and_the_pool_carries_on(gen):
    assert torch.ops.pyxfer._host_pool_selftest(0) == 0
    assert torch.ops.pyxfer._host_pool_selftest(1000, -1, 0) == 1000
    for fail_at in (0, 5, 999):
        with pytest.raises(RuntimeError, match=rf"pyxfer._host_pool_selftest: task {fail_at} failed, as asked"):
            torch.ops.pyxfer._host_pool_selftest(1000, fail_at, 20)
    errors = []

    def failing():  # several callers failing at once: each gets its own error, nobody hangs
        for _ in range(5):
            try:
                torch.ops.pyxfer._host_pool_selftest(200, 100, 20)
                errors.append("no error")
            except RuntimeError as e:
                if "task 100 failed" not in str(e):
                    errors.append(str(e))

    threads = [threading.Thread(target=failing) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    t = random_bytes(3 * MiB + 3, gen)
    assert pyxfer.checksum(t) == pxh64_np(logical_bytes(t))
    with pytest.raises(RuntimeError, match=r"_host_pool_selftest: num_tasks must be in \[0, 2\*\*20\], got -1"):
        torch.ops.pyxfer._host_pool_selftest(-1)
    with pytest.raises(RuntimeError, match=r"_host_pool_selftest: spin_us must be in \[0, 100000\], got -5"):
        torch.ops.pyxfer._host_pool_selftest(3, -1, -5)


def test_a_process_that_used_the_pool_exits_cleanly_every_time():
    # The pool's workers wait for work when the interpreter exits: a std::thread destroyed while joinable
    # would abort the process ("terminate called without an active exception"), a join could hang.
    # (No daemon thread inside an op at exit: torch aborts then with any op, pyxfer's or aten's.)
    code = """
import threading, torch, pyxfer
big = torch.randint(0, 256, ((6 << 20) + 3,), dtype=torch.uint8)
def use():
    for _ in range(3):
        pyxfer.checksum(big)
        pyxfer.verified_copy(big, "cpu")
        torch.ops.pyxfer._host_pool_selftest(64, -1, 100)
threads = [threading.Thread(target=use) for _ in range(3)]
for t in threads:
    t.start()
use()
for t in threads:
    t.join()
print("done")
"""
    for threads in ("0", "1", "4"):
        for _ in range(3):
            r = run_python(code, env={"PYXFER_HOST_HASH_THREADS": threads}, timeout=120)
            assert r.returncode == 0 and r.stdout.split() == ["done"], (threads, r.returncode, r.stderr[-2000:])
            assert "terminate" not in r.stderr, r.stderr[-2000:]




@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_workers_are_made_once_and_kept():
    code = """
import torch, pyxfer
from support.processes import pool_workers
big = torch.randint(0, 256, ((6 << 20) + 3,), dtype=torch.uint8)
before = pool_workers()  # none before the first use
for _ in range(20):
    pyxfer.checksum(big)
print(before, pool_workers())
"""
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: support.*
    for threads in ("0", "3"):
        r = run_python(code, env={"PYXFER_HOST_HASH_THREADS": threads, "PYTHONPATH": tests_dir})
        assert r.returncode == 0 and r.stdout.split() == ["0", threads], (r.stdout, r.stderr[-2000:])


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"),
                    reason="needs os.fork and /proc (Linux)")
def test_a_forked_child_gets_a_pool_of_its_own(gen):
    # the child inherits none of the parent's worker threads: it makes its own at its first use
    code = """
import os, torch, pyxfer
from support.processes import pool_workers
big = torch.randint(0, 256, ((6 << 20) + 3,), dtype=torch.uint8)
want = pyxfer.checksum(big)  # the parent's workers exist now
pid = os.fork()
if pid == 0:
    ok = pool_workers() == 0
    ok = ok and pyxfer.checksum(big) == want and torch.ops.pyxfer._host_pool_selftest(500, -1, 10) == 500
    os._exit(0 if ok and pool_workers() == 2 else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), pyxfer.checksum(big) == want, pool_workers())
"""
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: support.*
    r = run_python(code, env={"PYXFER_HOST_HASH_THREADS": "2", "PYTHONPATH": tests_dir}, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["0", "True", "2"], (r.stdout, r.stderr[-2000:])


# ---- the CPU <-> CPU verified copy on the pool --------------------------------------------------

def test_pin_memory_must_be_a_bool_and_cpu_to_cpu_results_stay_pageable(gen):
    src = random_bytes(4099, gen)
    for bad in (1, 0, "yes", None, torch.tensor(True)):
        with pytest.raises(TypeError, match=r"^pyxfer.verified_copy: pin_memory must be a bool, got "):
            pyxfer.verified_copy(src, "cpu", pin_memory=bad)
    for pin_memory in (True, False):  # for copies from a GPU only: a CPU -> CPU result is pageable
        out = pyxfer.verified_copy(src, "cpu", pin_memory=pin_memory)
        assert torch.equal(out, src) and not out.is_pinned()
        out = torch.ops.pyxfer.verified_copy(src, torch.device("cpu"), "direct", "sync", pin_memory)
        assert torch.equal(out, src) and not out.is_pinned()
        torch.library.opcheck(torch.ops.pyxfer.verified_copy.default,
                              (src, torch.device("cpu"), "auto", "sync", pin_memory))


@pytest.mark.parametrize("route", ["direct", "staged"])
def test_cpu_copies_of_every_size_are_exact_and_hashed_right(route, gen):
    base = random_bytes(5 * MiB + 16, gen)
    for n in SIZES:
        src = base[3:3 + n]  # misaligned
        for verify in ("sync", "deferred", "none"):
            out = pyxfer.verified_copy(src, "cpu", route=route, verify=verify)
            assert out.is_contiguous() and logical_bytes(out) == logical_bytes(src), (n, verify)
    pyxfer.check_transfers()


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_faults_on_large_cpu_copies_are_reported_with_both_hashes(kind, gen):
    # Several pool items: the faulty item is hashed by whichever thread ran it; the destination hash
    # reported is that of what the faulty copy wrote (zeros: known exactly).
    n = 3 * MiB + 5
    src = random_bytes(n, gen)
    src[src == 0] = 1  # no zero byte: a "zeros" fault never leaves the source's bytes
    with inject_fault(kind, path="direct"), inject_fault("zeros", path="staged"):
        with pytest.raises(pyxfer.TransferError) as info:
            pyxfer.verified_copy(src, "cpu", route="direct")
    e = info.value
    assert e.src_hash == pxh64_np(logical_bytes(src)) and e.dst_hash != e.src_hash
    assert e.retry_dst_hash == pxh64_np(bytes(n))
    if kind == "zeros":
        assert e.dst_hash == pxh64_np(bytes(n))
