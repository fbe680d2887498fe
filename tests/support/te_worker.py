"""One rank of a Transformer Engine gather test group (gloo, CPU): runs the cases of ``cases(world)``
named in ``--cases`` (all without it) and appends one JSON line per case to its output file
(gather_harness.run_cases).

Spawned by tests/integrations/test_transformer_engine.py (gather_harness.spawn_cases):
    python tests/support/te_worker.py --rank R --world W --init file:///... --out DIR --seed S [--cases FILE]
Every case calls TE's real ``gather_along_first_dim`` through the binding TE's modules use
(``transformer_engine.pytorch.module.linear.gather_along_first_dim``). Inputs come from a per-case
seed shared by every rank; the expected result is pyxfer.quantize of the full tensor (or the
high-precision full tensor), computed in this process.
"""
import argparse
import contextlib
import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for support.*
# E402 waived below: the helpers import from the sys.path set above, and TE only after the CPU device shim
import pyxfer  # noqa: E402
from pyxfer import formats  # noqa: E402
from pyxfer.integrations import transformer_engine as pyxfer_te  # noqa: E402

from support import te_shims as shims  # noqa: E402
from support.gather_harness import Ctx, full_tensor, noncontig, qt_noncontig, raw, run_cases, shard_of  # noqa: E402

shims.install_cpu_device()
import transformer_engine.pytorch.module.linear as te_linear  # noqa: E402
from transformer_engine.pytorch import DType  # noqa: E402
from transformer_engine.pytorch.quantized_tensor import Quantizer  # noqa: E402
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor  # noqa: E402
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor  # noqa: E402
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor  # noqa: E402
from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import Float8BlockwiseQTensorStorage  # noqa: E402
from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import MXFP8TensorStorage  # noqa: E402
from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import NVFP4TensorStorage  # noqa: E402

FAMILIES = ("fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4")
USAGES = ((True, False), (False, True), (True, True))
# Shard shapes: quantizable, and not (M or K off the block). With W = 3 the MXFP8 / NVFP4 gathered
# shapes of the second kind stay unquantizable (high-precision result), with W = 2 some become
# quantizable again (requantized result).
QUANTIZABLE = {"fp8_block_1x128": (128, 256), "fp8_block_128x128": (2, 64, 128), "mxfp8": (2, 16, 96),
               "nvfp4": (16, 64)}
NOT_QUANTIZABLE = {"fp8_block_1x128": (64, 130), "fp8_block_128x128": (3, 20, 256), "mxfp8": (16, 64),
                   "nvfp4": (8, 32)}
STORAGE = {"fp8_block_1x128": (Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage),
           "fp8_block_128x128": (Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage),
           "mxfp8": (MXFP8Tensor, MXFP8TensorStorage), "nvfp4": (NVFP4Tensor, NVFP4TensorStorage)}
TE_BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
              "amax_rowwise", "amax_columnwise")
SENTINEL = 0xA7


class RoundToHalf(Quantizer):
    """A quantizer of a kind TE has no gather for (its generic path): rounds to float16 on any device."""

    def __init__(self):
        super().__init__(rowwise=True, columnwise=False)
        self.internal = True

    def quantize_impl(self, t):
        return t.to(torch.float16)


# ---- TE objects --------------------------------------------------------------------------------

def quantizer(fmt, row, col, *, internal=False, swizzled=False, amax_group=None):
    if fmt.startswith("fp8_block"):
        q = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=row, columnwise=col,
                                 block_scaling_dim=1 if fmt == "fp8_block_1x128" else 2)
    elif fmt == "mxfp8":
        q = MXFP8Quantizer(DType.kFloat8E4M3, rowwise=row, columnwise=col)
    else:
        q = NVFP4Quantizer(rowwise=row, columnwise=col, with_amax_reduction=amax_group is not None,
                           amax_reduction_group=amax_group)
    q.internal = internal
    q.optimize_for_gemm = swizzled
    return q


def te_tensor(q, fmt, internal, **flags):
    """A pyxfer.formats tensor as a TE tensor built with TE's own constructors (shares buffers);
    ``flags``: more of the TE constructor's keyword arguments."""
    b = {name: getattr(q, name, None) for name in TE_BUFFERS}
    tq = quantizer(fmt, q.rowwise_usage, q.columnwise_usage, internal=internal)
    common = dict(rowwise_data=b["rowwise_data"], rowwise_scale_inv=b["rowwise_scale_inv"],
                  columnwise_data=b["columnwise_data"], columnwise_scale_inv=b["columnwise_scale_inv"],
                  quantizer=tq)
    if fmt.startswith("fp8_block"):
        extra = dict(fp8_dtype=DType.kFloat8E4M3, is_2D_scaled=fmt == "fp8_block_128x128")
    elif fmt == "mxfp8":
        extra = dict(fp8_dtype=DType.kFloat8E4M3, with_gemm_swizzled_scales=q.gemm_swizzled_scales)
    else:
        extra = dict(amax_rowwise=b["amax_rowwise"], amax_columnwise=b["amax_columnwise"],
                     fp4_dtype=DType.kFloat4E2M1, with_gemm_swizzled_scales=q.gemm_swizzled_scales)
    tensor_cls, storage_cls = STORAGE[fmt]
    if internal:
        return storage_cls(**common, **extra, **flags, fake_dtype=q.dtype)
    return tensor_cls(shape=tuple(q.shape), dtype=q.dtype, device=q.device, **common, **extra, **flags)


def assert_te_equal(got, want, tq, what):
    """``got`` (TE's return) is the TE class ``tq`` makes, with ``tq``'s quantizer class attached and
    every buffer bit-identical to ``want`` (a pyxfer.formats tensor), or ``want`` is a plain tensor."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{what}: expected the high-precision tensor, got {type(got).__name__}"
        assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}"
        assert torch.equal(raw(got), raw(want)), f"{what}: values differ"
        return
    fmt = want.fmt
    cls = STORAGE[fmt][1 if tq.internal else 0]
    assert type(got) is cls, f"{what}: got {type(got).__name__}, expected {cls.__name__}"
    assert type(got._quantizer) is type(tq), f"{what}: quantizer {type(got._quantizer).__name__}"
    assert tuple(got.size()) == tuple(want.shape), f"{what}: shape {tuple(got.size())} != {tuple(want.shape)}"
    assert got._dtype == want.dtype if tq.internal else got.dtype == want.dtype, f"{what}: nominal dtype"
    if fmt.startswith("fp8_block"):
        assert got._is_2D_scaled == (fmt == "fp8_block_128x128"), f"{what}: _is_2D_scaled"
    else:
        assert got._with_gemm_swizzled_scales == want.gemm_swizzled_scales, f"{what}: swizzle flag"
    for name in TE_BUFFERS:
        w, g = getattr(want, name, None), getattr(got, "_" + name, None)
        if w is None:
            assert g is None, f"{what}: {name} present, expected none"
            continue
        assert g is not None, f"{what}: {name} missing"
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}: {name} {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {w.dtype}"
        assert torch.equal(raw(g), raw(w)), f"{what}: {name} bytes differ"


def gather(x, group, **kw):
    """TE's gather through the binding TE's Linear module uses."""
    return te_linear.gather_along_first_dim(x, group, **kw)


def finish(out, handle, async_op, what):
    if async_op:
        assert handle is not None and callable(getattr(handle, "wait", None)), f"{what}: no async handle"
        handle.wait()
        handle.wait()  # a second wait is harmless, as with TE's handles
        assert handle.is_completed() is True, f"{what}: the handle is not completed after wait()"
    else:
        assert handle is None, f"{what}: sync call returned a handle"
    return out


# ---- the matrix (patched) -----------------------------------------------------------------------

def expected(fmt, row, col, full):
    """pyxfer.quantize of the full tensor, or the full tensor where its shape cannot be stored."""
    if fmt.startswith("fp8_block") or formats.is_quantizable(tuple(full.shape), fmt):
        return formats.quantize(full, fmt, rowwise=row, columnwise=col)
    return full


def requantized(qs, row=True, col=False):
    """What a gather of shards ``qs`` (pyxfer.formats tensors) gives when they cannot be gathered
    as they are: their values decoded shard by shard, requantized (NVFP4: with the largest amax)."""
    hp = torch.cat([q.dequantize() for q in qs])
    opts = {}
    if qs[0].fmt == "nvfp4":
        opts["global_amax"] = max(float(q.amax_rowwise if q.amax_rowwise is not None else q.amax_columnwise)
                                  for q in qs)
    return formats.quantize(hp, qs[0].fmt, rowwise=row, columnwise=col, **opts)


def matrix_cases():
    """format x usages x quantizable or not x input (high precision, TE quantized tensor; each with
    contiguous buffers or not) x sync / async; the dtype and internal (Storage) results rotate."""
    out, i = [], 0
    dtypes = (torch.bfloat16, torch.float32, torch.float16)
    for fmt in FAMILIES:
        for row, col in USAGES:
            for quantizable in (True, False):
                kinds = ["hp", "hp-nc", "te", "te-nc"]
                if not quantizable and fmt in ("mxfp8", "nvfp4"):
                    kinds = ["hp", "hp-nc"]  # such a shard cannot be a TE tensor of the format
                for kind in kinds:
                    for async_op in (False, True):
                        dtype, internal = dtypes[i % 3], bool((i // 3) % 2)
                        shape = QUANTIZABLE[fmt] if quantizable else NOT_QUANTIZABLE[fmt]
                        name = (f"matrix-{fmt}-{'row' if row else ''}{'col' if col else ''}-"
                                f"{'q' if quantizable else 'nq'}-{kind}-{'async' if async_op else 'sync'}-"
                                f"{str(dtype)[6:]}{'-internal' if internal else ''}")
                        out.append((name, _matrix_case(fmt, row, col, shape, kind, async_op, dtype, internal)))
                        i += 1
    return out


def _matrix_case(fmt, row, col, shape, kind, async_op, dtype, internal):
    def run(ctx):
        full = full_tensor(ctx, shape, dtype, ctx.gen())
        shards = [shard_of(ctx, full, r) for r in range(ctx.world)]
        tq = quantizer(fmt, row, col, internal=internal)
        want = expected(fmt, row, col, full)
        if kind.startswith("te"):
            qs = [formats.quantize(s, fmt, rowwise=row, columnwise=col,
                                   **({"global_amax": float(full.float().abs().max())} if fmt == "nvfp4" else {}))
                  for s in shards]
            x = te_tensor(qt_noncontig(qs[ctx.rank]) if kind == "te-nc" else qs[ctx.rank], fmt, internal)
            if not formats.is_quantizable(shape, fmt):  # FP8 block partial blocks: not gathered as they are
                want = requantized(qs, row, col)
        else:
            x = noncontig(shards[ctx.rank]) if kind == "hp-nc" else shards[ctx.rank].clone()
        before = x.clone() if kind.startswith("hp") else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pyxfer.QuantizedGatherFallbackWarning)
            res, handle = gather(x, ctx.group, async_op=async_op, quantizer=tq)
        got = finish(res, handle, async_op, "gather")
        assert_te_equal(got, want, tq, "gather")
        if before is not None:
            assert torch.equal(raw(x), raw(before)), "the input was modified"
    return run


def nvfp4_cases():
    """NVFP4 global amax: shards of different magnitude quantized by TE with their own amax (the
    gathered result is decoded shard by shard and requantized with the largest amax), and a
    quantizer reducing amax over a group larger than the gather group."""
    def own_amax(ctx):
        full = full_tensor(ctx, (16, 64), torch.bfloat16, ctx.gen(), spread=True)
        qs = [formats.quantize(shard_of(ctx, full, r), "nvfp4", rowwise=True, columnwise=True)
              for r in range(ctx.world)]
        tq = quantizer("nvfp4", True, True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pyxfer.QuantizedGatherFallbackWarning)
            got = finish(*gather(te_tensor(qs[ctx.rank], "nvfp4", False), ctx.group, quantizer=tq), False,
                         "own amax")
        assert_te_equal(got, requantized(qs, True, True), tq, "own amax")

    def reduction_group(async_op):
        def run(ctx):
            # Gather over ranks {0, 1}; amax reduced over the whole world (rank 2 holds the largest values).
            full = full_tensor(ctx, (16, 64), torch.bfloat16, ctx.gen(), spread=True)
            if ctx.rank not in (0, 1):
                amax = formats.global_amax(shard_of(ctx, full))
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # the reduction TE's quantizer asks for
                return
            tq = quantizer("nvfp4", True, True, amax_group=dist.group.WORLD)
            got = finish(*gather(shard_of(ctx, full).clone(), ctx.pair, async_op=async_op, quantizer=tq),
                         async_op, "reduction group")
            want = formats.quantize(full[:32], "nvfp4", rowwise=True, columnwise=True,
                                    global_amax=float(full.float().abs().max()))
            assert_te_equal(got, want, tq, "reduction group")
        return run

    def same_ranks(async_op):
        def run(ctx):
            # amax reduced over another group object of the gather group's ranks: the gathered
            # tensor's amax, which pyxfer's gather already has (no reduction of its own over that group).
            full = full_tensor(ctx, (16, 64), torch.bfloat16, ctx.gen(), spread=True)
            everyone = dist.new_group(list(range(ctx.world)))
            tq = quantizer("nvfp4", True, True, amax_group=everyone)
            reduced, original = [], dist.all_reduce
            dist.all_reduce = lambda tensor, *a, **kw: reduced.append(kw.get("group")) or original(tensor, *a, **kw)
            try:
                got = finish(*gather(shard_of(ctx, full).clone(), ctx.group, async_op=async_op, quantizer=tq),
                             async_op, "same ranks")
            finally:
                dist.all_reduce = original
            assert not [g for g in reduced if g is everyone], "an amax reduction over the gather group's ranks"
            assert_te_equal(got, formats.quantize(full, "nvfp4", rowwise=True, columnwise=True), tq, "same ranks")
        return run

    out = [("nvfp4-shard-amax-differs", own_amax)]
    out += [(f"nvfp4-amax-reduction-same-ranks-{'async' if a else 'sync'}", same_ranks(a)) for a in (False, True)]
    return out + [(f"nvfp4-amax-reduction-over-world-{'async' if a else 'sync'}", reduction_group(a))
                  for a in (False, True)]


def output_tensor_cases():
    """A caller's output_tensor (MXFP8 / NVFP4, 2.19+) is filled in place, sentinel overwritten."""
    def case(fmt, async_op):
        def run(ctx):
            shape = QUANTIZABLE[fmt]
            full = full_tensor(ctx, shape, torch.bfloat16, ctx.gen())
            tq = quantizer(fmt, True, True)
            gathered = (shape[0] * ctx.world,) + tuple(shape[1:])
            bufs = {a: t.fill_(SENTINEL) if t.dtype == torch.uint8 else t.fill_(float("nan"))
                    for a, t in tq.alloc_tensors(gathered, device="cpu").items()}
            meta = tq.create_metadata(gathered, dtype=torch.bfloat16)
            target = meta["cls"].__tensor_unflatten__(bufs, meta, gathered, None)
            res, handle = gather(shard_of(ctx, full).clone(), ctx.group, async_op=async_op, quantizer=tq,
                                 output_tensor=target)
            assert res is target, "output_tensor was not returned"
            finish(res, handle, async_op, "output_tensor")
            for a, t in bufs.items():
                assert getattr(res, a) is t, f"{a} was re-bound, not filled in place"
            assert_te_equal(res, formats.quantize(full, fmt, rowwise=True, columnwise=True), tq, "output_tensor")
        return run
    def mismatched(fmt, async_op):
        """An output_tensor allocated for rowwise only, gathered with a rowwise + columnwise quantizer:
        a ValueError naming the missing buffer, on every rank (sync: from the call; async: wait())."""
        def run(ctx):
            shape = QUANTIZABLE[fmt]
            full = full_tensor(ctx, shape, torch.bfloat16, ctx.gen())
            gathered = (shape[0] * ctx.world,) + tuple(shape[1:])
            row_only = quantizer(fmt, True, False)
            meta = row_only.create_metadata(gathered, dtype=torch.bfloat16)
            target = meta["cls"].__tensor_unflatten__(row_only.alloc_tensors(gathered, device="cpu"), meta, gathered,
                                                      None)
            sentinels = [t.view(torch.uint8).fill_(0x5A) for t in (target._rowwise_data, target._rowwise_scale_inv)]
            want = formats.quantize(full, fmt, rowwise=False, columnwise=True).columnwise_data
            message = (f"pyxfer.integrations.transformer_engine: output_tensor._columnwise_data must be "
                       f"{tuple(want.shape)} {want.dtype}, got None")
            try:
                res, handle = gather(shard_of(ctx, full).clone(), ctx.group, async_op=async_op,
                                     quantizer=quantizer(fmt, True, True), output_tensor=target)
                assert async_op and res is target, "a mismatched output_tensor was accepted"
                handle.wait()
            except ValueError as e:
                assert str(e) == message, f"{e} != {message}"
                assert all(bool((t == 0x5A).all()) for t in sentinels), "a refused output_tensor was half filled"
            else:
                raise AssertionError("a mismatched output_tensor was filled without an error")
        return run

    return [(f"output-tensor-{fmt}-{'async' if a else 'sync'}", case(fmt, a))
            for fmt in ("mxfp8", "nvfp4") for a in (False, True)] + \
        [(f"output-tensor-mismatched-{fmt}-{'async' if a else 'sync'}", mismatched(fmt, a))
         for fmt in ("mxfp8", "nvfp4") for a in (False, True)]


def verify_cases():
    """patch(verify=True): results unchanged; a shard corrupted in transit raises on the receiver."""
    def run(ctx):
        pyxfer_te.unpatch()
        try:
            pyxfer_te.patch(verify=True)
            full = full_tensor(ctx, QUANTIZABLE["mxfp8"], torch.bfloat16, ctx.gen())
            tq = quantizer("mxfp8", True, True)
            got, _ = gather(shard_of(ctx, full).clone(), ctx.group, quantizer=tq)
            assert_te_equal(got, formats.quantize(full, "mxfp8", rowwise=True, columnwise=True), tq, "verify")
            with pyxfer.testing.inject_fault("bitflip", path="gather", src=1, dst=0):
                try:
                    gather(shard_of(ctx, full).clone(), ctx.group, quantizer=tq)
                except pyxfer.GatherVerificationError:
                    assert ctx.rank == 0, "a rank that received good data raised"
                else:
                    assert ctx.rank != 0, "rank 0 received a corrupted shard and did not raise"
        finally:
            pyxfer_te.unpatch()
            pyxfer_te.patch()
    return [("verify-true", run)]


def delegated_cases():
    """What pyxfer does not implement goes to TE's own code: NVFP4 with RHT (whose TE kernel needs a
    GPU, so reaching it shows as TE's CUDA error, not a pyxfer result), and through handed_to_te each
    TE-only quantizer option, a quantizer with no usage, a dtype pyxfer does not quantize, and TE
    tensors flagged with an encoding pyxfer does not decode."""
    def run(ctx):
        tq = NVFP4Quantizer(rowwise=True, columnwise=False, with_rht=True, with_post_rht_amax=True)
        x = torch.randn((16, 64), generator=ctx.gen()).bfloat16()
        try:
            gather(x, ctx.group, quantizer=tq)
        except Exception as e:  # TE's quantize kernel
            assert "pyxfer" not in str(e), f"pyxfer handled an RHT quantizer: {e}"
        else:
            raise AssertionError("an RHT quantizer produced a result on a machine without a GPU")
    return [("delegated-nvfp4-rht", run)] + [(f"delegated-{name}", handed_to_te(make)) for name, make in (
        ("nvfp4-stochastic-rounding", _hp_input(NVFP4Quantizer, stochastic_rounding=True)),
        ("nvfp4-2d", _hp_input(NVFP4Quantizer, with_2d_quantization=True)),
        ("nvfp4-row-scaled", _hp_input(NVFP4Quantizer, row_scaled_nvfp4=True)),
        ("nvfp4-4over6", _hp_input(NVFP4Quantizer, nvfp4_use_4over6=True)),
        ("mxfp8-2d", _hp_input(MXFP8Quantizer, DType.kFloat8E4M3, with_2d_quantization=True)),
        ("fp8block-scaling-dim-3", _hp_input(Float8BlockQuantizer, DType.kFloat8E4M3, block_scaling_dim=3)),
        ("no-usage", _hp_input(MXFP8Quantizer, DType.kFloat8E4M3, rowwise=False, columnwise=False)),
        ("float64-input", _hp_input(MXFP8Quantizer, DType.kFloat8E4M3, dtype=torch.float64)),
        ("nvfp4-4over6-input", _nvfp4_flagged_input(nvfp4_use_4over6=True)),
        ("nvfp4-row-scaled-input", _nvfp4_flagged_input(row_scaled_nvfp4=True)),
    )]


@contextlib.contextmanager
def pyxfer_gathers():
    """Within the block, the quantize_as of every pyxfer.all_gather the integration starts (each runs)."""
    calls, original = [], pyxfer_te.all_gather

    def record(*args, **kwargs):
        calls.append(kwargs.get("quantize_as"))
        return original(*args, **kwargs)

    pyxfer_te.all_gather = record
    try:
        yield calls
    finally:
        pyxfer_te.all_gather = original


def _outcome(call):
    """What a gather call gives, as comparable values: the result's class, size and every buffer's
    bytes (after wait() where there is a handle), or the exception's class and message."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, handle = call()
            if handle is not None:
                handle.wait()
    except Exception as e:
        return ("raised", type(e).__name__, str(e))
    if type(out) is torch.Tensor:
        return ("tensor", out.dtype, tuple(out.shape), raw(out).numpy().tobytes())
    buffers = {name: getattr(out, "_" + name, None) for name in TE_BUFFERS}
    shape = tuple(out.size()) if buffers["rowwise_data"] is not None or buffers["columnwise_data"] is not None \
        else None  # a TE tensor without data (no usage) has no size
    return (type(out).__name__, shape, {name: raw(b).numpy().tobytes() for name, b in buffers.items() if b is not None})


def handed_to_te(make_call):
    """A call pyxfer does not implement (``make_call(ctx)`` gives it) goes to TE's own code unchanged:
    patched, pyxfer.all_gather never runs and the outcome (result bytes, or the exception) is that of
    unpatched TE on the same input; both through shims.unpatched_te_on_cpu, TE's CPU stand-ins."""
    def run(ctx):
        call = make_call(ctx)
        # TE allocates its outputs with torch.empty (NVFP4 scale padding stays as it was): deterministic
        # mode fills uninitialized memory, so both outcomes compare byte for byte.
        saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with shims.unpatched_te_on_cpu(), pyxfer_gathers() as calls:
                patched = _outcome(call)
            pyxfer_te.unpatch()
            try:
                with shims.unpatched_te_on_cpu():
                    unpatched = _outcome(call)
            finally:
                pyxfer_te.patch()
        finally:
            torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        assert calls == [], f"pyxfer gathered it: {calls}"
        if patched[0] != "raised" and patched[:2] == unpatched[:2]:
            differ = [name for name in TE_BUFFERS if patched[2].get(name) != unpatched[2].get(name)]
            assert not differ, f"{patched[:2]}: buffers {differ} differ from TE's"
        assert patched == unpatched, f"patched: {str(patched)[:300]}\nTE: {str(unpatched)[:300]}"
    return run


def _hp_input(cls, *args, dtype=torch.bfloat16, **options):
    """A high-precision (16, 64) shard gathered with the quantizer ``cls(*args, **options)``."""
    def make(ctx):
        q = cls(*args, **{"rowwise": True, "columnwise": False, **options})
        x = shard_of(ctx, full_tensor(ctx, (16, 64), dtype, ctx.gen()))
        return lambda: gather(x, ctx.group, quantizer=q)
    return make


def _nvfp4_flagged_input(**flags):
    """A TE NVFP4 tensor with ``flags`` (an encoding whose scales pyxfer does not decode), gathered with
    a plain NVFP4 quantizer."""
    def make(ctx):
        full = full_tensor(ctx, (16, 64), torch.bfloat16, ctx.gen())
        x = te_tensor(formats.quantize(shard_of(ctx, full), "nvfp4", global_amax=float(full.float().abs().max())),
                      "nvfp4", False, **flags)
        return lambda: gather(x, ctx.group, quantizer=quantizer("nvfp4", True, False))
    return make


# ---- TE's own code: the defects the patch fixes -------------------------------------------------

def defect_cases():
    """The same inputs through unpatched TE (shims.unpatched_te_on_cpu) and through the patch. TE hands
    non-contiguous inputs to the collective (NCCL rejects them; gloo copies them, so here the inputs
    are recorded), drops async_op, asserts requantizing MXFP8 K = 48, never gathers 128x128
    quantized, and leaves each rank its own NVFP4 amax."""
    def unpatched(fn):
        def run(ctx):
            pyxfer_te.unpatch()
            try:
                with shims.unpatched_te_on_cpu(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    fn(ctx, caught)
            finally:
                pyxfer_te.patch()
        return run

    def noncontiguous(fmt, shape):
        def te(ctx, caught):
            x = noncontig(shard_of(ctx, full_tensor(ctx, shape, torch.bfloat16, ctx.gen())))
            with shims.collective_inputs() as contiguous:
                try:
                    gather(x, ctx.group, quantizer=quantizer(fmt, True, False))
                except RuntimeError as e:  # W = 3: the gathered shape cannot be requantized either
                    assert "divisible by" in str(e), f"TE failed otherwise: {e}"
            assert False in contiguous, f"TE's fallback gave the collective only contiguous inputs: {contiguous}"
        return te

    def mxfp8_k48(ctx, caught):
        x = shard_of(ctx, full_tensor(ctx, (32, 48), torch.bfloat16, ctx.gen())).clone()
        try:
            gather(x, ctx.group, quantizer=quantizer("mxfp8", True, False))
        except RuntimeError as e:
            assert "divisible by 32" in str(e), f"TE failed otherwise: {e}"
        else:
            raise AssertionError("TE's MXFP8 fallback requantized a K=48 tensor")

    def async_dropped(ctx, caught):
        x = shard_of(ctx, full_tensor(ctx, NOT_QUANTIZABLE["fp8_block_1x128"], torch.bfloat16, ctx.gen())).clone()
        _, handle = gather(x, ctx.group, async_op=True, quantizer=quantizer("fp8_block_1x128", True, False))
        assert handle is None, "TE kept async_op in its fallback"

    def block_128x128(ctx, caught):
        x = shard_of(ctx, full_tensor(ctx, (128, 256), torch.bfloat16, ctx.gen())).clone()
        gather(x, ctx.group, quantizer=quantizer("fp8_block_128x128", True, False))
        assert any("Cannot quantize input tensor" in str(w.message) for w in caught), \
            "TE gathered a quantizable 128x128 shard quantized"

    def nvfp4_amax(ctx, caught):
        full = full_tensor(ctx, (16, 64), torch.bfloat16, ctx.gen(), spread=True)
        qs = [formats.quantize(shard_of(ctx, full, r), "nvfp4") for r in range(ctx.world)]
        out, _ = gather(te_tensor(qs[ctx.rank], "nvfp4", False), ctx.group, quantizer=quantizer("nvfp4", True, False))
        amaxes = [torch.zeros(1) for _ in range(ctx.world)]
        dist.all_gather(amaxes, out._amax_rowwise.float().reshape(1))
        assert len({float(a) for a in amaxes}) == ctx.world, \
            "TE's gathered NVFP4 tensor should carry each rank's own amax (one tensor, W decodings)"

    def generic_noncontiguous(ctx, caught):
        x = noncontig(shard_of(ctx, full_tensor(ctx, (5, 24), torch.float32, ctx.gen())))
        with shims.collective_inputs() as contiguous:
            gather(x, ctx.group, quantizer=RoundToHalf())
        assert contiguous == [False], f"TE's generic path gave the collective contiguous inputs: {contiguous}"

    def generic_patched(ctx):
        full = full_tensor(ctx, (5, 24), torch.float32, ctx.gen())
        got, handle = gather(noncontig(shard_of(ctx, full)), ctx.group, quantizer=RoundToHalf())
        assert handle is None and got.dtype == torch.float16 and torch.equal(raw(got), raw(full.half())), \
            "generic-quantizer path"

    def patched_twin(fmt, shape, *, async_op=False, spread=False, te_input=False):
        """The same call patched: the correct result on every rank."""
        def run(ctx):
            full = full_tensor(ctx, shape, torch.bfloat16, ctx.gen(), spread=spread)
            tq = quantizer(fmt, True, False)
            if te_input:
                qs = [formats.quantize(shard_of(ctx, full, r), fmt) for r in range(ctx.world)]
                x = te_tensor(qs[ctx.rank], fmt, False)
                want = requantized(qs)
            else:
                x = noncontig(shard_of(ctx, full))
                want = expected(fmt, True, False, full)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pyxfer.QuantizedGatherFallbackWarning)
                res, handle = gather(x, ctx.group, async_op=async_op, quantizer=tq)
            assert_te_equal(finish(res, handle, async_op, fmt), want, tq, fmt)
        return run

    return [
        ("defect-noncontiguous-fallback-mxfp8-te", unpatched(noncontiguous("mxfp8", NOT_QUANTIZABLE["mxfp8"]))),
        ("defect-noncontiguous-fallback-mxfp8-patched", patched_twin("mxfp8", NOT_QUANTIZABLE["mxfp8"])),
        ("defect-noncontiguous-fallback-nvfp4-te", unpatched(noncontiguous("nvfp4", NOT_QUANTIZABLE["nvfp4"]))),
        ("defect-noncontiguous-fallback-nvfp4-patched", patched_twin("nvfp4", NOT_QUANTIZABLE["nvfp4"])),
        ("defect-noncontiguous-fallback-fp8block-te",
         unpatched(noncontiguous("fp8_block_1x128", NOT_QUANTIZABLE["fp8_block_1x128"]))),
        ("defect-noncontiguous-fallback-fp8block-patched",
         patched_twin("fp8_block_1x128", NOT_QUANTIZABLE["fp8_block_1x128"])),
        ("defect-mxfp8-k48-requantize-te", unpatched(mxfp8_k48)),
        ("defect-mxfp8-k48-requantize-patched", patched_twin("mxfp8", (32, 48))),
        ("defect-async-dropped-te", unpatched(async_dropped)),
        ("defect-async-dropped-patched",
         patched_twin("fp8_block_1x128", NOT_QUANTIZABLE["fp8_block_1x128"], async_op=True)),
        ("defect-128x128-never-quantized-te", unpatched(block_128x128)),
        ("defect-128x128-never-quantized-patched", patched_twin("fp8_block_128x128", (128, 256))),
        ("defect-noncontiguous-generic-quantizer-te", unpatched(generic_noncontiguous)),
        ("defect-noncontiguous-generic-quantizer-patched", generic_patched),
        ("defect-nvfp4-amax-te", unpatched(nvfp4_amax)),
        ("defect-nvfp4-amax-patched", patched_twin("nvfp4", (16, 64), spread=True, te_input=True)),
    ]


def cases(world):
    out = matrix_cases() + nvfp4_cases() + output_tensor_cases() + verify_cases() + delegated_cases() + \
        defect_cases()
    return [(n, f) for n, f in out if world > 2 or "reduction-over-world" not in n]


def case_names(world):
    return [name for name, _ in cases(world)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--cases", default=None, help="a JSON file listing the names of the cases to run")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=60))
    ctx = Ctx(a.rank, a.world, torch.device("cpu"), a.seed)
    ctx.pair = dist.new_group([0, 1]) if a.world > 2 else None
    report = pyxfer_te.patch()
    assert any(b.owner is te_linear for b in report.bindings), "module.linear's binding was not patched"
    run_cases(ctx, cases(a.world), a.out, a.cases)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
