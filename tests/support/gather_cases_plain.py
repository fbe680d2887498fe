"""Gather cases: plain tensors of every dtype (odd shapes, empty, non-contiguous, sync/async,
verify) and a subgroup of 2 ranks."""
import torch

from pyxfer.gather import GatherVerificationError, all_gather
from pyxfer.testing import inject_fault

from support.gather_harness import assert_same, gather, noncontig, shard_of

PLAIN_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def plain_cases():
    out = []
    for dtype in PLAIN_DTYPES:
        def run(ctx, dtype=dtype):
            from support.tensors import random_tensor
            gen = ctx.gen()
            for shape in ((7,), (3, 5, 7), (0, 4), (1, 1)):
                full = random_tensor((ctx.world * shape[0],) + shape[1:], dtype, gen)
                for nc, asyn, verify in ((False, False, True), (True, True, False), (True, False, True)):
                    x = shard_of(ctx, full).to(ctx.device)
                    x = noncontig(x) if nc else x
                    got = gather(ctx, x, async_op=asyn, verify=verify)
                    assert got.is_contiguous() and got.device == x.device
                    assert_same(got, full, f"{dtype} {shape} nc={nc}")
        out.append((f"plain-{str(dtype)[6:]}", run))

    def subgroup(ctx):
        group = ctx.pair
        if ctx.rank >= 2:
            return
        full = torch.arange(2 * 6, dtype=torch.float32).reshape(2 * 3, 2)
        got = all_gather(full[3 * ctx.rank:3 * ctx.rank + 3].to(ctx.device), group, verify=True)
        assert_same(got, full)
        with inject_fault("bitflip", src=1 - ctx.rank, dst=ctx.rank, path="gather") as f:
            try:
                all_gather(full[3 * ctx.rank:3 * ctx.rank + 3].to(ctx.device), group, verify=True)
                raise AssertionError("no GatherVerificationError")
            except GatherVerificationError as e:
                assert e.src_rank == 1 - ctx.rank and e.rank == ctx.rank  # group ranks
        assert f.used == 1
    out.append(("plain-subgroup-of-2", subgroup))
    return out


def cases(world):
    return [(n, f) for n, f in plain_cases() if world > 2 or n != "plain-subgroup-of-2"]
