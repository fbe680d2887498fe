"""pyxfer.gather's plans and native fix-ups on a 1-rank gloo group (the whole protocol, through
pyxfer.gather.gather): a 1-rank gather gives the shard's own buffers back, padding included, in its
waiting calls and fused (for every format, usage, quantizable or not); the layout a plan predicts from
the agreed signature alone (what a rank that leaves the schedule posts as scratch) is what its data
call posts; plain dtypes travel natively or as bytes, and come back with their dtype."""
import itertools

import pytest
import torch
import torch.distributed as dist

import pyxfer.gather
from pyxfer import formats
from pyxfer.gather import engine

USAGES = ((True, False), (False, True), (True, True))
SHAPES = {"fp8_block_1x128": [(128, 256), (2, 64, 128), (64, 256)], "fp8_block_128x128": [(128, 384), (32, 128)],
          "mxfp8": [(32, 64), (2, 16, 96), (16, 64)], "nvfp4": [(16, 64), (2, 8, 32), (8, 32)]}


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _posted_bytes(plan, x, device):
    """Bytes per part that the plan's data call posts for input ``x`` (a 1-rank gather_post)."""
    state = engine.state_of(dist.group.WORLD, 0, 1)
    local = pyxfer.gather.plan.Local(x, None, False, 1, exchange=True)
    inputs, amax = plan.inputs_of(local)
    latch, _ = state.latch(device)
    outs = engine.post(state.group_name, plan.id, inputs, plan.meta(device), amax, latch, 0, 0, 0)
    return [r.nbytes for r in engine.received(plan, outs[:plan.num_results], outs[plan.num_results:-1])], \
        outs[plan.num_results:-1]


@pytest.mark.parametrize("fmt,usage", list(itertools.product(formats.FORMATS, USAGES)))
def test_one_rank_gather_gives_the_shard_back(fmt, usage, world_of_one, gen):
    group = dist.group.WORLD
    spec = formats.QuantizeSpec(fmt, rowwise=usage[0], columnwise=usage[1])
    for shape in SHAPES[fmt]:
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        for i in range(3):  # two waiting calls, then fused
            if spec.is_quantizable(shape):
                q = spec.quantize(x * (i + 1))
                got = pyxfer.gather.gather(q, group, 0, 1)
                assert sorted(got.buffers()) == sorted(q.buffers()), (shape, i)
                for name, want in q.buffers().items():
                    assert got.buffers()[name].shape == want.shape, (shape, i, name)
                    assert torch.equal(_bits(got.buffers()[name]), _bits(want)), (shape, i, name)
            else:  # the fallback: the gathered (same) shape is not quantizable either, returned as is
                got = pyxfer.gather.gather(x * (i + 1), group, 0, 1, quantize_as=spec)
                assert torch.equal(_bits(got), _bits(x * (i + 1))), (shape, i)
        plan = engine.state_of(group, 0, 1).predicted()
        assert plan is not None and plan.fusable and plan.shape == shape
        sent = plan.layout
        if spec.is_quantizable(shape):
            names = [n for n in formats.BUFFER_NAMES if n in q.buffers()]
            assert list(plan.names) == names
            got_bytes, temps = _posted_bytes(plan, q, x.device)
            assert got_bytes == [d.itemsize * n for d, n in sent]
            assert len(temps) == sum(g.fixup == "swap" for g in plan.gathered)
        else:
            assert sent == ((torch.bfloat16, x.numel()),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64, torch.float8_e5m2, torch.int16])
def test_plain_layout_travels_natively_or_as_bytes(dtype, world_of_one):
    group = dist.group.WORLD
    t = torch.zeros((5, 3), dtype=torch.float32).add_(torch.arange(15).reshape(5, 3)).to(dtype)[:, ::2]
    for _ in range(3):  # non-contiguous, waiting then fused
        got = pyxfer.gather.gather(t, group, 0, 1)
        assert got.dtype == dtype and got.shape == t.shape and got.is_contiguous()
        assert torch.equal(_bits(got), _bits(t))
    plan = engine.state_of(group, 0, 1).predicted()
    native = dtype in (torch.float32,)
    assert plan.layout == (((dtype, 10),) if native else ((torch.uint8, 10 * t.element_size()),))
    assert _posted_bytes(plan, t, t.device)[0] == [10 * t.element_size()]
