"""Transformer Engine: TE's gathers of FP8-block, MXFP8 and NVFP4 tensors done by pyxfer.all_gather.

TE's ``transformer_engine.pytorch.distributed.gather_along_first_dim`` (sequence / tensor
parallelism) falls back to a high-precision gather whenever a shard is not quantizable, and those
fallbacks are wrong in several ways (docs/specs/quantized-formats.md §6.6): the input is never made
contiguous (NCCL rejects it), ``async_op`` is dropped, MXFP8 / NVFP4 requantization of a
gathered shape that is still not a multiple of the block asserts in TE's allocator, 128x128 FP8
block tensors are never gathered quantized, and NVFP4 shards with different global amax are
concatenated as if they shared one. ``patch()`` puts pyxfer's gather behind TE's own entry points::

    from pyxfer.integrations import transformer_engine as pyxfer_te
    report = pyxfer_te.patch()          # or: with pyxfer_te.patched(): ...
    print(report)                       # every binding found and replaced
    out, handle = transformer_engine.pytorch.distributed.gather_along_first_dim(x, tp_group,
                                                                               quantizer=q)
    pyxfer_te.unpatch()                 # the identical original objects are back

What is replaced (all in ``transformer_engine.pytorch.distributed`` unless said otherwise):

- ``_start_all_gather_fp8_blockwise`` (its ``_finish_all_gather_fp8_blockwise`` is only reached from
  it and TE's async handle, so it needs no replacing), ``_all_gather_mxfp8``, ``_all_gather_nvfp4``:
  ``gather_along_first_dim`` looks them up in its module's globals at every call.
- ``gather_along_first_dim`` itself, in ``distributed`` and in every loaded module holding the
  original object under any name (TE imports it by name into 9 modules; Megatron-core, NeMo or the
  user's script may too; a script is patched once though ``import torch`` also registers
  ``__main__`` as ``__mp_main__``): its generic-quantizer path (a quantizer of a format TE has no
  gather for) gathers through pyxfer, contiguous; everything else goes to TE's original, which
  reaches the helpers above.

Behaviour when patched: TE quantized tensors (``Float8BlockwiseQTensor[Storage]``,
``MXFP8Tensor[Storage]``, ``NVFP4Tensor[Storage]``) are wrapped without copying in
pyxfer.formats' classes; high-precision inputs are quantized as the quantizer asks
(``quantize_as``); ``pyxfer.all_gather`` gathers them (quantized when every shard is quantizable,
else dequantized, gathered contiguous and requantized only if the gathered shape is quantizable),
and the result comes back as the TE class the quantizer makes (``*Tensor``, or ``*Storage`` for an
``internal`` quantizer), with TE's quantizer attached, buffers bit-identical to quantizing the full
tensor in one process. Return contract as TE's: ``(out, handle)``; with ``async_op=True`` ``out``
is allocated at once and filled in place by ``handle.wait()``; a caller's ``output_tensor`` is
filled in place. Where the gathered shape cannot be stored in MXFP8 / NVFP4 the high-precision
tensor is returned (TE's own fallback asserts there). FP8 block results are always quantized
(partial blocks are fine for that format). NVFP4: every shard is quantized with the global amax
of the whole gathered tensor, or, when the quantizer reduces amax over another group
(``with_amax_reduction`` / ``amax_reduction_group``), with the max over that group.

Handed to TE's original, never approximated: anything pyxfer does not implement (NVFP4 RHT,
stochastic rounding, 2-D NVFP4 or MXFP8 blocks, row-scaled NVFP4, 4-over-6, an E4M3 max other than
448, FP8 block other than 1x128 / 128x128), ``external_coalescing=True`` (pyxfer cannot post inside
a caller's coalescing manager), a missing quantizer, dtypes other than float32 / bfloat16 /
float16, and keyword arguments this module does not know. ``verify=True`` (an option of
``patch``) makes every pyxfer gather check every received shard's PXH64.

Tested with transformer-engine 2.20.2 (PyTorch, torch 2.14.1) on gloo; see README.
"""
import functools
import importlib
import inspect
import warnings

import torch
import torch.distributed as dist

from .. import formats
from ..gather import all_gather
from ._patch import Integration, holders

__all__ = ["TESTED", "is_patched", "late_bindings", "patch", "patched", "report", "unpatch"]

#: (lowest tested release, first untested release) of the ``transformer-engine`` distribution.
TESTED = ("2.20", "2.21")

# Modules of TE 2.20 that import gather_along_first_dim by name (docs/integrations.md, "Transformer Engine"); they
# are imported before the scan so that none is loaded later holding the original.
_IMPORTERS = (
    "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
    "transformer_engine.pytorch.module.base",
    "transformer_engine.pytorch.module.layernorm_linear",
    "transformer_engine.pytorch.module.layernorm_mlp",
    "transformer_engine.pytorch.module.linear",
    "transformer_engine.pytorch.ops.basic.all_gather",
    "transformer_engine.pytorch.ops.basic.basic_linear",
    "transformer_engine.pytorch.ops.basic.reduce_scatter",
    "transformer_engine.pytorch.ops.fused.userbuffers_backward_linear",
)
_HELPERS = {"_start_all_gather_fp8_blockwise": "fp8_block", "_all_gather_mxfp8": "mxfp8",
            "_all_gather_nvfp4": "nvfp4"}
_KNOWN_KWARGS = {"async_op", "quantizer", "out_shape", "output_tensor", "external_coalescing"}
_FP8_DTYPES = {"kFloat8E4M3": torch.float8_e4m3fn, "kFloat8E5M2": torch.float8_e5m2}


class _TE:
    """The TE classes the replacements dispatch on, resolved once at patch time."""

    def __init__(self, target):
        from transformer_engine.pytorch import distributed
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage
        from transformer_engine.pytorch.tensor import float8_blockwise_tensor as fb
        from transformer_engine.pytorch.tensor import mxfp8_tensor as mx
        from transformer_engine.pytorch.tensor import nvfp4_tensor as nv
        from transformer_engine.pytorch.tensor.storage import float8_blockwise_tensor_storage as fbs
        from transformer_engine.pytorch.tensor.storage import mxfp8_tensor_storage as mxs
        from transformer_engine.pytorch.tensor.storage import nvfp4_tensor_storage as nvs
        self.distributed = distributed
        self.QuantizedTensorStorage = QuantizedTensorStorage
        self.quantizer = {"fp8_block": fb.Float8BlockQuantizer, "mxfp8": mx.MXFP8Quantizer,
                          "nvfp4": nv.NVFP4Quantizer}
        self.storage = {"fp8_block": fbs.Float8BlockwiseQTensorStorage, "mxfp8": mxs.MXFP8TensorStorage,
                        "nvfp4": nvs.NVFP4TensorStorage}
        # Quantizers / inputs gather_along_first_dim dispatches itself (FP8 delayed/current scaling
        # included): only other quantizers reach its generic path.
        from transformer_engine.pytorch.tensor import float8_tensor as f8
        from transformer_engine.pytorch.tensor.storage import float8_tensor_storage as f8s
        self.dispatched_quantizers = tuple(self.quantizer.values()) + (f8.Float8Quantizer,
                                                                        f8.Float8CurrentScalingQuantizer)
        self.dispatched_inputs = tuple(self.storage.values()) + (f8s.Float8TensorStorage,)


def _dtype_name(te_dtype) -> str:
    return getattr(te_dtype, "name", str(te_dtype)).split(".")[-1]


def _spec(family, quantizer):
    """The pyxfer QuantizeSpec of a TE quantizer of ``family``, or None where pyxfer would not
    produce TE's exact result (a TE-only option)."""
    rowwise, columnwise = bool(quantizer.rowwise_usage), bool(quantizer.columnwise_usage)
    if not (rowwise or columnwise):
        return None
    name = _dtype_name(quantizer.dtype)
    if family == "fp8_block":
        fmt = {1: "fp8_block_1x128", 2: "fp8_block_128x128"}.get(quantizer.block_scaling_dim)
        if fmt is None or name not in _FP8_DTYPES or getattr(quantizer, "block_len", 128) != 128:
            return None
        return formats.QuantizeSpec(fmt, rowwise=rowwise, columnwise=columnwise, fp8_dtype=_FP8_DTYPES[name],
                                    pow2_scales=bool(quantizer.force_pow_2_scales),
                                    amax_epsilon=float(quantizer.amax_epsilon))
    swizzled = bool(getattr(quantizer, "optimize_for_gemm", False))
    if family == "mxfp8":
        if quantizer.with_2d_quantization or name not in _FP8_DTYPES:
            return None
        return formats.QuantizeSpec("mxfp8", rowwise=rowwise, columnwise=columnwise, fp8_dtype=_FP8_DTYPES[name],
                                    gemm_swizzled_scales=swizzled)
    te_only = ("with_rht", "stochastic_rounding", "with_2d_quantization", "row_scaled_nvfp4", "nvfp4_use_4over6")
    if name != "kFloat4E2M1" or any(getattr(quantizer, a, False) for a in te_only) \
            or getattr(quantizer, "nvfp4_e4m3_max", 448) != 448:
        return None
    return formats.QuantizeSpec("nvfp4", rowwise=rowwise, columnwise=columnwise, gemm_swizzled_scales=swizzled)


def _wrap(family, inp, quantizer):
    """A TE quantized storage as the pyxfer.formats tensor over the same buffers (no copy), or None
    where its flags or buffers are not what pyxfer implements."""
    buffers = {name: getattr(inp, "_" + name, None) for name in formats.BUFFER_NAMES}
    try:
        shape, dtype = tuple(inp.size()), inp._dtype
        if family == "fp8_block":
            name = _dtype_name(inp._fp8_dtype)
            if name not in _FP8_DTYPES:
                return None
            own = getattr(inp, "_quantizer", None) or quantizer  # scale options live on the quantizer
            return formats.Float8BlockTensor(
                shape=shape, dtype=dtype, fp8_dtype=_FP8_DTYPES[name], block_dim=2 if inp._is_2D_scaled else 1,
                pow2_scales=bool(own.force_pow_2_scales), amax_epsilon=float(own.amax_epsilon), **buffers)
        if family == "mxfp8":
            name = _dtype_name(inp._fp8_dtype)
            if name not in _FP8_DTYPES:
                return None
            return formats.MXFP8Tensor(shape=shape, dtype=dtype, fp8_dtype=_FP8_DTYPES[name],
                                       gemm_swizzled_scales=bool(inp._with_gemm_swizzled_scales), **buffers)
        if getattr(inp, "_row_scaled_nvfp4", False) or getattr(inp, "_nvfp4_use_4over6", False) \
                or getattr(inp, "_nvfp4_e4m3_max", 448) != 448:
            return None
        return formats.NVFP4Tensor(
            shape=shape, dtype=dtype, gemm_swizzled_scales=bool(inp._with_gemm_swizzled_scales),
            amax_rowwise=inp._amax_rowwise if buffers["rowwise_data"] is not None else None,
            amax_columnwise=inp._amax_columnwise if buffers["columnwise_data"] is not None else None, **buffers)
    except (ValueError, TypeError, AttributeError):  # layouts pyxfer does not know: TE's own code
        return None


def _same_ranks(a, b) -> bool:
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _nvfp4_amax_spec(spec, quantizer, x, group):
    """NVFP4 from high precision with amax reduced over a group other than the gather group: the
    spec with that group's max |x| as its global amax (over the gather group itself pyxfer's
    default, the max of the shard amaxes, is the same value)."""
    if not getattr(quantizer, "with_amax_reduction", False):
        return spec
    reduce_group = quantizer._canonicalized_amax_reduction_group()
    if _same_ranks(reduce_group, group if group is not None else dist.group.WORLD):
        return spec
    amax = formats.global_amax(x)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=reduce_group)
    return formats.QuantizeSpec("nvfp4", rowwise=spec.rowwise, columnwise=spec.columnwise,
                                **{**spec.options, "global_amax": float(amax.item())})


def _te_object(quantizer, q):
    """A pyxfer.formats tensor as the TE tensor ``quantizer`` makes (class, flags, quantizer
    attached), over the same buffers."""
    meta = quantizer.create_metadata(q.shape, dtype=q.dtype)
    inner = {"_" + name: buf for name, buf in q.buffers().items()}
    return meta["cls"].__tensor_unflatten__(inner, meta, tuple(q.shape), None)


def _result(family, spec, quantizer, result):
    """pyxfer.all_gather's result as TE returns it: a TE quantized tensor, or the high-precision
    tensor where the gathered shape cannot be stored in MXFP8 / NVFP4."""
    if isinstance(result, formats.QuantizedTensor):
        return _te_object(quantizer, result)
    if family == "fp8_block":  # FP8 block quantizes partial edge blocks: TE's callers get FP8 as always
        return _te_object(quantizer, spec.quantize(result))
    return result


def _fill(target, value):
    """Copy a result into a tensor returned before the data arrived (or a caller's output_tensor)."""
    if isinstance(value, torch.Tensor) and not hasattr(value, "_rowwise_data"):
        target.copy_(value)
        return
    pairs = []
    for attr in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
                 "_amax_rowwise", "_amax_columnwise"):
        src, dst = getattr(value, attr, None), getattr(target, attr, None)
        if src is None:
            continue
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"pyxfer.integrations.transformer_engine: output_tensor.{attr} must be "
                             f"{tuple(src.shape)} {src.dtype}, got "
                             f"{None if dst is None else (tuple(dst.shape), dst.dtype)}")
        pairs.append((dst, src))
    for dst, src in pairs:  # every buffer checked first: a refused output_tensor is left untouched
        dst.copy_(src)


class _FillOnWait:
    """TE's async handle contract (``wait()``, as TE's callers use it) over a pyxfer GatherHandle:
    ``wait()`` waits for the gather and fills the tensor returned with it."""

    def __init__(self, handle, finish):
        self._handle, self._finish, self._done = handle, finish, False

    def is_completed(self) -> bool:
        return self._done or self._handle.is_completed()

    def wait(self) -> None:
        if not self._done:
            self._finish(self._handle.wait())
            self._done = True


def _gather(family, spec, x, group, quantizer, *, async_op, output_tensor, verify):
    """TE's helper contract, done by pyxfer.all_gather on ``x`` (a high-precision tensor or a
    wrapped TE tensor): (out, handle). With a handle (or an output_tensor) the result is copied into
    the tensor returned at once, in ``handle.wait()``, as TE's own helpers fill theirs in place."""
    if family == "nvfp4" and not isinstance(x, formats.QuantizedTensor):
        spec = _nvfp4_amax_spec(spec, quantizer, x, group)
    if not async_op and output_tensor is None:
        return _result(family, spec, quantizer, all_gather(x, group, quantize_as=spec, verify=verify)), None
    # The result's kind is known before the data: quantized unless the gathered shape cannot be
    # stored (all_gather requantizes exactly the quantizable gathered shapes).
    world = dist.get_world_size(group)
    shape = tuple(x.shape)
    gathered = (shape[0] * world,) + shape[1:]
    quantized = family == "fp8_block" or formats.is_quantizable(gathered, spec.fmt)
    target = output_tensor if quantized else None
    if target is None:
        dtype = x.dtype
        if quantized:
            inner = quantizer.alloc_tensors(gathered, device=x.device)
            meta = quantizer.create_metadata(gathered, dtype=dtype)
            target = meta["cls"].__tensor_unflatten__(inner, meta, gathered, None)
        else:
            target = torch.empty(gathered, dtype=dtype, device=x.device)
    handle = all_gather(x, group, quantize_as=spec, async_op=True, verify=verify)
    waiter = _FillOnWait(handle, lambda result: _fill(target, _result(family, spec, quantizer, result)))
    if async_op:
        return target, waiter
    waiter.wait()
    return target, None


def _make_helper(te, name, original, verify):
    family = _HELPERS[name]

    @functools.wraps(original)
    def helper(inp, process_group, **kwargs):
        quantizer = kwargs.get("quantizer")
        ours = (set(kwargs) <= _KNOWN_KWARGS and not kwargs.get("external_coalescing", False)
                and isinstance(quantizer, te.quantizer[family]) and dist.get_world_size(process_group) > 1)
        spec = _spec(family, quantizer) if ours else None
        x = None
        if spec is not None:
            if isinstance(inp, te.storage[family]):
                x = _wrap(family, inp, quantizer)
            elif isinstance(inp, torch.Tensor) and not isinstance(inp, te.QuantizedTensorStorage) \
                    and inp.dtype in formats.INPUT_DTYPES and inp.dim() >= 1:
                x = inp
        if x is None:  # something pyxfer does not implement: TE's own code, unchanged
            return original(inp, process_group, **kwargs)
        return _gather(family, spec, x, process_group, quantizer, async_op=bool(kwargs.get("async_op", False)),
                       output_tensor=kwargs.get("output_tensor"), verify=verify)

    helper.__pyxfer_original__ = original
    return helper


def _make_gather_along_first_dim(te, original, verify):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def gather_along_first_dim(*args, **kwargs):
        try:
            call = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)
        inp, group, quantizer = call.get("inp"), call.get("process_group"), call.get("quantizer")
        generic = (quantizer is not None and not isinstance(quantizer, te.dispatched_quantizers)
                   and not isinstance(inp, te.dispatched_inputs)
                   and set(call) <= {"inp", "process_group"} | _KNOWN_KWARGS
                   and not call.get("external_coalescing", False) and call.get("output_tensor") is None
                   and type(inp).__name__ != "DebugQuantizedTensor" and dist.get_world_size(group) > 1)
        if not generic:
            return original(*args, **kwargs)
        # TE's generic path: high-precision gather, then the quantizer. TE passes the input as it
        # is (NCCL rejects a non-contiguous one); pyxfer gathers any strides.
        x = inp.dequantize() if isinstance(inp, te.QuantizedTensorStorage) else inp
        return quantizer(all_gather(x, group, verify=verify)), None

    gather_along_first_dim.__pyxfer_original__ = original
    return gather_along_first_dim


class _TransformerEngine(Integration):
    def __init__(self):
        super().__init__("transformer_engine", module="transformer_engine.pytorch",
                         distribution="transformer-engine", tested=TESTED)

    def bindings(self, target, *, verify=False):
        if not isinstance(verify, bool):
            raise TypeError(f"pyxfer.integrations.transformer_engine.patch: verify must be a bool, got {verify!r}")
        te = _TE(target)
        ted = te.distributed
        for module in _IMPORTERS:
            try:
                importlib.import_module(module)
            except ImportError:  # not in this TE version; the scan below finds what is loaded
                pass
        for name in _HELPERS:
            yield ted, name, _make_helper(te, name, getattr(ted, name), verify)
        original = ted.gather_along_first_dim
        replacement = _make_gather_along_first_dim(te, original, verify)
        yield ted, "gather_along_first_dim", replacement
        for owner, attribute in holders(original, exclude=ted):
            yield owner, attribute, replacement

    def late_bindings(self) -> list:
        """``module.attribute`` names bound to a replacement after patch() (a module imported
        since, e.g. ``from transformer_engine.pytorch.distributed import gather_along_first_dim``):
        not in the report; unpatch() puts the original there too and warns."""
        report = self.report()
        if report is None:
            return []
        known = {(id(b.owner), b.attribute) for b in report.bindings}
        late = []
        for b in report.bindings:
            for owner, attribute in holders(b.replacement):
                if (id(owner), attribute) not in known:
                    known.add((id(owner), attribute))
                    late.append((owner, attribute, b.original))
        return late

    def unpatch(self, *, force: bool = False) -> None:
        with self._lock:
            late = self.late_bindings()
            super().unpatch(force=force)
            for owner, attribute, original in late:
                setattr(owner, attribute, original)
            if late:
                names = ", ".join(f"{o.__name__}.{a}" for o, a, _ in late)
                warnings.warn(f"pyxfer.integrations.transformer_engine.unpatch: {names} bound pyxfer's replacement "
                              f"after patch() (not in its report); restored to TE's original", RuntimeWarning,
                              stacklevel=2)


_integration = _TransformerEngine()


def patch(*, verify: bool = False):
    """Replace TE's gather fallbacks with pyxfer.all_gather (see the module docstring). Imports
    transformer_engine.pytorch (torch first). ``verify``: every gather checks every received
    shard's PXH64. Returns the PatchReport (every binding found and changed); idempotent.
    Raises IntegrationError (an ImportError) when TE is missing, fails to import or is outside
    TESTED, ValueError when already patched with another ``verify``."""
    return _integration.patch(verify=verify)


def unpatch(*, force: bool = False) -> None:
    """Put back TE's original objects everywhere patch() replaced them, and where a module bound a
    replacement after patch() (with a RuntimeWarning naming it). See Integration.unpatch."""
    _integration.unpatch(force=force)


def patched(*, verify: bool = False):
    """Context manager: patch(verify=...) for the block, unpatch() after it (also when it raises)."""
    return _integration.patched(verify=verify)


def is_patched() -> bool:
    """Whether TE's gather is currently patched by pyxfer."""
    return _integration.is_patched()


def report():
    """The PatchReport of the active patch, or None."""
    return _integration.report()


def late_bindings() -> list:
    """``(module, attribute, original)`` for every module global bound to a replacement since
    patch() (a module imported after it): not in the report; unpatch() restores them too."""
    return _integration.late_bindings()
