"""pyxfer.device_guard / on_device_of on real GPUs: the current device and stream inside the guard,
lazily allocated state, a Triton kernel launched with tensors and with raw pointers (the way C++
extensions pass them). Triton launches run in subprocesses: an illegal address is a sticky error
that poisons the CUDA context, and @triton.jit needs its source in a real file.

Two GPUs: with the current device 0 and the data on cuda:1, the raw-pointer launch goes wrong
without the guard and is correct with it (TE #3124's class of bug). How it goes wrong depends on the
machine: an illegal memory access, or (two H100s of one host, driver 580, run P) no error at all and a
destination never written. Peer access is never enabled in these children. One guard object nested
in itself or shared by two threads restores each level's and each thread's device; devices that do
not exist are pyxfer's ValueError.
"""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import pyxfer

CHILD = r'''
import sys
import torch
import triton
import triton.language as tl
import pyxfer

@triton.jit
def add_one_ptr(xa, ya, n, BLOCK: tl.constexpr):
    x = xa.to(tl.pointer_type(tl.float32))
    y = ya.to(tl.pointer_type(tl.float32))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) + 1.0, mask=mask)

@triton.jit
def add_one(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) + 1.0, mask=mask)

def launch_raw(x, y):  # like a C++ extension: plain pointers, the current device's stream
    add_one_ptr[(triton.cdiv(x.numel(), 1024),)](x.data_ptr(), y.data_ptr(), x.numel(), BLOCK=1024)

@pyxfer.on_device_of("x")
def launch_raw_guarded(x, y):
    launch_raw(x, y)

@pyxfer.on_device_of
def launch_tensors_guarded(x, y):
    add_one[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)

mode, device = sys.argv[1], sys.argv[2]
torch.cuda.set_device(0)
n = (1 << 22) + 5  # odd size: a partial last block
x = torch.randn(n, device=device)[1:]  # a storage offset
y = torch.full_like(x, float("nan"))   # sentinel
if mode == "plain":
    launch_raw(x, y)
elif mode == "guard":
    with pyxfer.device_guard(x):
        assert torch.cuda.current_device() == x.device.index
        launch_raw(x, y)
    assert torch.cuda.current_device() == 0
elif mode == "decorated":
    launch_raw_guarded(x, y)
elif mode == "tensors":
    launch_tensors_guarded(x, y)
else:
    raise SystemExit(f"unknown mode {mode}")
torch.cuda.synchronize(x.device)
got, want = y.cpu(), x.cpu() + 1
right, sentinel = int((got == want).sum()), int(got.isnan().sum())
print("OK" if right == n - 1 else f"WRONG: {right} of {n - 1} elements right, {sentinel} still the sentinel")
'''


def run_child(tmp_path, mode, device):
    pytest.importorskip("triton", reason="the Triton launch tests need triton")
    f = tmp_path / "child.py"
    f.write_text(CHILD)
    # A script's directory (not the working directory) leads sys.path: point it at this pyxfer.
    root = str(Path(pyxfer.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, str(f), mode, device], capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.fixture(autouse=True)
def current_device_zero():
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "guard", "decorated", "tensors"])
def test_triton_launches_on_cuda0(tmp_path, mode):
    r = run_child(tmp_path, mode, "cuda:0")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.gpu
def test_guard_sets_device_stream_and_lazy_allocations(gen):
    x = torch.randn(7, 3, generator=gen).to("cuda:0")
    side = torch.cuda.Stream(device="cuda:0")
    with torch.cuda.stream(side):
        with pyxfer.device_guard(x) as d:
            assert d == torch.device("cuda:0") and torch.cuda.current_device() == 0
            assert torch.cuda.current_stream() == side  # the device's current stream is the one used
            assert torch.empty(1, device="cuda").device == x.device
    with pytest.raises(KeyError):
        with pyxfer.device_guard(torch.nn.Linear(2, 2).to("cuda:0"), "cuda:0", 0):
            raise KeyError("inside")
    assert torch.cuda.current_device() == 0


@pytest.mark.multigpu
def test_raw_pointer_launch_on_another_device_goes_wrong_without_the_guard(tmp_path):
    r = run_child(tmp_path, "plain", "cuda:1")
    out = r.stdout + r.stderr
    print(out[-400:])  # which way it went on this machine, for the run's log
    crashed = r.returncode != 0 and "illegal memory access" in out
    wrong = r.returncode == 0 and "WRONG:" in r.stdout
    assert crashed or wrong, out


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["guard", "decorated", "tensors"])
def test_guarded_launch_on_another_device_is_correct(tmp_path, mode):
    r = run_child(tmp_path, mode, "cuda:1")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.multigpu
def test_guard_switches_and_restores_across_devices(gen):
    x1 = torch.randn(5, generator=gen).to("cuda:1")
    with pyxfer.device_guard(x1):
        assert torch.cuda.current_device() == 1
        with pyxfer.device_guard({"a": [torch.device("cuda:0")]}):
            assert torch.cuda.current_device() == 0
            assert torch.empty(1, device="cuda").device == torch.device("cuda:0")
        assert torch.cuda.current_device() == 1
        assert torch.empty(1, device="cuda").device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    with pytest.raises(ValueError, match="span 2 devices"):
        pyxfer.device_guard(x1, torch.zeros(1, device="cuda:0"))
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_devices_that_do_not_exist_are_value_errors_and_cuda_is_the_current_one(gen):
    n = torch.cuda.device_count()
    x = torch.randn(3, generator=gen).to("cuda:0")
    for args in [(f"cuda:{n}",), (x, torch.device("cuda", n)), (n,), ({"out": [f"cuda:{n}"]},)]:
        with pytest.raises(ValueError, match=f"pyxfer.device_guard: argument .* is cuda:{n}, which does not exist"):
            pyxfer.device_guard(*args)
    assert torch.cuda.current_device() == 0
    with pyxfer.device_guard("cuda", {"x": x, "block": 1024, "shape": x.shape}) as d:  # ints inside: no devices
        assert d == torch.device("cuda:0")


@pytest.mark.gpu
def test_one_guard_nested_in_itself_on_one_gpu(gen):
    x = torch.randn(3, generator=gen).to("cuda:0")
    g = pyxfer.device_guard(x)
    with g, g:
        assert torch.cuda.current_device() == 0
    with pytest.raises(KeyError):
        with g:
            with g:
                raise KeyError("inside")
    assert torch.cuda.current_device() == 0 and not g._saved


@pytest.mark.multigpu
def test_one_guard_nested_in_itself_restores_each_level(gen):
    x1 = torch.randn(5, generator=gen).to("cuda:1")
    for args in ((1,), ({"x": x1, "block": 0},)):  # a top-level int is a CUDA index; one inside a structure is not
        g = pyxfer.device_guard(*args)
        with g as d:
            assert d == torch.device("cuda:1") and torch.cuda.current_device() == 1
            with g:
                assert torch.empty(1, device="cuda").device == x1.device
            assert torch.cuda.current_device() == 1
            with pyxfer.device_guard(torch.device("cuda:0")):
                with g:
                    assert torch.cuda.current_device() == 1
                assert torch.cuda.current_device() == 0
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 0
        assert torch.empty(1, device="cuda").device == torch.device("cuda:0")
        with pytest.raises(KeyError):
            with g:
                with g:
                    raise KeyError("inside")
        assert torch.cuda.current_device() == 0 and not g._saved


@pytest.mark.multigpu
def test_one_guard_shared_by_threads_restores_each_threads_device(gen):
    x0 = torch.randn(5, generator=gen).to("cuda:0")
    torch.zeros(1, device="cuda:1")  # a context on both devices (what restoring to one needs)
    g = pyxfer.device_guard(x0)
    steps = [threading.Event() for _ in range(3)]
    seen = {}

    def worker(name, start, wait_before_enter, set_after_enter, wait_before_exit, set_after_exit):
        try:
            torch.cuda.set_device(start)
            if wait_before_enter is not None:
                assert steps[wait_before_enter].wait(60)
            with g:
                seen[name, "inside"] = torch.cuda.current_device()
                steps[set_after_enter].set()
                if wait_before_exit is not None:
                    assert steps[wait_before_exit].wait(60)
            seen[name, "after"] = torch.cuda.current_device()
            seen[name, "lands on"] = torch.empty(1, device="cuda").device.index
            if set_after_exit is not None:
                steps[set_after_exit].set()
        except BaseException as e:  # reported by the main thread
            seen[name, "error"] = e
            for s in steps:
                s.set()

    # A enters (from cuda:1), then B enters (from cuda:0), then A leaves, then B leaves.
    a = threading.Thread(target=worker, args=("A", 1, None, 0, 1, 2))
    b = threading.Thread(target=worker, args=("B", 0, 0, 1, 2, None))
    a.start()
    b.start()
    a.join(120)
    b.join(120)
    assert seen == {("A", "inside"): 0, ("B", "inside"): 0, ("A", "after"): 1, ("A", "lands on"): 1,
                    ("B", "after"): 0, ("B", "lands on"): 0}
    assert not g._saved and torch.cuda.current_device() == 0
