"""Quantized tensor formats with Transformer Engine's storage layouts (docs/specs/quantized-formats.md).

Formats (``FORMATS``):

=====================  ==============================  =========================  ==========================
format                 element / block                 scale_inv                  columnwise data
=====================  ==============================  =========================  ==========================
``fp8_block_1x128``    E4M3/E5M2, 1x128 row segments   fp32, GEMM-ready           (K, d0, ...), requantized
``fp8_block_128x128``  E4M3/E5M2, 128x128 tiles        fp32                       byte transpose of rowwise
``mxfp8``              E4M3/E5M2, 1x32 / 32x1          E8M0 bytes, compact        same shape, not transposed
``nvfp4``              E2M1 pairs, 1x16 / 16x1         E4M3 bytes + global amax   [K, M/2], transposed
=====================  ==============================  =========================  ==========================

M is the product of the leading dims, K the last dim. Buffers are exactly TE's (``rowwise_data``,
``rowwise_scale_inv``, ``columnwise_data``, ``columnwise_scale_inv``; NVFP4 also ``amax_rowwise`` /
``amax_columnwise``), so TE tensors can be wrapped without copying and vice versa. Scale padding
written by pyxfer is zero (TE leaves it unspecified: compare only the logical region with TE).
All work runs on the device of the data (CPU or CUDA, bit-identical).
"""
import copy
import functools
import math

import torch

from . import _C  # noqa: F401  (registers torch.ops.pyxfer.*)
from ._checks import check_bool, check_int, check_real, check_sequence, check_tensor

__all__ = [
    "FORMATS", "Float8BlockTensor", "MXFP8Tensor", "NVFP4Tensor", "QuantizeSpec", "QuantizedTensor",
    "buffer_layout", "global_amax", "is_quantizable", "quantize", "swizzle_scales", "unswizzle_scales",
]

FORMATS = ("fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_LEN = {"fp8_block_1x128": 128, "fp8_block_128x128": 128, "mxfp8": 32, "nvfp4": 16}
BUFFER_NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
# Options each format accepts (besides fp8_dtype), with defaults.
FORMAT_OPTIONS = {
    "fp8_block_1x128": {"pow2_scales": True, "amax_epsilon": 0.0},
    "fp8_block_128x128": {"pow2_scales": True, "amax_epsilon": 0.0},
    "mxfp8": {"gemm_swizzled_scales": False},
    "nvfp4": {"global_amax": None, "gemm_swizzled_scales": False},
}
# TE options pyxfer does not implement: a clear error instead of a silently different result.
_UNSUPPORTED = ("with_rht", "stochastic_rounding", "with_2d_quantization", "row_scaled_nvfp4", "nvfp4_use_4over6")


def _check_format(op, fmt):
    if fmt not in FORMATS:
        raise ValueError(f"{op}: fmt must be one of {FORMATS}, got {fmt!r}")


def _check_shape(op, name, shape) -> tuple:
    """``shape`` (a torch.Size or another sequence of ints >= 0) as a tuple of Python ints."""
    dims = check_sequence(op, name, shape, "ints")
    return tuple(check_int(op, f"{name}[{i}]", d, minimum=0) for i, d in enumerate(dims))


def _check_storable(op, name, fmt, shape):
    """Raise ValueError unless ``fmt`` can store a tensor of ``shape`` (a tuple of ints): at least one
    dimension; MXFP8 / NVFP4 also need M and K multiples of their block (FP8 block takes any shape)."""
    if not shape:
        raise ValueError(f"{op}: {name} must have at least 1 dimension, got {shape}")
    if fmt in ("mxfp8", "nvfp4"):
        m, k = _matrix(shape)
        block = BLOCK_LEN[fmt]
        if m % block or k % block:
            raise ValueError(f"{op}: {fmt} needs the flattened leading dims (M={m}) and the last dim (K={k}) of "
                             f"{name} to be multiples of {block}, got shape {shape}")


def _matrix(shape):
    """(M, K) of a logical shape: M = product of the leading dims, K = the last dim."""
    return math.prod(shape[:-1]), shape[-1]


def _cdiv(a, b):
    return -(-a // b)


def _rup(a, b):
    return _cdiv(a, b) * b


def is_quantizable(shape, fmt) -> bool:
    """Whether a tensor of ``shape`` can be stored in ``fmt`` with whole blocks only (TE's
    ``is_quantizable``: ndim >= 2 and M, K multiples of the block length: 128 for FP8 block, 32 for
    MXFP8, 16 for NVFP4). FP8 block quantize itself accepts any shape (partial edge blocks)."""
    op = "pyxfer.formats.is_quantizable"
    _check_format(op, fmt)
    shape = _check_shape(op, "shape", shape)
    if len(shape) < 2:
        return False
    m, k = _matrix(shape)
    return m % BLOCK_LEN[fmt] == 0 and k % BLOCK_LEN[fmt] == 0


def buffer_layout(fmt, shape, *, rowwise=True, columnwise=False):
    """Shapes and dtypes of the buffers a ``fmt`` tensor of logical ``shape`` holds:
    ``{name: (shape tuple, dtype)}`` for the requested usages (scales in the compact layout).
    Raises ValueError for an unknown fmt or a shape the format cannot store (no dimensions; MXFP8 /
    NVFP4: M or K not a multiple of the block), TypeError for a shape that is not a sequence of
    ints or usages that are not bools."""
    op = "pyxfer.formats.buffer_layout"
    _check_format(op, fmt)
    shape = _check_shape(op, "shape", shape)
    _check_storable(op, "shape", fmt, shape)
    check_bool(op, "rowwise", rowwise)
    check_bool(op, "columnwise", columnwise)
    m, k = _matrix(shape)
    u8, f32 = torch.uint8, torch.float32
    out = {}
    if fmt.startswith("fp8_block"):
        mb, kb = _cdiv(m, 128), _cdiv(k, 128)
        one_d = fmt == "fp8_block_1x128"
        if rowwise:
            out["rowwise_data"] = (shape, u8)
            out["rowwise_scale_inv"] = ((kb, _rup(m, 4)) if one_d else (mb, _rup(kb, 4)), f32)
        if columnwise:
            out["columnwise_data"] = ((k,) + shape[:-1], u8)
            out["columnwise_scale_inv"] = ((mb, _rup(k, 4)) if one_d else (kb, _rup(mb, 4)), f32)
    elif fmt == "mxfp8":
        if rowwise:
            out["rowwise_data"] = (shape, u8)
            out["rowwise_scale_inv"] = ((_rup(m, 128), _rup(k // 32, 4)), u8)
        if columnwise:
            out["columnwise_data"] = (shape, u8)
            out["columnwise_scale_inv"] = ((_rup(m // 32, 4), _rup(k, 128)), u8)
    else:
        if rowwise:
            out["rowwise_data"] = (shape[:-1] + (k // 2,), u8)
            out["rowwise_scale_inv"] = ((_rup(m, 128), _rup(k // 16, 4)), u8)
            out["amax_rowwise"] = ((1,), f32)
        if columnwise:
            out["columnwise_data"] = ((k, m // 2), u8)
            out["columnwise_scale_inv"] = ((_rup(k, 128), _rup(m // 16, 4)), u8)
            out["amax_columnwise"] = ((1,), f32)
    return out


# ---- GEMM-swizzled scales (spec §5): 128x4 tiles of 512 bytes, row-major over tiles; inside a tile,
# entry (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c.
def _swizzle_view(op, scale, transpose):
    check_tensor(op, "scale", scale)
    check_bool(op, "transpose", transpose)
    if scale.dim() != 2:
        raise ValueError(f"{op}: scale must be a 2-D tensor, got shape {tuple(scale.shape)}")
    s = scale.t() if transpose else scale
    rows, cols = s.shape
    if rows % 128 or cols % 4:
        raise ValueError(f"{op}: the scale matrix{' (transposed)' if transpose else ''} must be padded to "
                         f"multiples of 128 rows and 4 columns, got {tuple(s.shape)}")
    return s, rows, cols


def swizzle_scales(scale: torch.Tensor, *, transpose: bool = False) -> torch.Tensor:
    """Compact MXFP8/NVFP4 scales -> cuBLAS's swizzled order (same shape as ``scale``, bytes permuted).
    ``transpose=True`` for MXFP8 columnwise scales (stored ``[mb, k]`` but swizzled with i = k).
    Raises ValueError unless the (transposed) matrix is padded to 128 rows x 4 columns."""
    s, rows, cols = _swizzle_view("pyxfer.formats.swizzle_scales", scale, transpose)
    tiles = s.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(scale.shape)


def unswizzle_scales(scale: torch.Tensor, *, transpose: bool = False) -> torch.Tensor:
    """Inverse of swizzle_scales: swizzled bytes (in a tensor of the compact shape) -> compact layout."""
    s, rows, cols = _swizzle_view("pyxfer.formats.unswizzle_scales", scale, transpose)
    compact = scale.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, cols)
    return (compact.t() if transpose else compact).contiguous()


# ---- options
def _check_options(op, fmt, fp8_dtype, options, *, allow_tensor_amax=True):
    """Validated options of ``fmt`` with defaults filled in (fp8_dtype included)."""
    for name in options:
        if name in _UNSUPPORTED:
            raise ValueError(f"{op}: option {name!r} is not supported by pyxfer (TE-only feature)")
        if name not in FORMAT_OPTIONS[fmt]:
            raise TypeError(f"{op}: unknown option {name!r} for {fmt}; expected one of "
                            f"{sorted(FORMAT_OPTIONS[fmt])}")
    merged = {**FORMAT_OPTIONS[fmt], **options}
    if fmt == "nvfp4":
        if fp8_dtype is not torch.float8_e4m3fn:
            raise ValueError(f"{op}: nvfp4 stores E2M1 data with E4M3 scales; fp8_dtype must be "
                             f"torch.float8_e4m3fn, got {fp8_dtype}")
        merged["global_amax"] = _check_global_amax(op, merged["global_amax"], allow_tensor_amax)
    elif fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    for name in ("pow2_scales", "gemm_swizzled_scales"):
        if name in merged:
            check_bool(op, name, merged[name])
    if "amax_epsilon" in merged:
        eps = check_real(op, "amax_epsilon", merged["amax_epsilon"])
        if not (math.isfinite(eps) and eps >= 0):  # inf would make every scale 1, NaN every one NaN
            raise ValueError(f"{op}: amax_epsilon must be a finite float >= 0, got {eps!r}")
        merged["amax_epsilon"] = eps
    merged["fp8_dtype"] = fp8_dtype
    return merged


_FP32_MAX = torch.finfo(torch.float32).max


def _check_amax_value(op, value: float, allow_tensor: bool, got: str) -> None:
    """The one rule for NVFP4's global amax, whatever form it came in: a finite fp32 value >= 0
    (NaN, inf or a negative amax would make every decoded value NaN or inf, or flip its sign)."""
    if not (math.isfinite(value) and 0 <= value <= _FP32_MAX):
        tensor = " or a 1-element floating-point tensor holding one" if allow_tensor else ""
        raise ValueError(f"{op}: global_amax must be None or a finite float32 value >= 0{tensor}, got {got}")


def _check_global_amax(op, amax, allow_tensor: bool):
    """``amax`` checked: None; a real number (Python or numpy, any width) as a Python float; a
    tensor (only if ``allow_tensor``) checked for shape and dtype here, for its value by
    :func:`_global_amax` (which knows x's device, so a wrong device is reported before any sync)."""
    if amax is None:
        return None
    if isinstance(amax, torch.Tensor):
        if not allow_tensor:
            raise TypeError(f"{op}: global_amax must be None or a float here (a QuantizeSpec holds no tensors), "
                            f"got a tensor; pass the tensor to quantize() or spec.quantize(x, global_amax=...)")
        check_tensor(op, "global_amax", amax)
        if amax.numel() != 1 or not amax.is_floating_point():
            raise ValueError(f"{op}: global_amax must be a 1-element floating-point tensor, got shape "
                             f"{tuple(amax.shape)} and dtype {amax.dtype}")
        return amax
    value = check_real(op, "global_amax", amax)
    _check_amax_value(op, value, allow_tensor, repr(amax))
    return value


# ---- tensors
class QuantizedTensor:
    """A quantized tensor: TE's buffers (plain tensors on one device) plus the logical ``shape``, the
    nominal ``dtype`` it dequantizes to, and the format options. Buffers for a usage that was not
    asked for are None. Construct with ``quantize`` or wrap existing buffers with a subclass's
    constructor (validated, not copied)."""

    fmt = None

    def __init__(self, *, shape, dtype, buffers, op):
        shape = _check_shape(op, "shape", shape)
        _check_storable(op, "shape", self.fmt, shape)
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"{op}: dtype (the nominal dtype) must be one of {INPUT_DTYPES}, got {dtype}")
        self.shape = torch.Size(shape)
        self.dtype = dtype
        rowwise = buffers.get("rowwise_data") is not None
        columnwise = buffers.get("columnwise_data") is not None
        if not (rowwise or columnwise):
            raise ValueError(f"{op}: needs rowwise_data and/or columnwise_data")
        expected = buffer_layout(self.fmt, self.shape, rowwise=rowwise, columnwise=columnwise)
        missing = [name for name in expected if buffers.get(name) is None]
        if missing:
            raise ValueError(f"{op}: missing {', '.join(missing)} for the usages given")
        device = first = None
        for name, value in buffers.items():
            if name not in expected:
                if value is not None:
                    raise ValueError(f"{op}: {name} given without its data buffer")
                continue
            want_shape, want_dtype = expected[name]
            check_tensor(op, name, value)
            if tuple(value.shape) != want_shape or value.dtype != want_dtype:
                raise ValueError(f"{op}: {name} must have shape {want_shape} and dtype {want_dtype} for logical "
                                 f"shape {tuple(self.shape)}, got {tuple(value.shape)} {value.dtype}")
            if device is None:
                device, first = value.device, name
            elif value.device != device:
                raise ValueError(f"{op}: {name} is on {value.device}, expected the device of {first} ({device}): "
                                 f"all buffers must be on one device")
        self.device = device
        for name in BUFFER_NAMES:
            setattr(self, name, buffers.get(name))

    # ---- properties shared by all formats
    @property
    def rowwise_usage(self) -> bool:
        return self.rowwise_data is not None

    @property
    def columnwise_usage(self) -> bool:
        return self.columnwise_data is not None

    @property
    def options(self) -> dict:
        """The format options (fp8_dtype and the format's own)."""
        raise NotImplementedError

    @property
    def spec(self):
        """A QuantizeSpec that produces tensors like this one (usages, dtype and options)."""
        options = {k: v for k, v in self.options.items() if k in FORMAT_OPTIONS[self.fmt]}
        return QuantizeSpec(self.fmt, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                            fp8_dtype=self.options.get("fp8_dtype", torch.float8_e4m3fn), **options)

    def buffers(self) -> dict:
        """The buffers present, by TE name without the leading underscore."""
        names = BUFFER_NAMES + getattr(self, "_EXTRA_BUFFERS", ())
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _rebuild(self, **buffers):
        """A tensor of the same class, shape, dtype and options with some buffers replaced."""
        kwargs = {**self.buffers(), **{k: v for k, v in self.options.items()}, **buffers}
        return type(self)(shape=self.shape, dtype=self.dtype, **kwargs)

    def to(self, device, *, verify: str = "sync"):
        """This tensor with every buffer moved to ``device`` by pyxfer.verified_copy (checked end to end)."""
        from .transfer import verified_copy
        return self._rebuild(**{k: verified_copy(v, device, verify=verify) for k, v in self.buffers().items()})

    def dequantize(self, dtype=None, *, usage=None) -> torch.Tensor:
        """The values as a ``dtype`` tensor (default: the nominal dtype) of the logical shape, on this
        tensor's device, decoded from ``usage`` ("rowwise" / "columnwise"; default: rowwise if present).
        Raises ValueError for another dtype or a usage this tensor does not hold."""
        op = f"{type(self).__name__}.dequantize"
        dtype = self.dtype if dtype is None else dtype
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"{op}: dtype must be one of {INPUT_DTYPES}, got {dtype}")
        usage = ("rowwise" if self.rowwise_usage else "columnwise") if usage is None else usage
        if usage not in ("rowwise", "columnwise") or not getattr(self, f"{usage}_usage"):
            raise ValueError(f"{op}: usage must be a usage this tensor holds "
                             f"(rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage}), got {usage!r}")
        return self._dequantize(usage == "rowwise", dtype).reshape(self.shape)

    def __repr__(self):
        usages = "+".join(u for u, on in (("rowwise", self.rowwise_usage), ("columnwise", self.columnwise_usage)) if on)
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return (f"{type(self).__name__}(fmt={self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, {usages}, {opts})")


class Float8BlockTensor(QuantizedTensor):
    """FP8 block scaling: ``block_dim=1`` (1x128, format ``fp8_block_1x128``) or ``block_dim=2``
    (128x128, ``fp8_block_128x128``). fp32 ``*_scale_inv``; 1-D rowwise scales are ``[cdiv(K,128),
    rup(M,4)]`` (M fast), columnwise data ``(K, d0, ...)``."""

    def __init__(self, *, shape, dtype, rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None,
                 columnwise_scale_inv=None, fp8_dtype=torch.float8_e4m3fn, block_dim=1, pow2_scales=True,
                 amax_epsilon=0.0):
        op = "pyxfer.formats.Float8BlockTensor"
        if check_int(op, "block_dim", block_dim) not in (1, 2):
            raise ValueError(f"{op}: block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
        self.block_dim = block_dim
        fmt = "fp8_block_1x128" if block_dim == 1 else "fp8_block_128x128"
        opts = _check_options(op, fmt, fp8_dtype, {"pow2_scales": pow2_scales, "amax_epsilon": amax_epsilon})
        self.fp8_dtype, self.pow2_scales, self.amax_epsilon = fp8_dtype, opts["pow2_scales"], opts["amax_epsilon"]
        super().__init__(shape=shape, dtype=dtype, op=op, buffers=dict(
            rowwise_data=rowwise_data, rowwise_scale_inv=rowwise_scale_inv, columnwise_data=columnwise_data,
            columnwise_scale_inv=columnwise_scale_inv))

    @property
    def fmt(self):
        return "fp8_block_1x128" if self.block_dim == 1 else "fp8_block_128x128"

    @property
    def options(self):
        return {"fp8_dtype": self.fp8_dtype, "block_dim": self.block_dim, "pow2_scales": self.pow2_scales,
                "amax_epsilon": self.amax_epsilon}

    def _dequantize(self, rowwise, dtype):
        data, scale = (self.rowwise_data, self.rowwise_scale_inv) if rowwise else \
            (self.columnwise_data, self.columnwise_scale_inv)
        return torch.ops.pyxfer.dequantize_fp8_block(data, scale, self.block_dim, not rowwise, self.fp8_dtype, dtype)


class _SwizzlableTensor(QuantizedTensor):
    """MXFP8 / NVFP4: scales compact or, with ``gemm_swizzled_scales``, in cuBLAS's swizzled order."""

    _COLUMNWISE_TRANSPOSED_SWIZZLE = False

    def _compact_scale(self, rowwise):
        scale = self.rowwise_scale_inv if rowwise else self.columnwise_scale_inv
        if not self.gemm_swizzled_scales:
            return scale
        return unswizzle_scales(scale, transpose=not rowwise and self._COLUMNWISE_TRANSPOSED_SWIZZLE)

    def _convert_scales(self, swizzled):
        if self.gemm_swizzled_scales == swizzled:
            return self
        change = swizzle_scales if swizzled else unswizzle_scales
        out = {}
        for rowwise, name in ((True, "rowwise_scale_inv"), (False, "columnwise_scale_inv")):
            if getattr(self, name) is not None:
                out[name] = change(getattr(self, name), transpose=not rowwise and self._COLUMNWISE_TRANSPOSED_SWIZZLE)
        return self._rebuild(gemm_swizzled_scales=swizzled, **out)

    def with_swizzled_scales(self):
        """This tensor with its scales in cuBLAS's GEMM-swizzled order (self if they already are)."""
        return self._convert_scales(True)

    def with_compact_scales(self):
        """This tensor with compact scales (self if they already are)."""
        return self._convert_scales(False)


class MXFP8Tensor(_SwizzlableTensor):
    """MXFP8: FP8 data in 1x32 (rowwise) / 32x1 (columnwise, same shape, not transposed) blocks with
    E8M0 scale bytes, rowwise ``[rup(M,128), rup(K/32,4)]``, columnwise ``[rup(M/32,4), rup(K,128)]``."""

    fmt = "mxfp8"
    _COLUMNWISE_TRANSPOSED_SWIZZLE = True

    def __init__(self, *, shape, dtype, rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None,
                 columnwise_scale_inv=None, fp8_dtype=torch.float8_e4m3fn, gemm_swizzled_scales=False):
        op = "pyxfer.formats.MXFP8Tensor"
        opts = _check_options(op, "mxfp8", fp8_dtype, {"gemm_swizzled_scales": gemm_swizzled_scales})
        self.fp8_dtype, self.gemm_swizzled_scales = fp8_dtype, opts["gemm_swizzled_scales"]
        super().__init__(shape=shape, dtype=dtype, op=op, buffers=dict(
            rowwise_data=rowwise_data, rowwise_scale_inv=rowwise_scale_inv, columnwise_data=columnwise_data,
            columnwise_scale_inv=columnwise_scale_inv))

    @property
    def options(self):
        return {"fp8_dtype": self.fp8_dtype, "gemm_swizzled_scales": self.gemm_swizzled_scales}

    def _dequantize(self, rowwise, dtype):
        data = self.rowwise_data if rowwise else self.columnwise_data
        return torch.ops.pyxfer.dequantize_mxfp8(data, self._compact_scale(rowwise), not rowwise, self.fp8_dtype, dtype)


class NVFP4Tensor(_SwizzlableTensor):
    """NVFP4: E2M1 pairs (even element in the low nibble) in 1x16 blocks with E4M3 scale bytes and a
    per-tensor fp32 global amax (``amax_rowwise`` / ``amax_columnwise``, shape [1]). Rowwise data
    ``(..., K/2)``, columnwise data ``[K, M/2]`` (transposed)."""

    fmt = "nvfp4"
    _EXTRA_BUFFERS = ("amax_rowwise", "amax_columnwise")

    def __init__(self, *, shape, dtype, rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None,
                 columnwise_scale_inv=None, amax_rowwise=None, amax_columnwise=None, gemm_swizzled_scales=False,
                 fp8_dtype=torch.float8_e4m3fn):
        op = "pyxfer.formats.NVFP4Tensor"
        opts = _check_options(op, "nvfp4", fp8_dtype, {"gemm_swizzled_scales": gemm_swizzled_scales})
        self.gemm_swizzled_scales = opts["gemm_swizzled_scales"]
        super().__init__(shape=shape, dtype=dtype, op=op, buffers=dict(
            rowwise_data=rowwise_data, rowwise_scale_inv=rowwise_scale_inv, columnwise_data=columnwise_data,
            columnwise_scale_inv=columnwise_scale_inv, amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise))
        self.amax_rowwise, self.amax_columnwise = amax_rowwise, amax_columnwise

    @property
    def options(self):
        return {"gemm_swizzled_scales": self.gemm_swizzled_scales}

    def _dequantize(self, rowwise, dtype):
        data, amax = (self.rowwise_data, self.amax_rowwise) if rowwise else (self.columnwise_data, self.amax_columnwise)
        return torch.ops.pyxfer.dequantize_nvfp4(data, self._compact_scale(rowwise), amax, not rowwise, dtype)


# ---- quantize
def global_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 1-element float32 tensor on x's device: NVFP4's global amax when quantize is not
    given one (NaN if x holds a NaN, 0 for an empty x). One pass over x, |x| taken inside the
    reduction (``x.abs().amax()`` writes |x| out and reads it back: three passes)."""
    check_tensor("pyxfer.formats.global_amax", "x", x)
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x.detach(), ord=math.inf, dtype=torch.float32).reshape(1)


def _global_amax(op, x, amax, check_tensor_value):
    if amax is None:
        return global_amax(x)
    if isinstance(amax, torch.Tensor):
        if amax.device != x.device:
            raise ValueError(f"{op}: global_amax must be on x's device ({x.device}), got {amax.device}")
        amax = amax.detach().float().reshape(1)
        if check_tensor_value:
            # NOTE: read on the host: one sync for a CUDA tensor (a host float avoids it).
            value = float(amax[0])
            _check_amax_value(op, value, True, f"a tensor holding {value!r}")
        return amax
    return torch.tensor([amax], dtype=torch.float32, device=x.device)


def quantize(x: torch.Tensor, fmt: str, *, rowwise: bool = True, columnwise: bool = False,
             fp8_dtype=torch.float8_e4m3fn, **options) -> QuantizedTensor:
    """Quantize ``x`` (float32 / bfloat16 / float16, any strides, on CPU or CUDA) into ``fmt`` with
    the requested usages, on x's device; x is not modified. Options: FP8 block ``pow2_scales=True``,
    ``amax_epsilon=0.0`` (a finite float >= 0); MXFP8 ``gemm_swizzled_scales=False``; NVFP4
    ``global_amax=None`` (None: the amax of x; or a finite value >= 0 in float32 range, given as a
    Python or numpy number or as a 1-element floating-point tensor on x's device, e.g. all-reduced
    over a group: a CUDA tensor's value is checked with one host sync, which a host float avoids)
    and ``gemm_swizzled_scales=False``. The nominal dtype of the result is x.dtype.
    Raises ValueError / TypeError naming the argument: unknown fmt or option, wrong dtypes, shapes
    that the format cannot store (MXFP8: M, K multiples of 32; NVFP4: multiples of 16), a sparse,
    nested, quantized or meta x, a NaN / infinite / negative global_amax or amax_epsilon."""
    return _quantize(x, fmt, rowwise=rowwise, columnwise=columnwise, fp8_dtype=fp8_dtype, check_amax_tensor=True,
                     **options)


def _quantize(x, fmt, *, rowwise, columnwise, fp8_dtype=torch.float8_e4m3fn, check_amax_tensor, **options):
    """:func:`quantize`; ``check_amax_tensor=False`` takes a tensor global_amax as it is, for an amax
    pyxfer derived from data itself (the gather's group maximum of the shards' amaxes): NaN for data
    holding NaN, like the amax quantize computes from x, and kept on the device (no host sync)."""
    op = "pyxfer.formats.quantize"
    _check_format(op, fmt)
    check_tensor(op, "x", x)
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    check_bool(op, "rowwise", rowwise)
    check_bool(op, "columnwise", columnwise)
    if not (rowwise or columnwise):
        raise ValueError(f"{op}: at least one of rowwise and columnwise must be True")
    opts = _check_options(op, fmt, fp8_dtype, options)
    _check_storable(op, "x", fmt, tuple(x.shape))
    x = x.detach()
    if fmt.startswith("fp8_block"):
        block_dim = 1 if fmt == "fp8_block_1x128" else 2
        bufs = torch.ops.pyxfer.quantize_fp8_block(x, block_dim, rowwise, columnwise, fp8_dtype,
                                                   opts["pow2_scales"], opts["amax_epsilon"])
        cls, extra = Float8BlockTensor, dict(fp8_dtype=fp8_dtype, block_dim=block_dim,
                                             pow2_scales=opts["pow2_scales"], amax_epsilon=opts["amax_epsilon"])
    elif fmt == "mxfp8":
        bufs = torch.ops.pyxfer.quantize_mxfp8(x, rowwise, columnwise, fp8_dtype)
        cls, extra = MXFP8Tensor, dict(fp8_dtype=fp8_dtype)
    else:
        amax = _global_amax(op, x, opts["global_amax"], check_amax_tensor)
        bufs = torch.ops.pyxfer.quantize_nvfp4(x, amax, rowwise, columnwise)
        cls, extra = NVFP4Tensor, dict(amax_rowwise=amax if rowwise else None,
                                       amax_columnwise=(amax.clone() if rowwise else amax) if columnwise else None)
    # The native ops return a 0-element placeholder for a usage not asked for.
    wanted = (rowwise, rowwise, columnwise, columnwise)
    buffers = {name: b if on else None for name, b, on in zip(BUFFER_NAMES, bufs, wanted)}
    qt = cls(shape=x.shape, dtype=x.dtype, **buffers, **extra)
    return qt.with_swizzled_scales() if opts.get("gemm_swizzled_scales") else qt


class QuantizeSpec:
    """What to quantize into: format, usages, FP8 dtype and format options (as ``quantize`` takes
    them; NVFP4 global_amax may only be None or a float here: numpy scalars are kept as floats).
    Immutable and hashable; pickle, copy and deepcopy give an equal spec (a worker process can be
    handed one). ``spec.quantize(x)`` quantizes; ``spec.is_quantizable(shape)`` applies TE's rule."""

    __slots__ = ("fmt", "rowwise", "columnwise", "fp8_dtype", "_options")

    def __init__(self, fmt, *, rowwise=True, columnwise=False, fp8_dtype=torch.float8_e4m3fn, **options):
        op = "pyxfer.formats.QuantizeSpec"
        _check_format(op, fmt)
        check_bool(op, "rowwise", rowwise)
        check_bool(op, "columnwise", columnwise)
        if not (rowwise or columnwise):
            raise ValueError(f"{op}: at least one of rowwise and columnwise must be True")
        merged = _check_options(op, fmt, fp8_dtype, options, allow_tensor_amax=False)
        merged.pop("fp8_dtype")
        for name, value in (("fmt", fmt), ("rowwise", rowwise), ("columnwise", columnwise), ("fp8_dtype", fp8_dtype),
                            ("_options", tuple(sorted(merged.items())))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"QuantizeSpec is immutable: cannot set {name!r}")

    def __reduce__(self):
        # NOTE: through the constructor (checked again), not pickle's default of setting the slots,
        # which __setattr__ refuses.
        return functools.partial(QuantizeSpec, self.fmt, rowwise=self.rowwise, columnwise=self.columnwise,
                                 fp8_dtype=self.fp8_dtype, **self.options), ()

    def __copy__(self):
        return self  # immutable: a copy may be the same object, as for tuples

    def __deepcopy__(self, memo):
        return self

    @property
    def options(self) -> dict:
        return dict(self._options)

    def quantize(self, x: torch.Tensor, **overrides) -> QuantizedTensor:
        """quantize(x) with this spec (``overrides`` replace options, e.g. an all-reduced global_amax)."""
        return quantize(x, self.fmt, rowwise=self.rowwise, columnwise=self.columnwise, fp8_dtype=self.fp8_dtype,
                        **{**self.options, **overrides})

    def is_quantizable(self, shape) -> bool:
        return is_quantizable(shape, self.fmt)

    def _key(self):
        return (self.fmt, self.rowwise, self.columnwise, str(self.fp8_dtype), self._options)

    def __eq__(self, other):
        return isinstance(other, QuantizeSpec) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        opts = "".join(f", {k}={v!r}" for k, v in self._options)
        return (f"QuantizeSpec({self.fmt!r}, rowwise={self.rowwise}, columnwise={self.columnwise}, "
                f"fp8_dtype={self.fp8_dtype}{opts})")


# ---- layout helpers for pyxfer.gather -------------------------------------------------------------
# (one block: the gather wraps gathered buffers as tensors of a spec's format and options)

_TENSOR_CLASSES = {"fp8_block_1x128": Float8BlockTensor, "fp8_block_128x128": Float8BlockTensor,
                   "mxfp8": MXFP8Tensor, "nvfp4": NVFP4Tensor}


def tensor_from_buffers(spec: "QuantizeSpec", shape, dtype, buffers: dict, *, like=None) -> QuantizedTensor:
    """A QuantizedTensor of ``spec``'s format and options (scales swizzled iff its
    gemm_swizzled_scales option is) wrapping ``buffers`` (names as ``QuantizedTensor.buffers()``;
    NVFP4 amax buffers included), validated, not copied. ``shape``: logical shape; ``dtype``: nominal
    dtype. ``like``: a tensor this function returned for the same spec, shape and dtype from buffers
    of the same names, shapes, dtypes and device (the caller guarantees it): the new one is made
    like it without validating again (host time of a call that repeats). Raises ValueError as the
    tensor class's constructor does."""
    if like is not None:
        out = copy.copy(like)
        for name in BUFFER_NAMES + getattr(out, "_EXTRA_BUFFERS", ()):
            setattr(out, name, buffers.get(name))
        return out
    opts = spec.options
    kwargs = dict(shape=torch.Size(shape), dtype=dtype, **buffers)
    if spec.fmt.startswith("fp8_block"):
        kwargs.update(fp8_dtype=spec.fp8_dtype, block_dim=1 if spec.fmt == "fp8_block_1x128" else 2,
                      pow2_scales=opts["pow2_scales"], amax_epsilon=opts["amax_epsilon"])
    elif spec.fmt == "mxfp8":
        kwargs.update(fp8_dtype=spec.fp8_dtype, gemm_swizzled_scales=opts["gemm_swizzled_scales"])
    else:
        kwargs.update(gemm_swizzled_scales=opts["gemm_swizzled_scales"])
    return _TENSOR_CLASSES[spec.fmt](**kwargs)
