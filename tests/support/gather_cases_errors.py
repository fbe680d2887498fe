"""Gather cases: shards corrupted in transit (caught by verify, let through without it),
disagreements across ranks (the same clear error on every rank, no hang, the group still usable),
a call inside torch's coalescing manager."""
import warnings

import torch
import torch.distributed as dist

import pyxfer.gather
import pyxfer.gather.engine
import pyxfer.gather.plan
from pyxfer import formats
from pyxfer.gather import GatherVerificationError, QuantizedGatherFallbackWarning, all_gather
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.gather_harness import QUANTIZABLE, assert_same, full_tensor, gather, in_step, nvfp4_opts, shard_of


def fault_cases():
    out = []
    targets = [("plain", "data"), ("fp8_block_1x128", "rowwise_scale_inv"), ("fp8_block_1x128", "columnwise_data"),
               ("fp8_block_128x128", "columnwise_scale_inv"), ("mxfp8", "rowwise_data"),
               ("mxfp8", "columnwise_scale_inv"), ("nvfp4", "columnwise_data"), ("nvfp4", "rowwise_scale_inv"),
               ("spec-nvfp4", "rowwise_data"), ("fallback", "data")]
    for i, (what, buffer) in enumerate(targets):
        kind = FAULT_KINDS[i % len(FAULT_KINDS)]

        def run(ctx, what=what, buffer=buffer, kind=kind):
            src, dst = ctx.world - 1, 0  # rank W-1's shard, corrupted on rank 0
            if what == "plain":
                full = torch.randn(ctx.world * 33, 17, generator=ctx.gen())
                make = lambda: (shard_of(ctx, full).to(ctx.device), {}, full)  # noqa: E731
            elif what == "fallback":
                full = full_tensor(ctx, (64, 128), torch.float32, ctx.gen())
                make = lambda: (shard_of(ctx, full).to(ctx.device),  # noqa: E731
                                {"quantize_as": formats.QuantizeSpec("fp8_block_1x128")}, None)
            elif what == "spec-nvfp4":  # hashes travel with the data (made after the amax exchange)
                full = full_tensor(ctx, (32, 64), torch.bfloat16, ctx.gen())
                spec = formats.QuantizeSpec("nvfp4", columnwise=True)
                make = lambda: (shard_of(ctx, full).to(ctx.device), {"quantize_as": spec}, spec.quantize(full))  # noqa
            else:
                full = full_tensor(ctx, QUANTIZABLE[what][0], torch.bfloat16, ctx.gen())
                opts = nvfp4_opts(what, full)
                q = formats.quantize(shard_of(ctx, full).to(ctx.device), what, rowwise=True, columnwise=True, **opts)
                make = lambda: (q, {}, formats.quantize(full, what, rowwise=True, columnwise=True, **opts))  # noqa
            for verify in (True, False):
                for asyn in (False, True):
                    x, kw, want = make()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", QuantizedGatherFallbackWarning)
                        with inject_fault(kind, src=src, dst=dst, path="gather", buffer=buffer) as f:
                            try:
                                got = gather(ctx, x, async_op=asyn, verify=verify, **kw)
                                error = None
                            except GatherVerificationError as e:
                                error = e
                    assert f.used == (1 if ctx.rank == dst else 0), (f.used, ctx.rank)
                    if ctx.rank != dst:
                        assert error is None, error
                        if want is not None:
                            assert_same(got, want)
                    elif verify:
                        assert error is not None, "verify=True let a corrupted shard through"
                        assert (error.src_rank, error.rank, error.buffer) == (src, dst, buffer), \
                            (error.src_rank, error.rank, error.buffer)
                        assert error.expected != error.actual and f"rank {src}" in str(error)
                        assert isinstance(error, RuntimeError)
                    else:  # the fault is real: without verify the wrong bytes come through
                        assert error is None
                        if want is not None:
                            try:
                                assert_same(got, want)
                            except AssertionError:
                                continue
                            raise AssertionError("the injected fault did not change the result")
        out.append((f"fault-{kind}-{what}-{buffer}", run))
    return out


# ---- disagreements across ranks ---------------------------------------------------------------

def mismatch_cases():
    """Every rank must raise the same clear ValueError (field and ranks named), nothing hangs, and
    the group stays usable (a plain gather follows each error)."""
    out = []

    def mk(ctx, fn):
        """Rank 0 gets a different input than the others."""
        return fn(ctx.rank == 0)

    variants = {
        "dim0": (lambda odd, d: torch.ones(5 if odd else 4, 3, device=d), {}, "dim 0"),
        "shape1": (lambda odd, d: torch.ones(4, 3 if odd else 2, device=d), {}, "shape[1:]"),
        "ndim": (lambda odd, d: torch.ones(4, 3, 1, device=d) if odd else torch.ones(4, 3, device=d), {}, "ndim"),
        "dtype": (lambda odd, d: torch.ones(4, 3, dtype=torch.float16 if odd else torch.float32, device=d), {},
                  "dtype"),
        "kind": (lambda odd, d: formats.quantize(torch.ones(32, 32, device=d), "mxfp8") if odd
                 else torch.ones(32, 32, device=d), {}, "input kind"),
        "format": (lambda odd, d: formats.quantize(torch.ones(32, 32, device=d), "mxfp8" if odd else "nvfp4"), {},
                   "format"),
        "usage": (lambda odd, d: formats.quantize(torch.ones(32, 32, device=d), "mxfp8", rowwise=not odd,
                                                  columnwise=odd), {}, "rowwise usage"),
        "fp8-dtype": (lambda odd, d: formats.quantize(torch.ones(128, 128, device=d), "fp8_block_1x128",
                                                      fp8_dtype=torch.float8_e5m2 if odd else torch.float8_e4m3fn),
                      {}, "fp8_dtype"),
        "pow2": (lambda odd, d: formats.quantize(torch.ones(128, 128, device=d), "fp8_block_128x128",
                                                 pow2_scales=not odd), {}, "pow2_scales"),
        "swizzled": (lambda odd, d: formats.quantize(torch.ones(128, 32, device=d), "mxfp8",
                                                     gemm_swizzled_scales=odd), {}, "gemm_swizzled_scales"),
        "spec-format": (lambda odd, d: torch.ones(32, 32, device=d),
                        lambda odd: {"quantize_as": formats.QuantizeSpec("mxfp8" if odd else "nvfp4")}, "format"),
        "spec-amax": (lambda odd, d: torch.ones(32, 32, device=d),
                      lambda odd: {"quantize_as": formats.QuantizeSpec("nvfp4", global_amax=2.0 if odd else 1.0)},
                      "global_amax"),
        "verify": (lambda odd, d: torch.ones(4, 3, device=d), lambda odd: {"verify": odd}, "verify"),
        "bad-input-on-one-rank": (lambda odd, d: torch.ones((), device=d) if odd else torch.ones(4, device=d), {},
                                  "rejected its input"),
    }
    for name, (make, kw, field) in variants.items():
        def run(ctx, make=make, kw=kw, field=field, name=name):
            odd = ctx.rank == 0
            x = make(odd, ctx.device)
            kwargs = kw(odd) if callable(kw) else kw
            try:
                all_gather(x, ctx.group, **kwargs)
            except (ValueError, TypeError) as e:
                msg = str(e)
                if name == "bad-input-on-one-rank" and odd:
                    assert "0-dim" in msg, msg
                else:
                    assert field in msg and "rank 0" in msg, msg
                    if name != "bad-input-on-one-rank":
                        others = "rank 1" if ctx.world == 2 else f"ranks {', '.join(map(str, range(1, ctx.world)))}"
                        assert others in msg, msg
            else:
                raise AssertionError("no error raised")
            y = torch.full((2,), float(ctx.rank), device=ctx.device)  # the group is still in step
            assert_same(all_gather(y, ctx.group), torch.arange(ctx.world).float().repeat_interleave(2))
        out.append((f"mismatch-{name}", run))

    def inside_coalescing(ctx):
        from torch.distributed import distributed_c10d as c10d
        x = torch.ones(2, device=ctx.device)
        group = ctx.group or dist.group.WORLD
        try:
            with dist._coalescing_manager(group=group, async_ops=True):
                all_gather(x, ctx.group)
        except RuntimeError as e:
            assert "_coalescing_manager" in str(e), e
        else:
            raise AssertionError("no error")
        finally:  # torch's manager has no try/finally: an exception leaves the group "coalescing"
            c10d._world.pg_coalesce_state.pop(group, None)
        assert_same(all_gather(x, ctx.group), torch.ones(2 * ctx.world))
    out.append(("inside-coalescing-manager", inside_coalescing))
    return out


# ---- a failure on one rank after the records agreed -------------------------------------------

class Injected(RuntimeError):
    pass


def _fail_once(real):
    calls = []

    def failing(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise Injected("injected failure")
        return real(*args, **kwargs)
    return failing


# step: (module, function that fails, what the step is called, input maker, gather kwargs)
_STEPS = {
    "build": (pyxfer.gather.engine, "post", "building the send and receive buffers", "plain", {}),
    "nvfp4-quantize": (pyxfer.gather.plan, "quantize_with_group_amax", "quantizing with the group's NVFP4 global amax",
                       "bf16", {"quantize_as": formats.QuantizeSpec("nvfp4", columnwise=True)}),
    "build-verify": (pyxfer.gather.engine, "post", "building the send and receive buffers", "bf16",
                     {"quantize_as": formats.QuantizeSpec("nvfp4"), "verify": True}),
    "build-quantized": (pyxfer.gather.engine, "post", "building the send and receive buffers", "bf16",
                        {"quantize_as": formats.QuantizeSpec("mxfp8", rowwise=True, columnwise=True), "verify": True}),
}


def failure_after_agreement_cases():
    """A rank that fails after the records agreed (building its buffers, e.g. out of memory, the NVFP4
    quantize with the group's amax) posts the agreed collective with scratch buffers: it raises its
    own error (noting the step), every other rank a RuntimeError naming it and the step, nobody hangs
    (a rank waiting for a collective never posted would hit the group's timeout instead), and the
    group stays in step and usable (the same call succeeds next)."""
    out = []
    for i, (step, (module, fn_name, words, make, kwargs)) in enumerate(_STEPS.items()):
        for asyn in (False, True):
            def run(ctx, module=module, fn_name=fn_name, words=words, make=make, kwargs=kwargs, asyn=asyn, i=i):
                failing = (i + asyn) % ctx.world
                full = full_tensor(ctx, (32, 64), torch.bfloat16, ctx.gen())
                if make == "plain":
                    full = torch.arange(ctx.world * 7 * 5, dtype=torch.int32).reshape(ctx.world * 7, 5)
                x = shard_of(ctx, full).to(ctx.device)
                want = kwargs["quantize_as"].quantize(full) if "quantize_as" in kwargs else full
                rows = 9 + i  # a signature of its own: a waiting call, whatever the group did before
                extra = torch.zeros(rows, 3, device=ctx.device)
                assert_same(all_gather(extra, ctx.group), torch.zeros(ctx.world * rows, 3))
                real = getattr(module, fn_name)
                if ctx.rank == failing:
                    setattr(module, fn_name, _fail_once(real))
                try:
                    out_ = all_gather(x, ctx.group, async_op=asyn, **kwargs)
                    if asyn:
                        out_.wait()
                except Injected as e:
                    assert ctx.rank == failing, (ctx.rank, e)
                    assert any(f"rank {failing} failed while {words}" in n for n in e.__notes__), e.__notes__
                except RuntimeError as e:
                    assert ctx.rank != failing, e
                    assert f"rank {failing} while {words}" in str(e) and "after the ranks agreed" in str(e), e
                else:
                    raise AssertionError(f"no error raised on rank {ctx.rank}")
                finally:
                    setattr(module, fn_name, real)
                assert_same(gather(ctx, x, **kwargs), want)
                in_step(ctx)
            out.append((f"failure-after-agreement-{step}-{'async' if asyn else 'sync'}", run))
    return out


def cases(world):
    return fault_cases() + mismatch_cases() + failure_after_agreement_cases()
