"""pyxfer.all_gather on NCCL with two ranks (one process per GPU): the whole case list of
tests/gather_worker.py (format matrix, plain tensors, faults caught by verify, disagreements, world
size 1), expected results computed on the CPU, so every gathered buffer is also checked CUDA == CPU
bit-exact; once with each rank's data on its own GPU and once swapped (rank 0's data on cuda:1 while
its current device is 0). Plus single-process checks with data on cuda:1 and current device 0."""
import os
import sys

import pytest
import torch

import pyxfer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gather_harness import case_names, run_group  # noqa: E402
from test_gather import assert_case_passed, selected_cases  # noqa: E402

pytestmark = pytest.mark.multigpu

_cache = {}


@pytest.mark.parametrize("swap", [False, True], ids=["own-gpu", "swapped-gpus"])
@pytest.mark.parametrize("case", case_names(2))
def test_nccl_gather_case(request, case, swap):
    if swap not in _cache:
        _cache[swap] = run_group(2, backend="nccl", extra=("--swap-devices",) if swap else (),
                                 only=selected_cases(request, "test_nccl_gather_case", swap=swap))
    assert_case_passed(*_cache[swap], case)


@pytest.mark.parametrize("fmt", ["fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4"])
def test_world_of_one_on_cuda1_with_current_device_0(world_of_one, fmt, gen):
    from pyxfer import formats
    torch.cuda.set_device(0)
    x_cpu = torch.randn(256, 128, generator=gen).to(torch.bfloat16)
    x = x_cpu.to("cuda:1")
    spec = formats.QuantizeSpec(fmt, rowwise=True, columnwise=True)
    got = pyxfer.all_gather(x, quantize_as=spec, async_op=True).wait()
    want = spec.quantize(x_cpu)
    assert torch.cuda.current_device() == 0 and got.device == torch.device("cuda:1")
    for name, buf in want.buffers().items():
        assert torch.equal(got.buffers()[name].cpu().view(torch.uint8), buf.view(torch.uint8)), name
    q = formats.quantize(x, fmt)
    assert pyxfer.all_gather(q, verify=True) is q
    torch.cuda.synchronize(1)
