"""Gather cases: the format matrix (format x usage x quantizable or not x bf16/fp16/fp32 x
non-contiguous, with QuantizedTensor / quantize_as / requantized inputs, sync/async, verify on/off)
compared bit-exactly with quantizing the full tensor in one process; swizzled scales, dropped usages,
world size 1, NVFP4 amax handling, FP8 options, warnings, async post-processing."""
import warnings

import torch

import pyxfer.gather
import pyxfer.gather.errors
from pyxfer import formats
from pyxfer.gather import GatherHandle, QuantizedGatherFallbackWarning, all_gather
from pyxfer.testing import inject_fault

from support.gather_harness import (
    HP_DTYPES,
    NOT_QUANTIZABLE,
    QUANTIZABLE,
    USAGES,
    assert_same,
    expect_warning,
    full_tensor,
    gather,
    noncontig,
    nvfp4_opts,
    qt_noncontig,
    shard_of,
)


def matrix_cases():
    """fmt x usage x quantizable shard x dtype x non-contiguous; the input kind (QuantizedTensor,
    quantize_as, QuantizedTensor of another format + quantize_as), sync/async and verify rotate."""
    out = []
    i = 0
    for fmt in formats.FORMATS:
        for row, col in USAGES:
            for quantizable in (True, False):
                for dtype in HP_DTYPES:
                    for nc in (False, True):
                        kinds = ["qt", "spec", "requant"]
                        if not quantizable and fmt in ("mxfp8", "nvfp4"):
                            kinds = ["spec", "requant"]  # such a shard cannot be a QuantizedTensor of fmt
                        kind = kinds[i % len(kinds)]
                        shapes = QUANTIZABLE[fmt] if quantizable else NOT_QUANTIZABLE[fmt]
                        shape = shapes[(i // 3) % len(shapes)]
                        asyn, verify = bool(i % 2), bool((i // 2) % 2)
                        name = (f"matrix-{fmt}-{'row' if row else ''}{'col' if col else ''}-"
                                f"{'q' if quantizable else 'nq'}-{str(dtype)[6:]}-{'nc' if nc else 'c'}-{kind}-"
                                f"{'x'.join(map(str, shape))}-{'async' if asyn else 'sync'}-{'v' if verify else 'nv'}")
                        out.append((name, _matrix_case(fmt, row, col, shape, dtype, nc, kind, asyn, verify)))
                        i += 1
    return out


def _matrix_case(fmt, row, col, shape, dtype, nc, kind, asyn, verify):
    def run(ctx):
        full = full_tensor(ctx, shape, dtype, ctx.gen())
        shards = [shard_of(ctx, full, r) for r in range(ctx.world)]
        opts = nvfp4_opts(fmt, full)
        spec = formats.QuantizeSpec(fmt, rowwise=row, columnwise=col, **opts)
        full_shape = tuple(full.shape)
        if kind == "qt":
            qs = [formats.quantize(s, fmt, rowwise=row, columnwise=col, **opts) for s in shards]
            x = qs[ctx.rank]._rebuild(**{n: b.to(ctx.device) for n, b in qs[ctx.rank].buffers().items()})
            x = qt_noncontig(x) if nc else x
            kw = {}
            if formats.is_quantizable(shape, fmt):
                want, warn = formats.quantize(full, fmt, rowwise=row, columnwise=col, **opts), False
            else:
                hp = torch.cat([q.dequantize() for q in qs])
                want = formats.quantize(hp, fmt, rowwise=row, columnwise=col, **opts) \
                    if formats.is_quantizable(full_shape, fmt) else hp
                warn = True
        else:
            if kind == "spec":
                x = shards[ctx.rank].to(ctx.device)
                hp_src = full
            else:  # a QuantizedTensor of another format, requantized locally to the spec
                other = "fp8_block_128x128" if fmt == "fp8_block_1x128" else "fp8_block_1x128"
                qs = [formats.quantize(s, other, rowwise=True, columnwise=True) for s in shards]
                x = qs[ctx.rank]._rebuild(**{n: b.to(ctx.device) for n, b in qs[ctx.rank].buffers().items()})
                hp_src = torch.cat([q.dequantize() for q in qs])
                spec = formats.QuantizeSpec(fmt, rowwise=row, columnwise=col)  # NVFP4: the group's amax
            if kind == "spec":
                x = noncontig(x) if nc else x
            else:
                x = qt_noncontig(x) if nc else x
            kw = {"quantize_as": spec}
            warn = not formats.is_quantizable(shape, fmt)
            want = spec.quantize(hp_src) if formats.is_quantizable(full_shape, fmt) else hp_src
        with expect_warning(warn, contains=("multiple of",) if warn else ()):
            got = gather(ctx, x, async_op=asyn, verify=verify, **kw)
        assert_same(got, want, "gathered")
    return run


# ---- more quantized cases --------------------------------------------------------------------

def quantized_cases():
    out = []

    def case(name):
        def deco(fn):
            out.append((name, fn))
            return fn
        return deco

    for fmt in ("mxfp8", "nvfp4"):
        for row, col in USAGES:
            @case(f"swizzled-input-{fmt}-{int(row)}{int(col)}")
            def _(ctx, fmt=fmt, row=row, col=col):
                full = full_tensor(ctx, QUANTIZABLE[fmt][1], torch.bfloat16, ctx.gen())
                opts = {**nvfp4_opts(fmt, full), "gemm_swizzled_scales": True}
                q = formats.quantize(shard_of(ctx, full).to(ctx.device), fmt, rowwise=row, columnwise=col, **opts)
                assert q.gemm_swizzled_scales
                got = gather(ctx, q, verify=True)
                assert_same(got, formats.quantize(full, fmt, rowwise=row, columnwise=col, **opts))

            @case(f"swizzled-spec-{fmt}-{int(row)}{int(col)}")
            def _(ctx, fmt=fmt, row=row, col=col):
                full = full_tensor(ctx, QUANTIZABLE[fmt][0], torch.float16, ctx.gen())
                spec = formats.QuantizeSpec(fmt, rowwise=row, columnwise=col, gemm_swizzled_scales=True)
                got = gather(ctx, shard_of(ctx, full).to(ctx.device), quantize_as=spec, async_op=True)
                assert_same(got, spec.quantize(full))

    for fmt in formats.FORMATS:
        @case(f"drop-usage-{fmt}")
        def _(ctx, fmt=fmt):
            full = full_tensor(ctx, QUANTIZABLE[fmt][0], torch.bfloat16, ctx.gen())
            opts = nvfp4_opts(fmt, full)
            q = formats.quantize(shard_of(ctx, full).to(ctx.device), fmt, rowwise=True, columnwise=True, **opts)
            for row, col in ((True, False), (False, True)):
                spec = formats.QuantizeSpec(fmt, rowwise=row, columnwise=col, **opts)
                with expect_warning(False):
                    got = gather(ctx, q, quantize_as=spec, verify=True)
                assert_same(got, spec.quantize(full))

        @case(f"world-one-{fmt}")
        def _(ctx, fmt=fmt):
            group = ctx.singletons[ctx.rank]
            full = full_tensor(ctx, QUANTIZABLE[fmt][0], torch.float32, ctx.gen())
            x = shard_of(ctx, full).to(ctx.device)
            assert all_gather(x, group) is x
            q = formats.quantize(x, fmt)
            assert all_gather(q, group, verify=True) is q
            spec = formats.QuantizeSpec(fmt, rowwise=False, columnwise=True)
            got = all_gather(x, group, quantize_as=spec, async_op=True).wait()
            assert_same(got, spec.quantize(shard_of(ctx, full)))
            assert_same(all_gather(q, group, quantize_as=spec), spec.quantize(q.dequantize().cpu()))
            nq = x[:, :8]  # not quantizable: returned as is
            assert all_gather(nq, group, quantize_as=spec) is nq

    for row, col in USAGES:
        @case(f"nvfp4-amax-differs-{int(row)}{int(col)}")
        def _(ctx, row=row, col=col):
            full = full_tensor(ctx, (32, 64), torch.bfloat16, ctx.gen(), spread=True)
            qs = [formats.quantize(shard_of(ctx, full, r), "nvfp4", rowwise=row, columnwise=col)
                  for r in range(ctx.world)]  # each with its own amax
            q = qs[ctx.rank]._rebuild(**{n: b.to(ctx.device) for n, b in qs[ctx.rank].buffers().items()})
            with expect_warning(True, contains=("different global amax", "rank 0")):
                got = gather(ctx, q, verify=True, async_op=row)
            hp = torch.cat([q.dequantize() for q in qs])
            amax = max(float(q.buffers()["amax_rowwise" if row else "amax_columnwise"]) for q in qs)
            assert_same(got, formats.quantize(hp, "nvfp4", rowwise=row, columnwise=col, global_amax=amax))

    @case("nvfp4-spec-given-amax")
    def _(ctx):
        full = full_tensor(ctx, (16, 32), torch.float32, ctx.gen())
        spec = formats.QuantizeSpec("nvfp4", rowwise=True, columnwise=True, global_amax=100.0)
        assert_same(gather(ctx, shard_of(ctx, full).to(ctx.device), quantize_as=spec, verify=True),
                    spec.quantize(full))

    @case("fp8-options")
    def _(ctx):
        for fmt in ("fp8_block_1x128", "fp8_block_128x128"):
            for opts in ({"pow2_scales": False}, {"amax_epsilon": 1e-3}, {"fp8_dtype": torch.float8_e5m2}):
                full = full_tensor(ctx, QUANTIZABLE[fmt][0], torch.bfloat16, ctx.gen())
                q = formats.quantize(shard_of(ctx, full).to(ctx.device), fmt, rowwise=True, columnwise=True, **opts)
                assert_same(gather(ctx, q, verify=True), formats.quantize(full, fmt, rowwise=True, columnwise=True,
                                                                          **opts))

    @case("mxfp8-e5m2")
    def _(ctx):
        full = full_tensor(ctx, (64, 32), torch.float16, ctx.gen())
        spec = formats.QuantizeSpec("mxfp8", rowwise=True, columnwise=True, fp8_dtype=torch.float8_e5m2)
        assert_same(gather(ctx, shard_of(ctx, full).to(ctx.device), quantize_as=spec), spec.quantize(full))

    @case("fallback-warns-once-per-call-site")
    def _(ctx):
        pyxfer.gather.errors._warned.clear()
        full = full_tensor(ctx, (64, 128), torch.bfloat16, ctx.gen())
        q = formats.quantize(shard_of(ctx, full).to(ctx.device), "fp8_block_1x128")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                all_gather(q, ctx.group)  # one call site
            all_gather(q, ctx.group)      # another
        ours = [w for w in caught if w.category is QuantizedGatherFallbackWarning]
        assert len(ours) == 2, [str(w.message) for w in ours]
        assert ours[0].filename == __file__ and ours[0].lineno != ours[1].lineno
        assert "64 are not a multiple of 128" in str(ours[0].message), ours[0].message

    @case("async-post-processing-only-in-wait")
    def _(ctx):
        # fp8 1x128 shards of 64 rows: fallback, requantized when W*64 is a multiple of 128 (W = 2, 4)
        full = full_tensor(ctx, (64, 128), torch.bfloat16, ctx.gen())
        q = formats.quantize(shard_of(ctx, full).to(ctx.device), "fp8_block_1x128", columnwise=True)
        calls = []
        real_quantize, real_verify = formats._quantize, pyxfer.gather.queue_checks  # what quantize and the gather call
        formats._quantize = lambda *a, **k: (calls.append("quantize"), real_quantize(*a, **k))[1]
        pyxfer.gather.queue_checks = lambda *a, **k: (calls.append("verify"), real_verify(*a, **k))[1]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", QuantizedGatherFallbackWarning)
                h = all_gather(q, ctx.group, async_op=True, verify=True)
            assert calls == [] and isinstance(h, GatherHandle)
            got = h.wait()
            assert got is h.wait() and h.is_completed()
        finally:
            formats._quantize, pyxfer.gather.queue_checks = real_quantize, real_verify
        requantized = ctx.world * 64 % 128 == 0
        assert calls == (["verify", "quantize"] if requantized else ["verify"]), calls
        hp = torch.cat([formats.quantize(shard_of(ctx, full, r), "fp8_block_1x128", columnwise=True).dequantize()
                        for r in range(ctx.world)])
        want = formats.quantize(hp, "fp8_block_1x128", columnwise=True) if requantized else hp
        assert_same(got, want)
        # the fault is applied in wait(), after the data arrived: before it, nothing was touched
        src = (ctx.rank + 1) % ctx.world
        x = shard_of(ctx, full_tensor(ctx, (4, 8), torch.float32, ctx.gen())).to(ctx.device)
        with inject_fault("zeros", src=src, path="gather") as f:
            h = all_gather(x + 1, ctx.group, async_op=True)
            assert f.unused is None and f.times == 1
            h.wait()
        assert f.used == 1

    return out


def cases(world):
    return matrix_cases() + quantized_cases()
