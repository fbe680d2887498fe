"""pyxfer.testing (fault injection): the exact bytes a gather fault writes, every kind (issue 40
item 5), a PYXFER_INJECT_FAULT that names a key twice (issue 39 item 17), and faults, health and
deferred errors across threads (issue 22 item 4).

The gather faults run in a real 2-rank gloo group (two processes): rank 1's shard, as rank 0
received it, must be exactly what the kind writes (the fault's rng seeded, so bitflip's bit and
shift's offset are known), on fresh random shards of odd sizes and on shards where the kind's bytes
equal what the region held (then one more bit is flipped: a fault is never a no-op)."""
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault, parse_env_fault

from support.processes import run_python
from support.tensors import logical_bytes, random_tensor

# health reset around each test; no latched deferred mismatch left behind (conftest.py)
pytestmark = pytest.mark.usefixtures("clean_transfers")

SPAWN_TIMEOUT_S = 240


def expected_fault_bytes(kind, held: bytes, seed: int):
    """What a ``kind`` fault seeded with ``seed`` leaves in a region that held ``held``, by the
    kinds' definitions (pyxfer.testing's docstring): (bytes, whether the always-wrong bit was
    needed). The rng draws, in order: bitflip the byte then the bit, shift its offset in [1, 8)."""
    rng, n = random.Random(seed), len(held)
    out = bytearray(held)
    if kind == "zeros":
        out = bytearray(n)
    elif kind == "bitflip":
        i = rng.randrange(n)
        out[i] ^= 1 << rng.randrange(8)
    elif kind == "stale":  # nothing arrives; a gather's receive buffer is marked 0xA5
        out = bytearray(b"\xa5" * n)
    elif kind == "truncate":  # the last eighth (at least one byte) never arrives: zeros
        m = max(1, n // 8)
        out[n - m:] = bytes(m)
    elif kind == "shift":  # lands k bytes late; the first k keep what they held; a 1-byte region is inverted
        k = min(n - 1, rng.randrange(1, 8))
        out = bytearray(held[:k] + held[:n - k]) if k else bytearray(b ^ 0xFF for b in held)
    else:
        raise AssertionError(kind)
    same = bytes(out) == held
    if same:
        out[0] ^= 1
    return bytes(out), same


def gather_cases(gen):
    """(name, kind, shard of rank 0, shard of rank 1, expects the always-wrong bit) per case."""
    cases = []
    for kind in FAULT_KINDS:
        for n in (1, 7, 1031):
            cases.append((f"{kind}-random-{n}", kind, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen),
                          torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen), None))
    n = 1031
    fresh = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    zero_tail = fresh.clone()
    zero_tail[n - n // 8:] = 0
    zero_tail[n - n // 8 - 1] = 1  # only the truncated eighth is zero
    fallbacks = {"zeros": torch.zeros(n, dtype=torch.uint8), "stale": torch.full((n,), 0xA5, dtype=torch.uint8),
                 "truncate": zero_tail, "shift": torch.full((n,), 0x37, dtype=torch.uint8)}
    # bitflip always changes a bit: it has no region where its bytes equal what the region held
    for kind, held in fallbacks.items():
        cases.append((f"{kind}-fallback-{n}", kind, fresh.clone(), held, True))
    return cases


WORKER = '''
import datetime, sys
import torch, torch.distributed as dist
import pyxfer
from pyxfer.testing import inject_fault

rank, init, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
job = torch.load(path + "/job.pt")
results = {}
for name, kind, shards, seed in job:
    x = shards[rank].clone()
    with inject_fault(kind, src=1, dst=0, path="gather", seed=seed) as fault:  # rank 1's shard, on rank 0
        out = pyxfer.all_gather(x)
    results[name] = (out, fault.used, torch.equal(x, shards[rank]))
torch.save(results, f"{path}/rank{rank}.pt")
dist.destroy_process_group()
'''


def run_gloo_pair(job):
    """Run WORKER on ranks 0 and 1 of a gloo group; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(job, os.path.join(tmp, "job.pt"))
        with open(os.path.join(tmp, "worker.py"), "w") as f:
            f.write(textwrap.dedent(WORKER))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, os.path.join(tmp, "worker.py"), str(r), f"file://{tmp}/init", tmp],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)
                 for r in range(2)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=SPAWN_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outputs.append(p.communicate()[0] + f"\n(killed after {SPAWN_TIMEOUT_S} s)")
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-3000:]}"
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


def test_a_gather_fault_writes_exactly_the_bytes_of_its_kind():
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    cases = gather_cases(gen)
    draw = random.Random(seed)
    fault_seeds = {name: draw.getrandbits(62) for name, *_ in cases}
    ranks = run_gloo_pair([(name, kind, (s0, s1), fault_seeds[name]) for name, kind, s0, s1, _ in cases])
    for name, kind, s0, s1, fallback in cases:
        n = s0.numel()
        want, fell_back = expected_fault_bytes(kind, s1.numpy().tobytes(), fault_seeds[name])
        if fallback is not None:  # the case really is one where the kind's bytes equal the region's
            assert fell_back, name
        what = f"{name} (seed {seed})"
        out0, used0, input_kept0 = ranks[0][name]
        out1, used1, input_kept1 = ranks[1][name]
        assert used0 == 1 and used1 == 0 and input_kept0 and input_kept1, what
        assert out0.dtype == torch.uint8 and out0.shape == (2 * n,), what
        assert torch.equal(out0[:n], s0), f"{what}: rank 0's own shard was touched"
        got = out0[n:].numpy().tobytes()
        if got != want:
            i = next(i for i in range(n) if got[i] != want[i])
            raise AssertionError(f"{what}: byte {i} of {n} is {got[i]:#04x} where the kind writes {want[i]:#04x}")
        assert torch.equal(out1, torch.cat([s0, s1])), f"{what}: rank 1 (not the fault's dst) was hit"


# ---- PYXFER_INJECT_FAULT naming a key twice ----------------------------------------------------

@pytest.mark.parametrize("spec,key,items", [
    ("zeros,times=2,times=3", "times", ("times=2", "times=3")),
    ("bitflip,dst=cpu,path=direct,dst=cuda:1", "dst", ("dst=cpu", "dst=cuda:1")),
    ("stale,path=gather,path=gather", "path", ("path=gather", "path=gather"))])  # even when they agree
def test_a_fault_variable_naming_a_key_twice_is_refused(spec, key, items):
    with pytest.raises(ValueError) as e:
        parse_env_fault(spec)
    assert str(e.value) == (f"PYXFER_INJECT_FAULT: {key}= is given twice ({items[0]!r}, {items[1]!r}); expected "
                            f"kind[,path=P][,src=D][,dst=D][,times=N] with kind one of {FAULT_KINDS} "
                            f"(e.g. 'bitflip,dst=cuda:1,times=3'), got {spec!r}")


def test_a_fault_variable_naming_a_key_twice_warns_at_import_and_arms_nothing():
    # as every malformed value: `import pyxfer` works, warns naming the variable, and no copy is hit
    code = ("import torch, pyxfer; src = torch.arange(1000); "
            "print(torch.equal(pyxfer.verified_copy(src, 'cpu', route='direct', verify='none'), src))")
    spec = "zeros,times=2,times=3"
    r = run_python(code, env={"PYXFER_INJECT_FAULT": spec})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"]
    assert re.search(r"RuntimeWarning: PYXFER_INJECT_FAULT: times= is given twice \('times=2', 'times=3'\); "
                     r"expected .*; no fault installed", r.stderr), r.stderr
    r = run_python(code, env={"PYXFER_INJECT_FAULT": "zeros,times=2"})  # the same without the repeat arms it
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr


# ---- across threads (issue 22 item 4) ------------------------------------------------------------

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
