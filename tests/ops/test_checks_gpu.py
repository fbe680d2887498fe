"""Argument checks on one GPU (issue 22 items 3, 6, 7): the device check under
torch.compile(fullgraph=True) in a fresh process, 'cuda' without an index, a CUDA tensor global_amax."""
import math

import pytest
import torch

import pyxfer
import pyxfer.formats as F
from pyxfer.testing import inject_fault

from support.processes import run_fresh

pytestmark = pytest.mark.gpu


def test_verified_copy_to_cuda_compiles_with_fullgraph_in_a_fresh_process():
    """The first device check of a fresh process happens while Dynamo traces (the CUDA device count
    is folded to a constant, not traced); every spelling of the GPU gives the same graph result."""
    code = """
import torch, pyxfer
x = torch.randn(301, dtype=torch.float64)[1::3]
f = torch.compile(lambda t, dev: pyxfer.verified_copy(t * 2, dev) + 1, fullgraph=True)
want = (x * 2 + 1).cuda()
for dev in ("cuda", "cuda:0", torch.device("cuda", 0), 0):
    out = f(x, dev)
    assert out.device == torch.device("cuda", 0) and torch.equal(out, want), dev
back = torch.compile(lambda t: pyxfer.verified_copy(t, "cpu") * 3, fullgraph=True)(want)
assert back.device.type == "cpu" and torch.equal(back, (x * 2 + 1) * 3)
n = torch.cuda.device_count()
raises(lambda: f(x, f"cuda:{n}"), Exception,
       f"pyxfer.verified_copy: device is cuda:{n}, which does not exist ({n} CUDA devices visible)")
"""
    run_fresh(code)


def test_cuda_without_an_index_is_the_current_device(gen):
    src = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=gen)
    with torch.cuda.device(0):
        assert pyxfer.verified_copy(src, "cuda").device == torch.device("cuda", 0)
        out = pyxfer.staged_copy(src, "cuda")
        assert out.device == torch.device("cuda", 0) and torch.equal(out.cpu(), src)
        assert pyxfer.health.status("cpu", "cuda") == pyxfer.health.status("cpu", "cuda:0")
        with inject_fault("zeros", src="cpu", dst="cuda", path="staged") as fault:
            hit = pyxfer.staged_copy(src, "cuda:0")
        assert fault.used == 1 and not torch.equal(hit.cpu(), src)  # "cuda" armed the fault for cuda:0
        handle = pyxfer.pack([src]).reload("cuda")
        assert torch.equal(handle.result().unpack()[0].cpu(), src)


def test_cuda_tensor_global_amax_follows_the_one_rule(gen):
    x = torch.randn(64, 96, generator=gen)
    want = F.quantize(x, "nvfp4", columnwise=True, global_amax=5.5)
    got = F.quantize(x.cuda(), "nvfp4", columnwise=True, global_amax=torch.tensor(5.5, device="cuda"))
    for name, t in want.buffers().items():
        assert torch.equal(getattr(got, name).cpu(), t), name
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match=r"pyxfer.formats.quantize: global_amax must be None or a finite float32 "
                                             r"value >= 0 or a 1-element floating-point tensor holding one, got a "
                                             r"tensor holding"):
            F.quantize(x.cuda(), "nvfp4", global_amax=torch.tensor([bad], device="cuda"))
