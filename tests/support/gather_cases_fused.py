"""Gather cases: fused calls (pyxfer.gather.engine: once a group's agreed signatures repeat a pattern,
each call is one native call and the records are compared on the device): repeats, alternating and
cyclic schedules, new signatures on every rank, a rank leaving the schedule alone (its error at once,
its peers' results marked invalid and their error at the next call / wait() / check_gathers),
``strict=True``, failures before and after posting, async handles dropped unwaited, NVFP4 shards with
different amax renormalised; and the side stream of the waiting protocol."""
import gc
import warnings
import weakref

import torch
import torch.distributed as dist

import pyxfer
import pyxfer.gather
import pyxfer.gather.engine
import pyxfer.gather.exchange
from pyxfer import formats
from pyxfer.gather import QuantizedGatherFallbackWarning, all_gather

from support.gather_harness import (
    assert_same,
    full_tensor,
    fused,
    gather,
    in_step,
    reachable,
    scratch_posts,
    shard_of,
    state,
)

E = pyxfer.gather.engine


class Exchanges:
    """Counts this rank's record exchanges (waiting calls) while active."""

    def __init__(self):
        self.count, self._original = 0, pyxfer.gather.Records

    def __enter__(self):
        original = self._original

        def counting(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        pyxfer.gather.Records = counting
        return self

    def __exit__(self, *exc):
        pyxfer.gather.Records = self._original


def others(ctx):
    return "rank 1" if ctx.world == 2 else f"ranks {', '.join(map(str, range(1, ctx.world)))}"


def is_marked_invalid(got):
    """The result of a call whose ranks disagreed: NaN scales (quantized), NaN data (float tensors)."""
    if isinstance(got, torch.Tensor):
        return bool(torch.isnan(got.float()).all())
    bufs = got.buffers()
    for name, b in bufs.items():
        if name.endswith("scale_inv"):
            if b.dtype == torch.float32:
                if not bool(torch.isnan(b).all()):
                    return False
            elif not bool((b.view(torch.uint8) == (0xFF if got.fmt == "mxfp8" else 0x7F)).all()):
                return False
    if got.fmt == "nvfp4":
        return all(bool(torch.isnan(bufs[n]).all()) for n in ("amax_rowwise", "amax_columnwise") if n in bufs)
    return True


def raised_by_check(ctx):
    """The deferred error this rank raises in check_gathers (None if it has none)."""
    try:
        pyxfer.check_gathers(ctx.group)
    except (ValueError, TypeError, RuntimeError) as e:
        return e
    return None


def fused_cases():
    out = []

    def repeats(ctx):
        """The first two calls of a signature wait for their records; from the third on, one native call
        each (no record exchange), exact results in every mode."""
        full = full_tensor(ctx, (64, 96), torch.bfloat16, ctx.gen())
        nvfp4 = formats.QuantizeSpec("nvfp4", rowwise=True, columnwise=True)  # amax from the records: never fused
        mxfp8 = formats.QuantizeSpec("mxfp8", rowwise=True, columnwise=True)
        cases = [({}, True), ({"verify": True}, True), ({"quantize_as": mxfp8}, True),
                 ({"quantize_as": mxfp8, "verify": True}, True), ({"quantized": "mxfp8"}, True),
                 ({"quantized": "mxfp8", "verify": True}, True), ({"quantized": "fp8_block_1x128"}, True),
                 ({"quantize_as": nvfp4}, False)]
        block = full_tensor(ctx, (128, 128), torch.bfloat16, ctx.gen())  # FP8-block shards need 128 rows
        for kw, fusable in cases:
            kw = dict(kw)
            fmt = kw.pop("quantized", None)
            src = block if fmt == "fp8_block_1x128" else full
            for i in range(5):
                x = shard_of(ctx, src * (i + 1)).to(ctx.device)
                if fmt:
                    x = formats.quantize(x, fmt, columnwise=True)
                    want = formats.quantize(src * (i + 1), fmt, columnwise=True)
                else:
                    want = kw["quantize_as"].quantize(src * (i + 1)) if "quantize_as" in kw else src * (i + 1)
                was_fused = fused(ctx)
                predicted = state(ctx).predicted()
                assert i == 0 or was_fused == (fusable and i >= 2), (kw, fmt, i, was_fused)
                with scratch_posts() as seen, Exchanges() as ex:
                    assert_same(gather(ctx, x, async_op=i == 3, **kw), want)
                # a new signature on every rank in a fused group: scratch of the predicted layout, whose
                # gathered records serve as the agreement (no exchange of their own)
                assert seen == ([len(predicted.layout)] if was_fused and i == 0 else []), (kw, fmt, i, seen)
                assert ex.count == (0 if was_fused else 1), (kw, fmt, i, ex.count)
            assert raised_by_check(ctx) is None
    out.append(("fused-repeats", repeats))

    def schedules(ctx):
        """Alternating (period 2) and cyclic (period 3) patterns of signatures fuse once seen twice, give
        exact results, and no call of a fused group exchanges records."""
        gen = ctx.gen()
        shapes = {"a": (64, 96), "b": (32, 64), "c": (96, 32)}
        fulls = {k: full_tensor(ctx, s, torch.bfloat16, gen) for k, s in shapes.items()}
        for pattern in ("ab", "abc", "aab"):
            pyxfer.check_gathers(ctx.group)
            state(ctx).reset()
            period = len(pattern)
            calls = pattern * 4
            for i, k in enumerate(calls):
                scale = float(i + 1)
                q = formats.quantize(shard_of(ctx, fulls[k] * scale).to(ctx.device), "mxfp8")
                want = formats.quantize(fulls[k] * scale, "mxfp8")
                with Exchanges() as ex, scratch_posts() as seen:
                    got = gather(ctx, q, async_op=i % 3 == 1)
                assert_same(got, want, f"{pattern} call {i}")
                if i >= 2 * period:  # fused from the first call after the pattern was seen twice
                    assert ex.count == 0 and seen == [] and fused(ctx), (pattern, i, ex.count, seen)
            assert state(ctx).period == period, (pattern, state(ctx).period)
        assert raised_by_check(ctx) is None
    out.append(("fused-alternating-and-cyclic-schedules", schedules))

    def new_signature_everywhere(ctx):
        """In fused mode every rank changes shape together: one scratch exchange of the predicted layout,
        a new agreement, no error, exact results; then an alternating schedule all leave for a third shape."""
        for i, rows in enumerate((4, 4, 4, 6, 6, 6)):
            full = full_tensor(ctx, (rows, 5), torch.float32, ctx.gen())
            x = shard_of(ctx, full).to(ctx.device)
            was_fused = fused(ctx)
            with scratch_posts() as seen:
                assert_same(gather(ctx, x, async_op=rows == 6), full)
            assert i == 0 or seen == ([1] if i == 3 else []), (rows, seen)
            assert i == 0 or was_fused == (i in (2, 3, 5)), (i, was_fused)
        assert fused(ctx)
        for i, rows in enumerate((3, 5, 3, 5, 3, 7, 7, 7)):
            full = full_tensor(ctx, (rows, 2), torch.float32, ctx.gen())
            with scratch_posts() as seen:
                assert_same(gather(ctx, shard_of(ctx, full).to(ctx.device)), full)
            assert seen == ([1] if i in (0, 5) else []), (i, rows, seen)
        assert raised_by_check(ctx) is None
    out.append(("fused-new-signature-on-every-rank", new_signature_everywhere))

    def in_flight(ctx):
        """Fused calls in flight at once, each record holding device-computed hashes, with small
        allocations written between the calls (they would reuse a buffer freed too early)."""
        full = full_tensor(ctx, (512, 384), torch.float32, ctx.gen())
        x = shard_of(ctx, full).to(ctx.device)
        for _ in range(2):
            assert_same(gather(ctx, x, verify=True), full)
        assert fused(ctx)
        handles, litter = [], []
        for i in range(4):
            handles.append(all_gather(x * (i + 1), ctx.group, async_op=True, verify=True))
            litter += [torch.full((64,), -1, dtype=torch.int64, device=ctx.device) for _ in range(8)]
        for i, h in enumerate(handles):
            assert_same(h.wait(), full * (i + 1))
        assert all(bool((t == -1).all()) for t in litter)
    out.append(("fused-calls-in-flight-with-verify", in_flight))

    def dropped_handles(ctx):
        """Async handles of fused calls dropped unwaited: the group goes on (exact results, no error);
        when the dropped call's ranks disagreed, its peers raise at their next call."""
        full = full_tensor(ctx, (48, 32), torch.float32, ctx.gen())
        x = shard_of(ctx, full).to(ctx.device)
        for _ in range(3):
            assert_same(gather(ctx, x), full)
        for i in range(6):
            h = all_gather(x * (i + 2), ctx.group, async_op=True)
            if i % 2:
                del h
            else:
                assert_same(h.wait(), full * (i + 2))
        gc.collect()
        assert_same(gather(ctx, x), full)
        assert raised_by_check(ctx) is None
        # a dropped handle of a call that rank 0 left: rank 0 raises at once, the others at their next call
        odd = torch.ones(7, 32, device=ctx.device)
        if ctx.rank == 0:
            try:
                all_gather(odd, ctx.group, async_op=True)
            except ValueError as e:
                assert "dim 0" in str(e), e
            else:
                raise AssertionError("no error on rank 0")
        else:
            h = all_gather(x, ctx.group, async_op=True)
            del h
            gc.collect()
            try:
                all_gather(x, ctx.group)
            except ValueError as e:
                assert "dim 0" in str(e) and "whose ranks disagreed" in str(e.__notes__), e
            else:
                raise AssertionError(f"no error on rank {ctx.rank}")
        assert raised_by_check(ctx) is None
        assert_same(gather(ctx, x), full)
        in_step(ctx)
    out.append(("fused-async-handles-dropped-unwaited", dropped_handles))

    def fused_mxfp8(ctx, shard_shape):
        """(this rank's MXFP8 shard, the expected gather) after two agreed calls: the group is fused."""
        full = full_tensor(ctx, shard_shape, torch.bfloat16, ctx.gen())
        q = formats.quantize(shard_of(ctx, full).to(ctx.device), "mxfp8")
        want = formats.quantize(full, "mxfp8")
        for _ in range(2):
            assert_same(all_gather(q, ctx.group), want)
        assert fused(ctx)
        return q, want

    def local_failure(ctx):
        """A fused call that fails on one rank after posting (building its result): that rank raises its
        own error, the others get exact results, the group stays fused and in step."""
        q, want = fused_mxfp8(ctx, (64, 64))
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
        assert fused(ctx)
        assert_same(all_gather(q, ctx.group), want)
        assert raised_by_check(ctx) is None
        in_step(ctx)
    out.append(("fused-local-failure-after-posting", local_failure))

    def failure_before_posting(ctx):
        """A fused call that fails on one rank before posting (out of memory in the native call): that rank
        posts scratch buffers of the predicted layout with an error record and raises its own error at once;
        the others' results are marked invalid (NaN scales) and they raise a ValueError naming it at their
        next call or check_gathers, or in wait(); then every rank agrees anew (nobody hangs)."""
        for asyn in (False, True):
            q, want = fused_mxfp8(ctx, (64, 96))
            original = E.post if asyn else E.run
            calls = []

            def failing(*args, original=original, calls=calls, **kwargs):  # once: the scratch goes through E.post too
                if calls:
                    return original(*args, **kwargs)
                calls.append(1)
                raise torch.OutOfMemoryError("injected allocation failure")
            if ctx.rank == 0:
                setattr(E, "post" if asyn else "run", failing)
            err = got = None
            try:
                with scratch_posts() as seen:
                    try:
                        got = gather(ctx, q, async_op=asyn)
                    except (torch.OutOfMemoryError, ValueError) as e:
                        err = e
            finally:
                setattr(E, "post" if asyn else "run", original)
            if ctx.rank == 0:
                assert isinstance(err, torch.OutOfMemoryError) and "injected" in str(err), err
                assert seen == [2], seen  # the predicted layout: rowwise data and scales
                assert not fused(ctx)
            else:
                assert seen == [], seen
                if err is None:  # (async: wait() raises when the verdict is already there, as on gloo)
                    assert is_marked_invalid(got), "the result of a disagreeing call is not marked invalid"
                    err = raised_by_check(ctx)
                assert isinstance(err, ValueError) and "rank 0" in str(err) and "failed before sending" in str(err), err
            assert raised_by_check(ctx) is None
            assert not fused(ctx)  # every rank forgot the schedule
            with scratch_posts() as seen:
                assert_same(all_gather(q, ctx.group), want)
            assert seen == []
            in_step(ctx)
    out.append(("fused-local-failure-before-posting", failure_before_posting))

    def failed_attempt_freed_first(ctx):
        """A fused call that fails on one rank after allocating (as an out-of-memory error does) posts
        scratch buffers instead: the failed attempt's buffers are freed before the scratch is allocated
        (the error's frames must not keep them)."""
        q, want = fused_mxfp8(ctx, (64, 32))
        original, alive_at_scratch, built = E.run, [], []

        def failing(*args, **kwargs):
            held = [torch.empty(1 << 16, device=ctx.device) for _ in range(3)]  # held by this frame
            built.extend(weakref.ref(t) for t in held)
            raise torch.OutOfMemoryError("injected: out of memory after allocating the result")

        post = E.post

        def counting(*args):
            alive_at_scratch.append(sum(r() is not None for r in built))
            return post(*args)
        if ctx.rank == ctx.world - 1:
            E.run, E.post = failing, counting
        try:
            gather(ctx, q)
        except torch.OutOfMemoryError as e:
            err = e
        else:
            err = None
        finally:
            E.run, E.post = original, post
        if ctx.rank == ctx.world - 1:
            assert isinstance(err, torch.OutOfMemoryError), err
            assert built and alive_at_scratch == [0], (len(built), alive_at_scratch)
        else:
            err = raised_by_check(ctx)
            assert isinstance(err, ValueError) and f"rank {ctx.world - 1}" in str(err), err
        del err
        assert_same(all_gather(q, ctx.group), want)
        in_step(ctx)
    out.append(("fused-fallback-frees-the-failed-attempt-first", failed_attempt_freed_first))

    def failed_call_holds_no_collective(ctx, variant, asyn):
        """The error of a disagreeing fused call (rank 0 passes another dim 0, or None) keeps no Work
        object alive and is in no reference cycle (which would keep the call's frames, its buffers and the
        group alive until a garbage collection), on the rank that raised at once and on the ranks that
        raised later: objects of a failed call that outlive the process group abort the process at exit
        (gloo)."""
        x = torch.ones(4, 3, device=ctx.device)
        for _ in range(3):
            assert_same(all_gather(x, ctx.group), torch.ones(4 * ctx.world, 3))
        assert fused(ctx)
        handle = None
        try:
            y = x if ctx.rank else torch.ones(5, 3, device=ctx.device) if variant == "shape" else None
            if asyn and ctx.rank != 0:
                handle = all_gather(y, ctx.group, async_op=True)
                handle.wait()
            else:
                all_gather(y, ctx.group)
            pyxfer.check_gathers(ctx.group)  # the peers' error, if not raised yet
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
        for left_on in ("rank0", "others"):
            for mode in ("sync", "async", "strict"):
                def run(ctx, name=name, agreed=agreed, other=other, words=words, left_on=left_on, mode=mode):
                    """A fused group where some ranks call with another input than predicted: those raise at
                    once (after posting scratch of the predicted layout); the others get a result marked
                    invalid (NaN) and raise the same error at their next call, in wait() or check_gathers
                    (strict: in the call itself); every rank forgets the schedule; nobody hangs."""
                    for _ in range(2):
                        assert_same(all_gather(agreed(ctx.device), ctx.group), torch.ones(4 * ctx.world, 3))
                    assert fused(ctx)
                    on_agreed = (ctx.rank == 0) != (left_on == "rank0")
                    x = agreed(ctx.device) if on_agreed else other(ctx.device)
                    got = err = None
                    with scratch_posts() as seen:
                        try:
                            got = gather(ctx, x, async_op=mode == "async", strict=mode == "strict")
                        except (ValueError, TypeError) as e:
                            err = e
                    assert seen == ([] if on_agreed else [1]), (seen, ctx.rank)
                    if on_agreed:
                        if mode == "strict":
                            assert err is not None, "strict=True: no error in the call"
                        elif err is None:
                            assert mode == "async" or got is not None
                            assert is_marked_invalid(got), "the result of a disagreeing call is not marked invalid"
                            err = raised_by_check(ctx)
                        assert err is not None, f"no error on rank {ctx.rank}"
                        assert "whose ranks disagreed" in str(getattr(err, "__notes__", "")), err
                    else:
                        assert err is not None, f"no error on rank {ctx.rank} (it called with another input)"
                    assert raised_by_check(ctx) is None  # raised once
                    msg = str(err)
                    if name != "bad-input":
                        assert words in msg and "rank 0" in msg and others(ctx) in msg, msg
                    elif on_agreed:  # the error names the ranks that rejected their input
                        assert words in msg and (others(ctx) if left_on == "others" else "rank 0") in msg, msg
                    else:
                        assert "0-dim" in msg, msg
                    assert not fused(ctx)  # every rank forgot the schedule
                    with scratch_posts() as seen:
                        assert_same(all_gather(agreed(ctx.device), ctx.group), torch.ones(4 * ctx.world, 3))
                    assert seen == []
                    in_step(ctx)
                    in_step(ctx)
                out.append((f"fused-disagree-{name}-left-on-{left_on}-{mode}", run))

    def invalid_results(ctx):
        """A rank leaves a fused schedule of each format: the others' results are marked invalid, every
        scale NaN (and NVFP4 amax NaN), integer data left as it came (there is no NaN to mark it)."""
        for fmt in ("mxfp8", "nvfp4", "fp8_block_1x128", "fp8_block_128x128", "int32"):
            pyxfer.check_gathers(ctx.group)
            state(ctx).reset()
            shape = (128, 128) if fmt.startswith("fp8") else (32, 64)
            full = full_tensor(ctx, shape, torch.bfloat16, ctx.gen())
            if fmt == "int32":
                x = shard_of(ctx, full).to(torch.int32).to(ctx.device)
            else:
                opts = {"global_amax": float(full.float().abs().max())} if fmt == "nvfp4" else {}
                x = formats.quantize(shard_of(ctx, full).to(ctx.device), fmt, rowwise=True, columnwise=True, **opts)
            for _ in range(2):
                all_gather(x, ctx.group)
            assert fused(ctx)
            odd = torch.ones(3, device=ctx.device)
            if ctx.rank == ctx.world - 1:
                try:
                    all_gather(odd, ctx.group)
                except ValueError as e:
                    assert f"rank {ctx.world - 1}" in str(e), e
                else:
                    raise AssertionError("no error")
                continue
            got = all_gather(x, ctx.group)
            if fmt != "int32":
                assert is_marked_invalid(got), fmt
            err = raised_by_check(ctx)
            assert isinstance(err, ValueError) and f"rank {ctx.world - 1}" in str(err), (fmt, err)
        in_step(ctx)
    out.append(("fused-invalid-results-are-marked", invalid_results))

    def nvfp4_renormalised(ctx):
        """NVFP4 QuantizedTensor shards each quantized with its own amax, fused: the gathered shards are
        renormalised in the native call (each decoded with its own amax, the whole requantized with the
        largest), bit-identical to dequantize -> gather -> quantize; the warning comes when the host next
        reads a verdict. Shards with one common amax are left as gathered."""
        for row, col in ((True, False), (False, True), (True, True)):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                pyxfer.check_gathers(ctx.group)
                state(ctx).reset()
                for i in range(4):
                    full = full_tensor(ctx, (32, 64), dtype, ctx.gen(), spread=True)
                    common = {"global_amax": float(full.float().abs().max())} if i == 2 else {}  # one amax
                    qs = [formats.quantize(shard_of(ctx, full, r), "nvfp4", rowwise=row, columnwise=col, **common)
                          for r in range(ctx.world)]
                    q = qs[ctx.rank]._rebuild(**{n: b.to(ctx.device) for n, b in qs[ctx.rank].buffers().items()})
                    pyxfer.gather.errors._warned.clear()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        got = gather(ctx, q, async_op=i == 3)
                        pyxfer.check_gathers(ctx.group)
                    hp = torch.cat([t.dequantize() for t in qs])
                    amaxes = [float(t.buffers()["amax_rowwise" if row else "amax_columnwise"]) for t in qs]
                    if len(set(amaxes)) > 1:
                        want = formats.quantize(hp, "nvfp4", rowwise=row, columnwise=col, global_amax=max(amaxes))
                        ours = [w for w in caught if issubclass(w.category, QuantizedGatherFallbackWarning)]
                        assert ours and "different global amax" in str(ours[0].message), (i, [str(w.message)
                                                                                             for w in caught])
                    else:
                        want = formats.quantize(full, "nvfp4", rowwise=row, columnwise=col, global_amax=amaxes[0])
                    assert_same(got, want, f"nvfp4 {row} {col} {dtype} call {i}")
                    assert fused(ctx) == (i >= 1), (i, fused(ctx))
    out.append(("fused-nvfp4-different-amax-renormalised", nvfp4_renormalised))

    def last_gather_checked(ctx):
        """The last gather of a program, where rank 0 left the schedule: check_gathers raises it on the
        others (their result marked invalid), once; async too (its wait() or check_gathers)."""
        for asyn in (False, True):
            full = full_tensor(ctx, (8, 4), torch.float32, ctx.gen())
            x = shard_of(ctx, full).to(ctx.device)
            for _ in range(3):
                assert_same(gather(ctx, x), full)
            y = x if ctx.rank else x.to(torch.float64)
            try:
                got = all_gather(y, ctx.group, async_op=asyn)
                if asyn:
                    got = got.wait()
                err = None
            except ValueError as e:
                err = e
            if ctx.rank == 0:
                assert err is not None and "dtype" in str(err), err
            elif err is None:
                assert is_marked_invalid(got)
                err = raised_by_check(ctx)
                assert isinstance(err, ValueError) and "dtype" in str(err), err
            assert raised_by_check(ctx) is None
            in_step(ctx)
    out.append(("fused-last-gather-checked", last_gather_checked))

    def strict_agrees(ctx):
        """strict=True on calls that agree: exact results, fused, nothing raised."""
        full = full_tensor(ctx, (16, 8), torch.float32, ctx.gen())
        x = shard_of(ctx, full).to(ctx.device)
        for i in range(4):
            assert_same(gather(ctx, x * i, strict=True, async_op=i == 3), full * i)
        assert fused(ctx)
        assert raised_by_check(ctx) is None
    out.append(("fused-strict-agreeing", strict_agrees))
    return out


def stream_cases():
    """The waiting protocol writes the record's device values (NVFP4 amax) on a side stream, which must
    wait for the caller's stream, where they are made: each call here is queued behind a long kernel on
    the caller's stream (CUDA) and its data differ from the previous call's."""
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

