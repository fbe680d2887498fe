"""pyxfer.device_guard / on_device_of on real GPUs: the current device and stream inside the guard,
lazily allocated state, a Triton kernel launched with tensors and with raw pointers (the way C++
extensions pass them). Triton launches run in subprocesses: an illegal address is a sticky error
that poisons the CUDA context, and @triton.jit needs its source in a real file.

Two GPUs: with the current device 0 and the data on cuda:1, the raw-pointer launch goes wrong
without the guard and is correct with it (TE #3124's class of bug). How it goes wrong depends on the
machine: an illegal memory access, or (two H100s of one host, driver 580, run P) no error at all and a
destination never written. Peer access is never enabled in these children.
"""
import os
import subprocess
import sys
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
