"""One rank of a pyxfer.all_gather test group: runs every case of ``cases(world)`` in order and
appends one JSON line per case ({"case", "ok", "error"}) to its output file, so a hang is localised.

Spawned by tests/test_gather.py (gloo, CPU) and tests/test_gather_gpu.py (NCCL, one GPU per rank):
    python gather_worker.py --rank R --world W --init file:///... --out DIR --seed S
        [--backend gloo|nccl] [--swap-devices]
Inputs are made on the CPU from a per-case seed shared by every rank, moved to the rank's device;
expected results are computed on the CPU in one process (quantize the full tensor), so a GPU run also
checks CUDA == CPU bit-exactness of every gathered buffer.
"""
import argparse
import contextlib
import datetime
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

import pyxfer
import pyxfer.gather.errors
from pyxfer import formats
from pyxfer.gather import GatherHandle, GatherVerificationError, QuantizedGatherFallbackWarning, all_gather
from pyxfer.testing import FAULT_KINDS, inject_fault

HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
USAGES = ((True, False), (False, True), (True, True))
PLAIN_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
# Shard shapes per format: quantizable ones, and ones that are not (M or K off the block).
QUANTIZABLE = {"fp8_block_1x128": [(128, 256), (2, 64, 128)], "fp8_block_128x128": [(128, 384), (256, 128)],
               "mxfp8": [(32, 64), (2, 16, 96)], "nvfp4": [(16, 64), (2, 8, 32)]}
NOT_QUANTIZABLE = {"fp8_block_1x128": [(64, 256), (128, 96)], "fp8_block_128x128": [(32, 128), (3, 20, 256)],
                   "mxfp8": [(16, 64), (8, 48)], "nvfp4": [(8, 32), (24, 40)]}


class Ctx:
    def __init__(self, rank, world, device, seed, group=None):
        self.rank, self.world, self.device, self.seed, self.group = rank, world, device, seed, group
        self.case_index = 0

    def gen(self):
        return torch.Generator().manual_seed(self.seed * 1000003 + self.case_index)


# ---- data and comparisons --------------------------------------------------------------------

def full_tensor(ctx, shard_shape, dtype, gen, spread=False):
    """The full (W*d0, ...) tensor, identical on every rank (CPU). ``spread``: each shard gets its own
    magnitude (so NVFP4 shard amaxes differ)."""
    shape = (ctx.world * shard_shape[0],) + tuple(shard_shape[1:])
    x = torch.randn(shape, generator=gen) * 3
    if spread:
        x = x * torch.arange(1, ctx.world + 1, dtype=torch.float32).repeat_interleave(shard_shape[0]).reshape(
            (-1,) + (1,) * (len(shape) - 1))
    return x.to(dtype)


def shard_of(ctx, full, rank=None):
    rank = ctx.rank if rank is None else rank
    d0 = full.shape[0] // ctx.world
    return full[rank * d0:(rank + 1) * d0]


def noncontig(t):
    """Same values, reversed memory layout (not contiguous for >= 2 dims)."""
    if t.dim() < 2:
        u = torch.empty((t.numel(), 2), dtype=t.dtype, device=t.device)[:, 0].reshape(t.shape)
        u.copy_(t)
        return u
    u = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).permute(*reversed(range(t.dim())))
    u.copy_(t)
    return u  # contiguous only where every dim but one has size 1


def qt_noncontig(q):
    """The same QuantizedTensor with every >= 2-D buffer non-contiguous."""
    return q._rebuild(**{n: noncontig(b) if b.dim() >= 2 else b for n, b in q.buffers().items()})


def raw(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def assert_same(got, want, what=""):
    """Bit-exact: same kind, shape, dtype; QuantizedTensors: same class, options, and every buffer."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        assert torch.equal(raw(got), raw(want)), f"{what}: values differ"
        return
    assert type(got) is type(want), f"{what}: got {type(got).__name__}, expected {type(want).__name__}"
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape/dtype {got.shape} {got.dtype}"
    assert got.options == want.options, f"{what}: options {got.options} != {want.options}"
    gb, wb = got.buffers(), want.buffers()
    assert sorted(gb) == sorted(wb), f"{what}: buffers {sorted(gb)} != {sorted(wb)}"
    for name in wb:
        assert gb[name].shape == wb[name].shape and gb[name].dtype == wb[name].dtype, \
            f"{what}: {name} {tuple(gb[name].shape)} {gb[name].dtype} != {tuple(wb[name].shape)} {wb[name].dtype}"
        assert torch.equal(raw(gb[name]), raw(wb[name])), f"{what}: {name} bytes differ"
        assert gb[name].device == got.device


def gather(ctx, x, *, async_op=False, **kw):
    """all_gather, through the handle when async (checking it is a GatherHandle)."""
    out = all_gather(x, ctx.group, async_op=async_op, **kw)
    if async_op:
        assert isinstance(out, GatherHandle), type(out)
        out = out.wait()
    return out


@contextlib.contextmanager
def expect_warning(expected, contains=()):
    pyxfer.gather.errors._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [w for w in caught if issubclass(w.category, QuantizedGatherFallbackWarning)]
    if not expected:
        assert not ours, f"unexpected fallback warning: {ours[0].message}"
        return
    assert len(ours) == 1, f"expected one QuantizedGatherFallbackWarning, got {[str(w.message) for w in ours]}"
    assert ours[0].filename == os.path.abspath(__file__) or ours[0].filename == __file__, ours[0].filename
    for text in contains:
        assert text in str(ours[0].message), f"{text!r} not in {ours[0].message}"


def nvfp4_opts(fmt, full):
    return {"global_amax": float(full.float().abs().max())} if fmt == "nvfp4" else {}


# ---- the format matrix ------------------------------------------------------------------------

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
        real_quantize, real_verify = formats.quantize, pyxfer.gather.queue_checks
        formats.quantize = lambda *a, **k: (calls.append("quantize"), real_quantize(*a, **k))[1]
        pyxfer.gather.queue_checks = lambda *a, **k: (calls.append("verify"), real_verify(*a, **k))[1]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", QuantizedGatherFallbackWarning)
                h = all_gather(q, ctx.group, async_op=True, verify=True)
            assert calls == [] and isinstance(h, GatherHandle)
            got = h.wait()
            assert got is h.wait() and h.is_completed()
        finally:
            formats.quantize, pyxfer.gather.queue_checks = real_quantize, real_verify
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


# ---- plain tensors ----------------------------------------------------------------------------

def plain_cases():
    out = []
    for dtype in PLAIN_DTYPES:
        def run(ctx, dtype=dtype):
            from tensors import random_tensor
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


# ---- verification and faults ------------------------------------------------------------------

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


# ---- fused mode: data and record in one collective once a group repeats its signature -----------

@contextlib.contextmanager
def scratch_posts():
    """Counts this rank's posts of scratch buffers (fused mode, a call with another signature)."""
    seen, original = [], pyxfer.gather.scratch_parts

    def counting(layout, *args):
        seen.append(len(layout))
        return original(layout, *args)
    pyxfer.gather.scratch_parts = counting
    try:
        yield seen
    finally:
        pyxfer.gather.scratch_parts = original


def fused_cases():
    """The first two calls of a signature wait for their records; from the third on, data and record
    travel in one collective and the records are checked afterwards. Repeats must give exact results;
    a new signature on every rank must work (one scratch gather); a rank that disagrees with ranks in
    fused mode must leave every rank with the same error, the group in step and still fused."""
    out = []

    def state(ctx):
        return pyxfer.gather._agreed(ctx.group or dist.group.WORLD)

    def in_step(ctx):
        y = torch.full((2,), float(ctx.rank), device=ctx.device)
        assert_same(all_gather(y, ctx.group), torch.arange(ctx.world).float().repeat_interleave(2))

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

        def stall():  # what follows runs late on the caller's stream
            if on_cuda:
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
    out = plain_cases() + matrix_cases() + quantized_cases() + fault_cases() + mismatch_cases() + \
        fused_cases() + stream_cases()
    return [(n, f) for n, f in out if world > 2 or n != "plain-subgroup-of-2"]


def case_names(world):
    return [name for name, _ in cases(world)]


# ---- main -------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--swap-devices", action="store_true")
    p.add_argument("--only", default=None, help="run only cases whose name contains this")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.backend == "nccl":
        gpu = (a.world - 1 - a.rank) if a.swap_devices else a.rank
        torch.cuda.set_device(a.rank)  # the current device is the rank's; data may live on another GPU
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    dist.init_process_group(a.backend, init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=60))
    ctx = Ctx(a.rank, a.world, device, a.seed)
    ctx.singletons = [dist.new_group([r]) for r in range(a.world)]
    ctx.pair = dist.new_group([0, 1]) if a.world > 2 else None
    todo = cases(a.world)
    with open(os.path.join(a.out, f"rank{a.rank}.jsonl"), "w") as log:
        for index, (name, fn) in enumerate(todo):
            ctx.case_index = index
            if a.only and a.only not in name:
                continue
            try:
                fn(ctx)
                record = {"case": name, "ok": True}
            except Exception:
                record = {"case": name, "ok": False, "error": traceback.format_exc(limit=6)}
            log.write(json.dumps(record) + "\n")
            log.flush()
    if a.backend == "nccl":
        torch.cuda.synchronize(device)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
