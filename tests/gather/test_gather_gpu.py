"""pyxfer.all_gather on NCCL with two ranks (one process per GPU): the whole case list of the gather
harness (format matrix, plain tensors, faults caught by verify, disagreements, failures after
agreement, fused schedules and their disagreements, NVFP4 shards with different amax renormalised on
the device, world size 1), expected results computed on the CPU, so every gathered buffer is also
checked CUDA == CPU bit-exact; once with each rank's data on its own GPU and once swapped (rank 0's
data on cuda:1 while its current device is 0); and with four ranks (four GPUs). Plus single-process
checks with data on cuda:1 and current device 0, (one GPU) the buffer lifetimes of fused calls on a
1-rank NCCL group, and fused gathers captured in a CUDA graph and replayed (one and two GPUs)."""
import os
import subprocess
import sys
import tempfile

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
assert G.engine.state_of(group, 0, 1).predicted() is not None
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
print("ok", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("handle", ["dropped", "keep"])
def test_fused_buffers_stay_owned_until_the_collective_completed(handle):
    r = run_python(_FUSED_LIFETIME.replace("sys.argv[1]", repr(handle)), timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


# A fused gather captured in a CUDA graph (pyxfer.gather.engine): one native call, no host read, so it
# records; replays gather the static input's current values; the verdicts land in the latch's graph
# slot and check_gathers (which synchronizes the device) finds them agreeing. Then an eager call of
# the same signature is still fused and exact, and a capture of a call that would need the host
# (another signature, async, verify) raises before posting anything.
_GRAPH = r"""
import os, sys, tempfile, torch, torch.distributed as dist
import pyxfer
import pyxfer.gather as G
from pyxfer import formats
rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=dev)
group = dist.group.WORLD
gen = torch.Generator().manual_seed(1234)
# K = 256: a multiple of every format's block (128 for FP8 block), so each format travels quantized
fulls = [torch.randn(world * 256, 256, generator=gen) for _ in range(4)]
def shard(full):
    return full[rank * 256:(rank + 1) * 256].to(dev)
for fmt in ("plain", "mxfp8", "nvfp4", "fp8_block_1x128"):
    def make(full):
        x = shard(full).to(torch.bfloat16)
        if fmt == "plain":
            return x
        opts = {"global_amax": float(full.to(torch.bfloat16).float().abs().max())} if fmt == "nvfp4" else {}
        return formats.quantize(x, fmt, rowwise=True, columnwise=True, **opts)
    def want(full):
        hp = full.to(torch.bfloat16)
        if fmt == "plain":
            return hp
        opts = {"global_amax": float(hp.float().abs().max())} if fmt == "nvfp4" else {}
        return formats.quantize(hp, fmt, rowwise=True, columnwise=True, **opts)
    def same(got, ref):
        if isinstance(got, torch.Tensor) != isinstance(ref, torch.Tensor):
            return False  # a quantized reference, a plain result (or the reverse): the wrong path
        if isinstance(ref, torch.Tensor):
            return torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))
        return all(torch.equal(got.buffers()[n].cpu().view(torch.uint8), b.view(torch.uint8))
                   for n, b in ref.buffers().items())
    static = make(fulls[0])
    for _ in range(3):
        assert same(G.gather(static, group, rank, world), want(fulls[0])), fmt
    state = G.engine.state_of(group, rank, world)
    assert state.predicted() is not None, fmt
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gather(static, group, rank, world)
    for i in (1, 2, 3):
        src = make(fulls[i])
        if fmt == "plain":
            static.copy_(src)
        else:
            for n, b in src.buffers().items():
                static.buffers()[n].copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        assert same(out, want(fulls[i])), (fmt, i)
    pyxfer.check_gathers(group)
    assert same(G.gather(static, group, rank, world), want(fulls[3])), fmt  # eager, still fused
    del graph, out
for what in ("signature", "async", "verify"):
    x = torch.ones(64, 32, device=dev)
    for _ in range(3):
        G.gather(x, group, rank, world)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            if what == "signature":
                G.gather(torch.ones(32, 32, device=dev), group, rank, world)
            else:
                G.gather(x, group, rank, world, async_op=what == "async", verify=what == "verify")
    except RuntimeError as e:
        assert "captured in a CUDA graph" in str(e), (what, e)
    else:
        raise AssertionError(f"capturing a {what} gather did not raise")
    del graph
    torch.cuda.synchronize()
    assert torch.equal(G.gather(x, group, rank, world), torch.ones(64 * world, 32, device=dev)), what
dist.destroy_process_group()
print("ok", flush=True)
"""


def _run_ranks(code, world, timeout=400):
    """Run ``code`` once per rank of a ``world``-process group (argv: rank, world, init method); returns
    (exit codes, outputs)."""
    with tempfile.TemporaryDirectory() as tmp:
        # stderr to a file of its own: what torch or NCCL writes at exit must not follow the "ok" line
        errs = [open(os.path.join(tmp, f"err{r}"), "w+") for r in range(world)]  # closed below
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world), f"file://{tmp}/init"],
                                  stdout=subprocess.PIPE, stderr=errs[r], text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0] + "\n(killed: timeout)")
        for err in errs:
            err.seek(0)
        outs = [out + "\n--- stderr ---\n" + err.read()[-3000:] for out, err in zip(outs, errs)]
        for err in errs:
            err.close()
        return [p.returncode for p in procs], outs


@pytest.mark.gpu
def test_fused_gather_captured_in_a_cuda_graph_one_gpu():
    codes, outs = _run_ranks(_GRAPH, 1)
    assert codes == [0] and "ok" in outs[0].split("--- stderr ---")[0].split(), outs[0][-4000:]


@pytest.mark.multigpu
def test_fused_gather_captured_in_a_cuda_graph_two_gpus():
    codes, outs = _run_ranks(_GRAPH, 2)
    assert codes == [0, 0] and all("ok" in o.split("--- stderr ---")[0].split() for o in outs), \
        "\n".join(o[-3000:] for o in outs)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
@pytest.mark.parametrize("case", case_names(4))
def test_nccl_gather_case_four_gpus(request, case):
    if "four" not in _cache:
        _cache["four"] = run_group(4, backend="nccl", only=selected_cases(request, "test_nccl_gather_case_four_gpus"))
    assert_case_passed(*_cache["four"], case)


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
