"""This rank's input, normalised (``Local``: what kind, which format spec, what it would send), for a
waiting call and for the engine's plans (pyxfer.gather.engine), which fix the path from the agreed
signature alone: quantized, or the dequantize-then-gather fallback (and why, for the warning)."""
import torch

from .. import formats
from .._checks import check_tensor
from . import layouts
from . import record as rec
from .errors import OP
from .layouts import quantizable

_compact_specs = {}  # spec -> the same spec with compact scales (specs are immutable and hashable)


def compact(spec: formats.QuantizeSpec) -> formats.QuantizeSpec:
    """``spec`` with gemm_swizzled_scales off (gathers are compact: rank concatenation of swizzled
    scales is wrong, spec §5)."""
    out = _compact_specs.get(spec)
    if out is None:
        opts = spec.options
        if opts.get("gemm_swizzled_scales"):
            opts["gemm_swizzled_scales"] = False
            out = formats.QuantizeSpec(spec.fmt, rowwise=spec.rowwise, columnwise=spec.columnwise,
                                       fp8_dtype=spec.fp8_dtype, **opts)
        else:
            out = spec
        if len(_compact_specs) < 256:
            _compact_specs[spec] = out
    return out


_specs_of_tensors = {}  # (format, usages, options) of a QuantizedTensor -> its spec (immutable)


def spec_of(q) -> formats.QuantizeSpec:
    """``q.spec``, remembered per format, usages and options (building a spec validates its options:
    host time every call would pay)."""
    options = q.options
    key = (q.fmt, q.rowwise_usage, q.columnwise_usage, tuple(options.items()))
    spec = _specs_of_tensors.get(key)
    if spec is None:
        spec = q.spec
        if len(_specs_of_tensors) < 256:
            _specs_of_tensors[key] = spec
    return spec


def with_usages(spec, rowwise, columnwise):
    if (spec.rowwise, spec.columnwise) == (rowwise, columnwise):
        return spec
    return formats.QuantizeSpec(spec.fmt, rowwise=rowwise, columnwise=columnwise, fp8_dtype=spec.fp8_dtype,
                                **spec.options)


def _swizzled(spec) -> bool:
    return bool(spec.options.get("gemm_swizzled_scales", False))


def _provides(q, have, want) -> bool:
    """Can QuantizedTensor ``q`` (of spec ``have``) be gathered as is (maybe dropping a usage, maybe
    re-swizzled) to give spec ``want``?"""
    def core(s):
        return s.fmt, s.fp8_dtype, {k: v for k, v in s.options.items() if k not in ("gemm_swizzled_scales",
                                                                                   "global_amax")}
    if core(have) != core(want):
        return False
    if (want.rowwise and not have.rowwise) or (want.columnwise and not have.columnwise):
        return False
    amax = want.options.get("global_amax")
    if want.fmt == "nvfp4" and amax is not None:
        have_amax = q.amax_rowwise if q.amax_rowwise is not None else q.amax_columnwise
        return float(have_amax.reshape(-1)[0].item()) == amax
    return True


_records = {}  # input description -> its record (lists only read after encode)


class Local:
    """This rank's input, normalised: ``kind`` (record.KIND_*), ``spec`` (the compact QuantizeSpec of
    what is gathered, kinds 1 and 2), ``out_swizzled``, ``dtype`` (plain / nominal dtype), ``shape``,
    and what it would send. An invalid input is kept as ``error`` (reported to every rank through the
    records, raised here afterwards)."""

    def __init__(self, x, quantize_as, verify, world, exchange=None):
        self.error = None
        self.device = None
        self.kind, self.spec, self.dtype, self.shape = rec.KIND_PLAIN, None, None, ()
        self.x = None            # plain / high-precision tensor (kinds 0 and 2)
        self.q = None            # compact QuantizedTensor (kind 1; kind 2 once quantized)
        self.amax_dev = None     # NVFP4: 1-element fp32 tensors (amax_rowwise, amax_columnwise) or (shard amax,)
        self.out_swizzled = False
        self.verify = verify
        # exchange: whether the call communicates (all_gather: world > 1; a 1-rank group may run the
        # protocol all the same, see pyxfer.gather.gather)
        self.exchange = world > 1 if exchange is None else exchange
        try:
            self._prepare(x, quantize_as, world)
        except Exception as e:
            self.error = e

    def take_error(self):
        """The error this rank's input raised (and forget it: an exception kept here would keep, through
        its traceback's frames, this object and the call's buffers alive in a reference cycle)."""
        error, self.error = self.error, None
        return error

    def record(self) -> list:
        """This rank's record (host part; amax and hashes are written on the device). Remembered per
        input description (records are only read), as calls repeat."""
        if self.error is not None:
            return rec.encode(error=True)
        key = (self.kind, self.dtype, self.shape, self.verify, self.spec, self.out_swizzled)
        meta = _records.get(key)
        if meta is None:
            meta = rec.encode(kind=self.kind, dtype=self.dtype, shape=self.shape, verify=self.verify, spec=self.spec,
                              out_swizzled=self.out_swizzled)
            if len(_records) < 256:
                _records[key] = meta
        return meta

    def device_values(self):
        """None, or the function that writes what the device computes (the NVFP4 amax bits) into a
        record tensor on the device."""
        if self.error is not None or self.amax_dev is None:
            return None

        def write(meta):
            bits = torch.cat([a.reshape(1).float() for a in self.amax_dev]).view(torch.int32).to(torch.int64)
            meta[rec.F_AMAX_ROW:rec.F_AMAX_ROW + bits.numel()].copy_(bits)
        return write

    def _prepare(self, x, quantize_as, world):
        device = getattr(x, "device", None)  # known even if x is rejected: the record goes there
        self.device = device if isinstance(device, torch.device) and device.type in ("cpu", "cuda") else None
        if not isinstance(self.verify, bool):
            raise TypeError(f"{OP}: verify must be a bool, got {type(self.verify).__name__}")
        spec = quantize_as
        if spec is not None and not isinstance(spec, formats.QuantizeSpec):
            raise TypeError(f"{OP}: quantize_as must be a pyxfer.formats.QuantizeSpec or None, "
                            f"got {type(quantize_as).__name__}")
        if isinstance(x, formats.QuantizedTensor):
            self.device = x.device
            have = spec_of(x)
            if spec is None or _provides(x, have, spec):
                want = have if spec is None else spec
                self.out_swizzled = _swizzled(want)
                self._prepare_quantized(x, compact(with_usages(have, want.rowwise, want.columnwise)), world)
                return
            x = x.dequantize()  # the nominal dtype; every usage and format decodes (NVFP4 columnwise too)
        check_tensor(OP, "x", x)
        if x.dim() == 0:
            raise ValueError(f"{OP}: x must have at least one dim (gathered along dim 0), got a 0-dim tensor")
        if x.dim() > rec.MAX_DIMS:
            raise ValueError(f"{OP}: x has {x.dim()} dims; at most {rec.MAX_DIMS} are supported")
        if x.dtype not in rec.DTYPE_CODE:
            raise TypeError(f"{OP}: x has dtype {x.dtype}, which cannot be gathered")
        x = x.detach()
        self.device, self.dtype, self.shape = x.device, x.dtype, tuple(x.shape)
        if spec is None:
            self.kind, self.x = rec.KIND_PLAIN, x
            return
        if x.dtype not in formats.INPUT_DTYPES:
            raise TypeError(f"{OP}: quantize_as needs a float32, bfloat16 or float16 tensor, got {x.dtype}")
        self.kind, self.x, self.spec, self.out_swizzled = rec.KIND_TO_QUANTIZE, x, compact(spec), _swizzled(spec)
        if not self.exchange:
            return
        if not quantizable(spec, self.shape):
            return  # fallback: x is sent in its dtype
        if spec.fmt == "nvfp4" and spec.options["global_amax"] is None:
            self.amax_dev = (formats.global_amax(x),)  # global amax = max over ranks, known later
        else:
            self.q = self.spec.quantize(x)

    def _prepare_quantized(self, q, spec, world):
        if len(q.shape) == 0 or len(q.shape) > rec.MAX_DIMS:
            raise ValueError(f"{OP}: x has {len(q.shape)} dims; 1 to {rec.MAX_DIMS} are supported")
        q = q.with_compact_scales() if q.fmt in ("mxfp8", "nvfp4") else q
        self.kind, self.spec, self.dtype, self.shape = rec.KIND_QUANTIZED, spec, q.dtype, tuple(q.shape)
        if spec.fmt == "nvfp4":
            row = q.amax_rowwise if spec.rowwise else None
            col = q.amax_columnwise if spec.columnwise else None
            self.amax_dev = (row if row is not None else col, col if col is not None else row)
        self.q = q
        if self.exchange and not quantizable(spec, self.shape):
            self.x = q.dequantize()  # fallback: sent in the nominal dtype


def world_one(local: Local, x, quantize_as):
    """World size 1: no communication; x itself unless quantize_as asks for something else."""
    if local.error is not None:
        raise local.take_error()
    spec, q = local.spec, local.q
    if local.kind == rec.KIND_PLAIN or (local.kind == rec.KIND_QUANTIZED and quantize_as is None):
        return x
    if local.kind == rec.KIND_QUANTIZED:  # provides the spec: keep the usages it asks for
        bufs = {n: t for n, t in q.buffers().items()
                if "rowwise" in n and spec.rowwise or "columnwise" in n and spec.columnwise}
        q = formats.tensor_from_buffers(spec, q.shape, q.dtype, bufs)
    elif q is None:
        if not spec.is_quantizable(local.shape):
            return x if isinstance(x, torch.Tensor) else local.x
        q = spec.quantize(local.x)
    return q.with_swizzled_scales() if local.out_swizzled else q


def quantize_with_group_amax(local: Local, records):
    """quantize_as NVFP4 without a global amax: quantize with the max of the shard amaxes (on the
    device, from the gathered records)."""
    spec = local.spec
    # The amax is the group's maximum of the shards' amaxes: data (kept on the device), not an
    # argument for quantize to check.
    local.q = formats._quantize(local.x, spec.fmt, rowwise=spec.rowwise, columnwise=spec.columnwise,
                                fp8_dtype=spec.fp8_dtype, check_amax_tensor=False,
                                **{**spec.options, "global_amax": records.max_amax()})


def fallback_warning(local: Local, world):
    """(message, key) of the fallback warning of a signature whose shards are not quantizable, else None."""
    kind, shape, spec = local.kind, local.shape, local.spec
    if kind == rec.KIND_PLAIN or quantizable(spec, shape):
        return None
    out_shape = (world * shape[0],) + tuple(shape[1:])
    out_ok = quantizable(spec, out_shape)
    ranks = f"ranks 0-{world - 1}" if world > 2 else "ranks 0 and 1"
    dtype = str(local.dtype).removeprefix("torch.")
    what = "gathered quantized" if kind == rec.KIND_QUANTIZED else f"quantized as {spec.fmt}"
    reason = f"the shards of shape {list(shape)} on {ranks} cannot be {what}: " \
             f"{layouts.why_not_quantizable(shape, spec.fmt)}"
    then = f"requantized as {spec.fmt}" if out_ok else \
        f"returned in {dtype}, because the gathered shape {list(out_shape)} is not quantizable either " \
        f"({layouts.why_not_quantizable(out_shape, spec.fmt)})"
    # (NVFP4 tensors always hold whole 16x16 blocks, so only FP8-block and MXFP8 ones get here.)
    return f"{OP} gathered in {dtype} instead of {spec.fmt}: {reason}. The result is {then}.", \
        (spec.fmt, "shape", out_ok)
