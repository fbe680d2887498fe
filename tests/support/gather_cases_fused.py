"""Gather cases: fused mode (data and record in one collective once a group repeats its
signature): repeats, new signatures, calls in flight, local failures before and after posting,
disagreements with ranks in fused mode; and the side stream of the waiting protocol."""
import weakref

import torch
import torch.distributed as dist

import pyxfer.gather
import pyxfer.gather.exchange
import pyxfer.gather.layouts
from pyxfer import formats
from pyxfer.gather import all_gather

from support.gather_harness import assert_same, full_tensor, gather, in_step, reachable, scratch_posts, shard_of, state


def fused_cases():
    """The first two calls of a signature wait for their records; from the third on, data and record
    travel in one collective and the records are checked afterwards. Repeats must give exact results;
    a new signature on every rank must work (one scratch gather); a rank that disagrees with ranks in
    fused mode must leave every rank with the same error, the group in step and still fused."""
    out = []

    def repeats(ctx):
        full = full_tensor(ctx, (64, 96), torch.bfloat16, ctx.gen())
        nvfp4 = formats.QuantizeSpec("nvfp4", rowwise=True, columnwise=True)  # amax from the records: never fused
        mxfp8 = formats.QuantizeSpec("mxfp8", rowwise=True, columnwise=True)
        cases = [({}, True), ({"verify": True}, True), ({"quantize_as": mxfp8}, True),
                 ({"quantize_as": mxfp8, "verify": True}, True), ({"quantized": "mxfp8"}, True),
                 ({"quantized": "mxfp8", "verify": True}, True), ({"quantize_as": nvfp4}, False)]
        for kw, fusable in cases:
            kw = dict(kw)
            fmt = kw.pop("quantized", None)
            for i in range(4):
                x = shard_of(ctx, full * (i + 1)).to(ctx.device)
                if fmt:
                    x = formats.quantize(x, fmt, columnwise=True)
                    want = formats.quantize(full * (i + 1), fmt, columnwise=True)
                else:
                    want = kw["quantize_as"].quantize(full * (i + 1)) if "quantize_as" in kw else full * (i + 1)
                fused, layout = state(ctx).fused(), state(ctx).layout
                assert i == 0 or fused == (fusable and i >= 2), (kw, fmt, i, fused)
                with scratch_posts() as seen:
                    assert_same(gather(ctx, x, async_op=i == 3, **kw), want)
                # a new signature on every rank: scratch buffers of the old layout, if it was fused
                assert seen == ([len(layout)] if fused and i == 0 else []), (kw, fmt, i, seen)
    out.append(("fused-repeats", repeats))

    def new_signature_everywhere(ctx):
        """In fused mode every rank changes shape: one scratch gather of the old layout, exact results."""
        for i, rows in enumerate((4, 4, 4, 6, 6, 6)):
            full = full_tensor(ctx, (rows, 5), torch.float32, ctx.gen())
            x = shard_of(ctx, full).to(ctx.device)
            fused = state(ctx).fused()
            with scratch_posts() as seen:
                assert_same(gather(ctx, x, async_op=rows == 6), full)
            assert i == 0 or seen == ([1] if i == 3 else []), (rows, seen)
            assert i == 0 or fused == (i in (2, 3, 5)), (i, fused)
        assert state(ctx).fused()
    out.append(("fused-new-signature-on-every-rank", new_signature_everywhere))

    def in_flight(ctx):
        """Fused calls in flight at once, each record holding device-computed hashes, with small
        allocations written between the calls (they would reuse a record freed too early)."""
        full = full_tensor(ctx, (512, 384), torch.float32, ctx.gen())
        x = shard_of(ctx, full).to(ctx.device)
        for _ in range(2):
            assert_same(gather(ctx, x, verify=True), full)
        assert state(ctx).fused()
        handles, litter = [], []
        for i in range(4):
            handles.append(all_gather(x * (i + 1), ctx.group, async_op=True, verify=True))
            litter += [torch.full((64,), -1, dtype=torch.int64, device=ctx.device) for _ in range(8)]
        for i, h in enumerate(handles):
            assert_same(h.wait(), full * (i + 1))
        assert all(bool((t == -1).all()) for t in litter)
    out.append(("fused-calls-in-flight-with-verify", in_flight))

    def fused_mxfp8(ctx, shard_shape):
        """(this rank's MXFP8 shard, the expected gather) after two agreed calls: the group is fused."""
        full = full_tensor(ctx, shard_shape, torch.bfloat16, ctx.gen())
        q = formats.quantize(shard_of(ctx, full).to(ctx.device), "mxfp8")
        want = formats.quantize(full, "mxfp8")
        for _ in range(2):
            assert_same(all_gather(q, ctx.group), want)
        assert state(ctx).fused()
        return q, want

    def local_failure(ctx):
        """A fused call that fails on one rank after posting (building its result): that rank raises its
        own error with its record buffers back in the pool, the others get exact results, the group
        stays fused and in step."""
        q, want = fused_mxfp8(ctx, (64, 64))
        pool = pyxfer.gather.exchange._free_record_buffers.get((torch.device(ctx.device), ctx.world))
        free = None if pool is None else len(pool)
        original = pyxfer.formats.tensor_from_buffers

        def failing(*args, **kwargs):
            raise RuntimeError("injected local failure")
        pyxfer.formats.tensor_from_buffers = failing if ctx.rank == 0 else original
        try:
            for asyn in (False, True):
                try:
                    got = gather(ctx, q, async_op=asyn)
                except RuntimeError as e:
                    assert ctx.rank == 0 and "injected local failure" in str(e), (ctx.rank, e)
                else:
                    assert ctx.rank != 0, "no error raised"
                    assert_same(got, want)
        finally:
            pyxfer.formats.tensor_from_buffers = original
        assert free is None or len(pool) == free, (free, len(pool))
        assert state(ctx).fused()
        assert_same(all_gather(q, ctx.group), want)
        in_step(ctx)
    out.append(("fused-local-failure-after-posting", local_failure))

    def failure_before_posting(ctx):
        """A fused call that fails on one rank before posting (allocating its result, as when out of
        memory): that rank posts scratch buffers with an error record and raises its own error, the
        others raise a ValueError naming it (nobody hangs); the group stays fused and in step."""
        q, want = fused_mxfp8(ctx, (64, 96))
        original = pyxfer.gather.layouts.quantized_parts

        def failing(*args, **kwargs):
            raise torch.OutOfMemoryError("injected allocation failure")
        for asyn in (False, True):
            pyxfer.gather.layouts.quantized_parts = failing if ctx.rank == 0 else original
            try:
                with scratch_posts() as seen:
                    try:
                        gather(ctx, q, async_op=asyn)
                    except (torch.OutOfMemoryError, ValueError) as e:
                        err = e
                    else:
                        raise AssertionError("no error raised")
            finally:
                pyxfer.gather.layouts.quantized_parts = original
            if ctx.rank == 0:
                assert isinstance(err, torch.OutOfMemoryError) and "injected" in str(err), err
                assert seen == [2], seen  # the agreed layout: rowwise data and scales
            else:
                assert isinstance(err, ValueError) and "rank 0" in str(err) and "failed before sending" in str(err), err
                assert seen == [], seen
            assert state(ctx).fused()  # errors change no state
            with scratch_posts() as seen:
                assert_same(all_gather(q, ctx.group), want)
            assert seen == []
        in_step(ctx)
    out.append(("fused-local-failure-before-posting", failure_before_posting))

    def failed_attempt_freed_first(ctx):
        """A fused call that fails on one rank while building its buffers (after allocating some, as
        an out-of-memory error does) posts scratch buffers instead: the failed attempt's buffers are
        freed before the scratch is allocated (the error's frames must not keep them)."""
        q, want = fused_mxfp8(ctx, (64, 32))
        original, alive_at_scratch = pyxfer.gather.layouts.quantized_parts, []
        built = []

        def failing(*args, **kwargs):
            parts = original(*args, **kwargs)  # allocated, held by this frame when the error is raised
            built.extend(weakref.ref(p.recv) for p in parts)
            raise torch.OutOfMemoryError("injected: out of memory after allocating the result")

        def counting(layout, *args):
            alive_at_scratch.append(sum(r() is not None for r in built))
            return scratch(layout, *args)
        scratch = pyxfer.gather.scratch_parts
        if ctx.rank == ctx.world - 1:
            pyxfer.gather.layouts.quantized_parts, pyxfer.gather.scratch_parts = failing, counting
        try:
            gather(ctx, q)
        except (torch.OutOfMemoryError, ValueError) as e:
            err = e
        else:
            raise AssertionError("no error raised")
        finally:
            pyxfer.gather.layouts.quantized_parts, pyxfer.gather.scratch_parts = original, scratch
        if ctx.rank == ctx.world - 1:
            assert isinstance(err, torch.OutOfMemoryError), err
            assert built and alive_at_scratch == [0], (len(built), alive_at_scratch)
        else:
            assert isinstance(err, ValueError) and f"rank {ctx.world - 1}" in str(err), err
        del err
        assert_same(all_gather(q, ctx.group), want)
        in_step(ctx)
    out.append(("fused-fallback-frees-the-failed-attempt-first", failed_attempt_freed_first))

    def failed_call_holds_no_collective(ctx, variant, asyn):
        """The error of a failed fused call (rank 0 passes another dim 0, or None) keeps no Work object
        of the call alive and is in no reference cycle (which would keep the call's frames, its
        buffers and the group alive until a garbage collection): objects of the failed call that
        outlive the process group abort the process at exit (gloo)."""
        x = torch.ones(4, 3, device=ctx.device)
        for _ in range(3):
            assert_same(all_gather(x, ctx.group), torch.ones(4 * ctx.world, 3))
        assert state(ctx).fused()
        handle = None
        try:
            y = x if ctx.rank else torch.ones(5, 3, device=ctx.device) if variant == "shape" else None
            if asyn and ctx.rank != 0:  # rank 0 raises at the call (it read the records at once)
                handle = all_gather(y, ctx.group, async_op=True)
                handle.wait()
            else:
                all_gather(y, ctx.group)
        except (ValueError, TypeError) as e:
            assert ("dim 0" if variant == "shape" else "rejected" if ctx.rank else "torch.Tensor") in str(e), e
            found = reachable(e)
            works = [o for o in found if isinstance(o, dist.Work)]
            assert not works, f"the error keeps {len(works)} Work object(s) of the failed call alive"
            if handle is None:  # (a handle keeps its error to raise it again: that cycle holds no Work)
                assert not any(o is e for o in found), "the error is in a reference cycle"
            del found
        else:
            raise AssertionError("no error raised")
        in_step(ctx)
    for variant in ("shape", "none"):
        for asyn in (False, True):
            out.append((f"failed-call-holds-no-collective-{variant}-{'async' if asyn else 'sync'}",
                        lambda ctx, variant=variant, asyn=asyn: failed_call_holds_no_collective(ctx, variant, asyn)))
    variants = {  # name: (rank 0's input, the others' input, words of the error)
        "shape": (lambda d: torch.ones(4, 3, device=d), lambda d: torch.ones(5, 3, device=d), "dim 0"),
        "dtype": (lambda d: torch.ones(4, 3, device=d), lambda d: torch.ones(4, 3, dtype=torch.float16, device=d),
                  "dtype"),
        "bad-input": (lambda d: torch.ones(4, 3, device=d), lambda d: torch.ones((), device=d), "rejected"),
    }
    for name, (agreed, other, words) in variants.items():
        for fused_ranks in ("rank0", "others"):
            for asyn in (False, True):
                def run(ctx, name=name, agreed=agreed, other=other, words=words, fused_ranks=fused_ranks, asyn=asyn):
                    for _ in range(2):
                        assert_same(all_gather(agreed(ctx.device), ctx.group), torch.ones(4 * ctx.world, 3))
                    assert state(ctx).fused()
                    on_agreed = (ctx.rank == 0) == (fused_ranks == "rank0")
                    x = agreed(ctx.device) if on_agreed else other(ctx.device)
                    with scratch_posts() as seen:
                        try:
                            gather(ctx, x, async_op=asyn)
                        except (ValueError, TypeError) as e:
                            msg = str(e)
                        else:
                            raise AssertionError("no error raised")
                    assert seen == ([] if on_agreed else [1]), (seen, ctx.rank)
                    others = "rank 1" if ctx.world == 2 else f"ranks {', '.join(map(str, range(1, ctx.world)))}"
                    if name != "bad-input":
                        assert words in msg and "rank 0" in msg and others in msg, msg
                    elif on_agreed:  # the others' error names the ranks that rejected their input
                        assert words in msg and (others if fused_ranks == "rank0" else "rank 0") in msg, msg
                    else:
                        assert "0-dim" in msg, msg
                    assert state(ctx).fused()  # errors change no state: the agreed call is still fused
                    with scratch_posts() as seen:
                        assert_same(all_gather(agreed(ctx.device), ctx.group), torch.ones(4 * ctx.world, 3))
                    assert seen == []
                    in_step(ctx)
                    in_step(ctx)
                out.append((f"fused-disagree-{name}-agreed-on-{fused_ranks}-{'async' if asyn else 'sync'}", run))
    return out


def stream_cases():
    """The waiting protocol writes the record's device values (NVFP4 amax, PXH64 of the sent bytes) on a
    side stream, which must wait for the caller's stream, where they are made: each call here is queued
    behind a long kernel on the caller's stream (CUDA) and its data differ from the previous call's."""
    def run(ctx):
        on_cuda = str(ctx.device).startswith("cuda")

        def stall():  # what follows runs late on the caller's stream: the data device's current stream
            if on_cuda:
                with torch.cuda.device(ctx.device):  # the data may live on another GPU than the current one
                    torch.cuda._sleep(20_000_000)
        gen, spec = ctx.gen(), formats.QuantizeSpec("nvfp4")  # global amax from the records: never fused
        full = full_tensor(ctx, (32, 64), torch.bfloat16, gen, spread=True)
        x = shard_of(ctx, full).to(ctx.device)
        for i in range(4):
            plain = full_tensor(ctx, (8 + i, 24), torch.float32, gen)  # a new signature: not fused
            y = shard_of(ctx, plain).to(ctx.device)
            scale = 2.0 ** i  # exact: the amax differs from call to call
            stall()
            assert_same(all_gather(x * scale, ctx.group, quantize_as=spec), spec.quantize(full * scale), f"nvfp4 {i}")
            stall()
            assert_same(all_gather(y * scale, ctx.group, verify=True), plain * scale, f"verify {i}")
    return [("records-wait-for-the-caller-stream", run)]


def cases(world):
    return fused_cases() + stream_cases()
