"""pyxfer.all_gather on NCCL with two ranks (one process per GPU): the whole case list of the gather
harness (format matrix, plain tensors, faults caught by verify, disagreements, failures after
agreement, world size 1), expected results computed on the CPU, so every gathered buffer is also
checked CUDA == CPU bit-exact; once with each rank's data on its own GPU and once swapped (rank 0's
data on cuda:1 while its current device is 0). Plus single-process checks with data on cuda:1 and
current device 0, and (one GPU) the buffer lifetimes of fused calls on a 1-rank NCCL group."""

import pytest
import torch

import pyxfer

from support.gather_harness import assert_case_passed, case_names, run_group, selected_cases
from support.processes import run_python

_cache = {}


# Buffer lifetimes of fused calls (one GPU, a 1-rank NCCL group running the whole protocol through
# pyxfer.gather.gather): the NCCL stream is held back behind a long kernel on another stream, so the
# fused collective is still pending while the caller drops its handle (or keeps it) and allocates and
# fills buffers of the same size on its stream. A posted buffer handed out again would be overwritten
# by the pending collective (before the fix: the side stream's wait let NCCL drop its references).
_FUSED_LIFETIME = r"""
import os, sys, tempfile, torch, torch.distributed as dist
import pyxfer.gather as G
keep = sys.argv[1] == "keep"
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
tmp = tempfile.mkdtemp()
dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1, device_id=dev)
group = dist.group.WORLD
n = (1 << 20) + 3
x = torch.randn(n, device=dev)
for i in range(3):
    assert torch.equal(G.gather(x, group, 0, 1), x)
assert G._agreed(group).fused()
stall, dummy = torch.cuda.Stream(dev), torch.zeros(1, device=dev)
with torch.cuda.stream(stall):  # the NCCL stream waits for this stream's sleep before its next collective
    torch.cuda._sleep(1_500_000_000)
    dist.all_reduce(dummy)
y = x * 2
h = G.gather(y, group, 0, 1, async_op=True)  # fused: data and record in one collective, still pending
del y
if not keep:
    del h  # dropped without wait()
fresh = [torch.full((n,), -7.0, device=dev) for _ in range(8)]  # same size, the caller's stream, at once
if keep:
    got = h.wait()
    assert torch.equal(got, x * 2), "the gathered bytes changed"
torch.cuda.synchronize(dev)
assert all(bool((t == -7.0).all()) for t in fresh), "a new allocation was overwritten by a pending collective"
assert torch.equal(G.gather(x, group, 0, 1), x)
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("handle", ["dropped", "keep"])
def test_fused_buffers_stay_owned_until_the_collective_completed(handle):
    r = run_python(_FUSED_LIFETIME.replace("sys.argv[1]", repr(handle)), timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.multigpu
@pytest.mark.parametrize("swap", [False, True], ids=["own-gpu", "swapped-gpus"])
@pytest.mark.parametrize("case", case_names(2))
def test_nccl_gather_case(request, case, swap):
    if swap not in _cache:
        _cache[swap] = run_group(2, backend="nccl", extra=("--swap-devices",) if swap else (),
                                 only=selected_cases(request, "test_nccl_gather_case", swap=swap))
    assert_case_passed(*_cache[swap], case)


@pytest.mark.multigpu
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
