"""All-gather along dim 0 over torch.distributed, for plain tensors and pyxfer.formats
QuantizedTensors, with a correct dequantize-then-gather fallback and optional PXH64 verification.

Protocol of one call (every rank runs the same steps, so every rank takes the same path):

1. Metadata: a fixed-size int64 record per rank (kind, format, dtypes, options, usages, shape,
   NVFP4 amax bits, and with ``verify`` the PXH64 of every buffer the rank will send), all-gathered
   on the data's device (NCCL needs device memory) and read back once by the host. Disagreements
   raise the same ValueError on every rank.
   - Waiting calls: the records are gathered alone and read before any data is sent (on CUDA on a
     side stream that waits for the caller's stream only when the record holds values computed
     there, so the host's wait does not include unrelated queued work).
   - Fused mode: once a group's last two waiting calls agreed on the same signature (the fields
     every rank must agree on), every call of the group posts one collective, its data buffers and
     its record, and checks the records after the data arrived: the host never waits before the data
     moves and async calls return at once. A rank whose call has another signature posts scratch
     buffers of the agreed layout instead and reads the records at once; if every rank did so the
     call goes on as a waiting call, else every rank raises the same error (the ranks that posted
     data from ``wait()``). The mode changes only in waiting calls, so it is the same on every rank.
2. Path: fixed by the signature: quantized when every shard is quantizable (TE's ``is_quantizable``),
   else fallback (dequantize to the nominal dtype, ``.contiguous()``, gather, requantize only if the
   gathered shape is quantizable). NVFP4 shards quantized with different global amax (known from the
   records, after the data arrived) are gathered quantized all the same and then decoded shard by
   shard with their own amax and requantized: the same result as the dequantize-then-gather fallback
   from a quarter of the bytes, and the fallback warning says so.
3. Data: every buffer gathered (raw bytes for dtypes the backends lack) in one coalesced NCCL group
   (gloo: all buffers packed into one byte buffer, one all-gather), straight into the result where
   the rank-major concatenation already is the right layout, into temporaries where a fix-up is
   needed (FP8-block rowwise 1x128 scales, FP8-block columnwise data, 128x128 columnwise scales,
   NVFP4 columnwise data and scales). Padded shard scales are trimmed before and zero-padded after,
   so the result is bit-identical (padding included) to quantizing the full tensor in one process.
4. Post-processing (fault injection for tests, verification, fix-ups, requantization, swizzling)
   runs after the data arrived: at once, or in ``handle.wait()`` with ``async_op=True``.

The differences from Transformer Engine's gather (specs/quantized-formats.md §6.6) are deliberate:
contiguous fallbacks, async kept in every path, nothing post-processed before the data arrived,
128x128 gathered quantized, metadata compared across ranks, NVFP4 amax checked, swizzled scales
unswizzled before gathering, requantization only for quantizable gathered shapes.
"""
import contextlib
import dataclasses
import math
import os
import struct
import sys
import warnings
import weakref

import torch
import torch.distributed as dist

from . import formats, testing
from ._checks import check_tensor
from .checksums import as_uint64

__all__ = ["all_gather", "GatherHandle", "QuantizedGatherFallbackWarning", "GatherVerificationError"]

_OP = "pyxfer.all_gather"


class QuantizedGatherFallbackWarning(UserWarning):
    """all_gather gathered in high precision instead of quantized; the message says why (the shard
    dimension and block size, or the NVFP4 amax that differs). Shown once per call site and reason."""


class GatherVerificationError(RuntimeError):
    """A shard arrived with other bytes than its sender hashed (``verify=True``). Attributes:
    ``src_rank`` (sender, group rank), ``rank`` (receiver), ``buffer`` (e.g. "rowwise_data"),
    ``num_bytes``, ``expected`` (sender PXH64) and ``actual`` (receiver PXH64), unsigned ints."""

    def __init__(self, message, *, src_rank, rank, buffer, num_bytes, expected, actual):
        super().__init__(message)
        self.src_rank, self.rank, self.buffer = src_rank, rank, buffer
        self.num_bytes, self.expected, self.actual = num_bytes, expected, actual


# ---------------------------------------------------------------------------------------------
# Codes carried in the metadata record

_FORMATS = (None, "fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4")
_NVFP4_CODE = _FORMATS.index("nvfp4")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
           torch.float8_e5m2] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fnuz",
                                                             "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}  # 0: none
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Flattened-row block a shard must be a multiple of (TE's is_quantizable; K has the same rule).
_BLOCK = {"fp8_block_1x128": 128, "fp8_block_128x128": 128, "mxfp8": 32, "nvfp4": 16}

KIND_PLAIN, KIND_QUANTIZED, KIND_TO_QUANTIZE = 0, 1, 2  # tensor; QuantizedTensor; tensor + quantize_as
_KIND_NAMES = {0: "plain tensor", 1: "QuantizedTensor", 2: "tensor with quantize_as"}
_MAGIC = 0x70786761_74680003  # "pxgath", protocol version 3
_MAX_DIMS = 8
_MAX_HASHES = 4
# Record layout (int64 slots). Slots [0, _AGREE_LEN) must be equal on every rank: the common case
# is checked with one comparison per rank.
(_F_MAGIC, _F_ERROR, _F_KIND, _F_FMT, _F_DTYPE, _F_FP8, _F_ROW, _F_COL, _F_SWIZZLED, _F_POW2, _F_EPS,
 _F_AMAX_AUTO, _F_VERIFY, _F_HASHES_IN_META, _F_NDIM) = range(15)
_F_SHAPE = 15
_AGREE_LEN = _F_SHAPE + _MAX_DIMS
_F_RANK, _F_AMAX_ROW, _F_AMAX_COL, _F_NHASH = range(_AGREE_LEN, _AGREE_LEN + 4)
_F_HASH = _F_NHASH + 1
_META_LEN = 48  # room to grow without changing the record's size
assert _F_HASH + _MAX_HASHES <= _META_LEN
# Fields every rank must agree on, in the order they are compared, with their names in errors.
_AGREE = [(_F_KIND, "input kind"), (_F_FMT, "format"), (_F_DTYPE, "dtype"), (_F_FP8, "fp8_dtype"),
          (_F_ROW, "rowwise usage"), (_F_COL, "columnwise usage"), (_F_SWIZZLED, "gemm_swizzled_scales"),
          (_F_POW2, "pow2_scales"), (_F_EPS, "amax_epsilon"), (_F_AMAX_AUTO, "NVFP4 global_amax (given or not)"),
          (_F_VERIFY, "verify"), (_F_HASHES_IN_META, "where the hashes travel"), (_F_NDIM, "ndim")]


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _f64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _describe(slot, value):
    """A metadata value as people read it (for error messages)."""
    if slot == _F_KIND:
        return _KIND_NAMES.get(value, str(value))
    if slot == _F_FMT:
        return repr(_FORMATS[value]) if 0 <= value < len(_FORMATS) else str(value)
    if slot in (_F_DTYPE, _F_FP8):
        return str(_DTYPES[value - 1]).removeprefix("torch.") if 0 < value <= len(_DTYPES) else "none"
    if slot == _F_EPS:
        return repr(_bits_f64(value))
    if slot in (_F_AMAX_ROW, _F_AMAX_COL):
        return repr(_bits_f32(value))
    if slot in (_F_ROW, _F_COL, _F_SWIZZLED, _F_POW2, _F_AMAX_AUTO, _F_VERIFY):
        return str(bool(value))
    return str(value)


# ---------------------------------------------------------------------------------------------
# Format descriptions

@dataclasses.dataclass(frozen=True)
class _Desc:
    """What a quantized result looks like: format, usages and options (not the data)."""
    fmt: str
    rowwise: bool
    columnwise: bool
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    pow2_scales: bool = True
    amax_epsilon: float = 0.0
    swizzled: bool = False
    global_amax: float = None  # NVFP4 quantize_as: the value the caller gave; None: amax of the data

    def quantize(self, x, global_amax=None, swizzled=None):
        """Quantize ``x`` (any leading dims) as described; NVFP4 with ``global_amax`` if given."""
        opts = {}
        if self.fmt.startswith("fp8_block"):
            opts = dict(fp8_dtype=self.fp8_dtype, pow2_scales=self.pow2_scales, amax_epsilon=self.amax_epsilon)
        elif self.fmt == "mxfp8":
            opts = dict(fp8_dtype=self.fp8_dtype, gemm_swizzled_scales=self.swizzled if swizzled is None else swizzled)
        else:
            amax = self.global_amax if global_amax is None else global_amax
            opts = dict(global_amax=amax, gemm_swizzled_scales=self.swizzled if swizzled is None else swizzled)
        # A tensor amax here is the group's maximum of the shards' amaxes: data, not an argument to check.
        return formats._quantize(x, self.fmt, rowwise=self.rowwise, columnwise=self.columnwise,
                                 check_amax_tensor=False, **opts)

    def is_quantizable(self, shape) -> bool:
        return formats.is_quantizable(tuple(shape), self.fmt)


def _desc_of_tensor(q) -> _Desc:
    fmt = q.fmt
    fp8 = getattr(q, "fp8_dtype", torch.float8_e4m3fn) if fmt != "nvfp4" else torch.float8_e4m3fn
    return _Desc(fmt, bool(q.rowwise_usage), bool(q.columnwise_usage), fp8,
                 bool(getattr(q, "pow2_scales", True)) if fmt.startswith("fp8_block") else True,
                 float(getattr(q, "amax_epsilon", 0.0)) if fmt.startswith("fp8_block") else 0.0,
                 bool(getattr(q, "gemm_swizzled_scales", False)))


def _desc_of_spec(spec) -> _Desc:
    fmt = spec.fmt
    opts = dict(getattr(spec, "options", None) or {})
    fp8 = getattr(spec, "fp8_dtype", opts.get("fp8_dtype", torch.float8_e4m3fn))
    amax = opts.get("global_amax")
    if isinstance(amax, torch.Tensor):
        amax = float(amax.reshape(-1)[0].item())
    return _Desc(fmt, bool(spec.rowwise), bool(spec.columnwise), fp8 if fmt != "nvfp4" else torch.float8_e4m3fn,
                 bool(opts.get("pow2_scales", True)) if fmt.startswith("fp8_block") else True,
                 float(opts.get("amax_epsilon", 0.0)) if fmt.startswith("fp8_block") else 0.0,
                 bool(opts.get("gemm_swizzled_scales", False)) if fmt in ("mxfp8", "nvfp4") else False,
                 None if amax is None else float(amax))


def _qt_class(fmt):
    return {"fp8_block_1x128": formats.Float8BlockTensor, "fp8_block_128x128": formats.Float8BlockTensor,
            "mxfp8": formats.MXFP8Tensor, "nvfp4": formats.NVFP4Tensor}[fmt]


def _build_qt(desc: _Desc, shape, dtype, buffers: dict, amax_row=None, amax_col=None):
    """A QuantizedTensor of ``desc`` wrapping ``buffers`` (names as QuantizedTensor's, no copies)."""
    kw = dict(shape=torch.Size(shape), dtype=dtype,
              rowwise_data=buffers.get("rowwise_data"), rowwise_scale_inv=buffers.get("rowwise_scale_inv"),
              columnwise_data=buffers.get("columnwise_data"), columnwise_scale_inv=buffers.get("columnwise_scale_inv"))
    if desc.fmt.startswith("fp8_block"):
        kw.update(fp8_dtype=desc.fp8_dtype, block_dim=1 if desc.fmt == "fp8_block_1x128" else 2,
                  pow2_scales=desc.pow2_scales, amax_epsilon=desc.amax_epsilon)
    elif desc.fmt == "mxfp8":
        kw.update(fp8_dtype=desc.fp8_dtype, gemm_swizzled_scales=False)
    else:
        kw.update(amax_rowwise=amax_row, amax_columnwise=amax_col, gemm_swizzled_scales=False)
    return _qt_class(desc.fmt)(**kw)


def _is_quantized_tensor(x) -> bool:
    return isinstance(x, formats.QuantizedTensor)


def _why_not_quantizable(shape, fmt) -> str:
    """Why TE's is_quantizable rejects ``shape`` for ``fmt`` (for the fallback warning)."""
    block = _BLOCK[fmt]
    if len(shape) < 2:
        return f"it has {len(shape)} dim(s) and {fmt} needs at least 2"
    m, k = math.prod(shape[:-1]), shape[-1]
    what = []
    if m % block:
        what.append(f"its flattened rows M = {'*'.join(map(str, shape[:-1]))} = {m} are not a multiple of {block}")
    if k % block:
        what.append(f"its last dim K = {k} is not a multiple of {block}")
    return " and ".join(what) + f" ({fmt} blocks need M and K multiples of {block})"


# ---------------------------------------------------------------------------------------------
# Parts: one gathered buffer each. ``send`` is this rank's contiguous bytes, ``recv`` the
# rank-major receive buffer (W * send bytes) as flat bytes, ``finish()`` the final tensor.

# Dtypes both NCCL and gloo gather natively; others (bool, fp8, complex, ...) travel as bytes.
_NATIVE = frozenset((torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                     torch.float32, torch.float64))


class _Part:
    """``send``: this rank's contiguous buffer; ``recv``: the rank-major receive buffer (W times
    ``send``'s elements, same dtype); ``nbytes``: bytes each rank sends; ``finish()``: the final tensor."""
    __slots__ = ("name", "send", "recv", "nbytes", "finish")

    def __init__(self, name, send, recv, finish):
        if send.dtype not in _NATIVE:
            send, recv = _bytes(send), _bytes(recv)
        self.name, self.send, self.recv, self.finish = name, send, recv, finish
        self.nbytes = send.numel() * send.element_size()

    def region(self, rank) -> torch.Tensor:
        """The bytes received from ``rank`` (a flat uint8 view of ``recv``)."""
        return _bytes(self.recv)[rank * self.nbytes:(rank + 1) * self.nbytes]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (any dtype; 0-dim and empty included)."""
    t = t.reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _direct(name, src, out_shape) -> _Part:
    """Rank-major concatenation is already the result (data; unpadded scales)."""
    src = src.contiguous()
    out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
    return _Part(name, src, out, lambda: out)


def _prefix(name, src, world, out_shape) -> _Part:
    """Row-trimmed scales: gather into the first rows of the result; its padding rows are zeroed
    now (they are never written by the collective)."""
    src = src.contiguous()
    out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
    rows = world * src.shape[0]
    if rows == out.shape[0]:
        return _Part(name, src, out, lambda: out)
    out[rows:].zero_()
    return _Part(name, src, out[:rows], lambda: out)


def _swap(name, src, world, out_shape, pad_shape=None) -> _Part:
    """Rank-major [W, A, B...] needs out[a, r, b...] = temp[r, a, b...] (then maybe zero-padding)."""
    src = src.contiguous()
    shape = tuple(src.shape)
    temp = torch.empty((world * shape[0],) + shape[1:], dtype=src.dtype, device=src.device)  # rank-major

    def finish():
        swapped = torch.ops.pyxfer.swap_first_dims(temp.view((world,) + shape))
        if pad_shape is None:
            return swapped.reshape(out_shape)
        rows, cols = src.shape[0], world * src.shape[1]
        out = torch.zeros(pad_shape, dtype=src.dtype, device=src.device)
        out[:rows, :cols].copy_(swapped.reshape(rows, cols))
        return out
    return _Part(name, src, temp, finish)


def _rup(a, b):
    return -(-a // b) * b


def _quantized_parts(q, desc: _Desc, world: int):
    """Parts gathering compact QuantizedTensor ``q`` (shard shape quantizable for its format) so that
    the finished buffers are those of quantizing the (W*d0, ...) tensor in one process."""
    shape = tuple(q.shape)
    m, k = math.prod(shape[:-1]), shape[-1]
    out_shape = (world * shape[0],) + shape[1:]
    wm = world * m
    parts = []
    rd, rs, cd, cs = q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv
    if desc.fmt == "fp8_block_1x128":
        # rowwise scale [K/128, M] (M is the fast axis; M % 128 == 0, so no padding): swap to [K/128, W*M].
        # columnwise data (K, d0, ...) = [K, M]: swap to [K, W*M]; columnwise scale [M/128, K]: concat.
        if desc.rowwise:
            parts.append(_direct("rowwise_data", rd, out_shape))
            parts.append(_swap("rowwise_scale_inv", rs.reshape(rs.shape[0], m), world, (rs.shape[0], wm)))
        if desc.columnwise:
            parts.append(_swap("columnwise_data", cd.reshape(k, m), world, (k,) + out_shape[:-1]))
            parts.append(_direct("columnwise_scale_inv", cs, (world * cs.shape[0], cs.shape[1])))
    elif desc.fmt == "fp8_block_128x128":
        # rowwise scale [M/128, rup(K/128, 4)]: concat. columnwise data = byte transpose [K, M]: swap.
        # columnwise scale [K/128, rup(M/128, 4)]: trim to [K/128, M/128], swap, zero-pad to rup(W*M/128, 4).
        mb, kb = m // 128, cs.shape[0] if cs is not None and cs.numel() else -(-k // 128)
        if desc.rowwise:
            parts.append(_direct("rowwise_data", rd, out_shape))
            parts.append(_direct("rowwise_scale_inv", rs, (world * rs.shape[0], rs.shape[1])))
        if desc.columnwise:
            parts.append(_swap("columnwise_data", cd.reshape(k, m), world, (k,) + out_shape[:-1]))
            parts.append(_swap("columnwise_scale_inv", cs[:, :mb], world, None, pad_shape=(kb, _rup(world * mb, 4))))
    elif desc.fmt == "mxfp8":
        # Data not transposed: concat. Scales compact [rup(M,128), .] / [rup(M/32,4), .]: trim rows, concat, zero-pad.
        if desc.rowwise:
            parts.append(_direct("rowwise_data", rd, out_shape))
            parts.append(_prefix("rowwise_scale_inv", rs[:m], world, (_rup(wm, 128), rs.shape[1])))
        if desc.columnwise:
            parts.append(_direct("columnwise_data", cd, out_shape))
            parts.append(_prefix("columnwise_scale_inv", cs[: m // 32], world, (_rup(wm // 32, 4), cs.shape[1])))
    else:  # nvfp4
        # rowwise data (..., K/2): concat; rowwise scale [rup(M,128), .]: trim rows, concat, zero-pad.
        # columnwise data [K, M/2]: swap to [K, W*M/2]; columnwise scale [rup(K,128), rup(M/16,4)]:
        # trim to [K, M/16], swap to [K, W*M/16], zero-pad to [rup(K,128), rup(W*M/16,4)].
        if desc.rowwise:
            parts.append(_direct("rowwise_data", rd, out_shape[:-1] + (k // 2,)))
            parts.append(_prefix("rowwise_scale_inv", rs[:m], world, (_rup(wm, 128), rs.shape[1])))
        if desc.columnwise:
            parts.append(_swap("columnwise_data", cd, world, (k, wm // 2)))
            parts.append(_swap("columnwise_scale_inv", cs[:k, : m // 16], world, None,
                               pad_shape=(_rup(k, 128), _rup(wm // 16, 4))))
    return parts


def _plain_part(t: torch.Tensor, world: int) -> _Part:
    return _direct("data", t, (world * t.shape[0],) + tuple(t.shape[1:]))


def _hash_all(parts):
    """PXH64 of every part's send bytes, as one int64 tensor on their device (no host sync)."""
    return torch.stack([torch.ops.pyxfer.checksum(p.send, 0) for p in parts])


# ---------------------------------------------------------------------------------------------
# The local side of a call: what this rank has and would send

class _Local:
    """This rank's input, normalised: ``kind``, ``desc`` (format, usages, options of the result),
    ``dtype`` (plain dtype / nominal dtype), ``shape``, and the parts it predicts it will send."""

    def __init__(self, x, quantize_as, verify, world):
        self.error = None
        self.device = None
        self.kind, self.desc, self.dtype, self.shape = KIND_PLAIN, None, None, ()
        self.x = None            # plain / high-precision tensor (kinds 0 and 2)
        self.q = None            # compact QuantizedTensor (kind 1; kind 2 once quantized)
        self.amax_dev = None     # NVFP4: 1-element fp32 tensors (amax_rowwise, amax_columnwise) or (shard amax,)
        self.amax_value = None   # NVFP4 given global amax (host float)
        self.send = None         # what this rank will send if the ranks agree: ("plain", tensor) or
        #                          ("quantized", compact QuantizedTensor); None: known after the exchange
        self.parts = None        # self.send as parts (built by build_parts)
        self.hashes = None
        self.out_swizzled = False
        self.verify = verify
        try:
            self._prepare(x, quantize_as, world)
            if verify is True and world > 1:
                self.build_parts(world)  # the hashes travel in the metadata
        except Exception as e:  # reported to every rank through the metadata, raised here afterwards
            self.error = e

    def build_parts(self, world):
        if self.parts is None and self.send is not None:
            what, t = self.send
            self.parts = [_plain_part(t, world)] if what == "plain" else _quantized_parts(t, self.desc, world)

    def _prepare(self, x, quantize_as, world):
        device = getattr(x, "device", None)  # known even if x is rejected: the metadata goes there
        self.device = device if isinstance(device, torch.device) and device.type in ("cpu", "cuda") else None
        if not isinstance(self.verify, bool):
            raise TypeError(f"{_OP}: verify must be a bool, got {type(self.verify).__name__}")
        spec = None
        if quantize_as is not None:
            if not isinstance(quantize_as, formats.QuantizeSpec):
                raise TypeError(f"{_OP}: quantize_as must be a pyxfer.formats.QuantizeSpec or None, "
                                f"got {type(quantize_as).__name__}")
            spec = _desc_of_spec(quantize_as)
        if _is_quantized_tensor(x):
            self.device = x.device
            desc = _desc_of_tensor(x)
            self.out_swizzled = desc.swizzled
            if spec is not None and not self._matches(x, desc, spec):
                x = x.dequantize()  # the nominal dtype; every usage and format decodes (NVFP4 columnwise too)
            else:
                if spec is not None:
                    self.out_swizzled = spec.swizzled
                    desc = dataclasses.replace(desc, rowwise=spec.rowwise, columnwise=spec.columnwise)
                self._prepare_quantized(x, desc, world)
                return
        check_tensor(_OP, "x", x)
        if x.dim() == 0:
            raise ValueError(f"{_OP}: x must have at least one dim (gathered along dim 0), got a 0-dim tensor")
        if x.dim() > _MAX_DIMS:
            raise ValueError(f"{_OP}: x has {x.dim()} dims; at most {_MAX_DIMS} are supported")
        if x.dtype not in _DTYPE_CODE:
            raise TypeError(f"{_OP}: x has dtype {x.dtype}, which cannot be gathered")
        x = x.detach()
        self.device, self.dtype, self.shape = x.device, x.dtype, tuple(x.shape)
        if spec is None:
            self.kind, self.x, self.send = KIND_PLAIN, x, ("plain", x)
            return
        if x.dtype not in _HP_DTYPES:
            raise TypeError(f"{_OP}: quantize_as needs a float32, bfloat16 or float16 tensor, got {x.dtype}")
        self.kind, self.x, self.desc, self.out_swizzled = KIND_TO_QUANTIZE, x, spec, spec.swizzled
        self.amax_value = spec.global_amax if spec.fmt == "nvfp4" else None
        if world == 1:
            return
        if not spec.is_quantizable(self.shape):
            self.send = ("plain", x)  # fallback in the input dtype
        elif spec.fmt == "nvfp4" and spec.global_amax is None:
            self.amax_dev = (formats.global_amax(x),)  # global amax = max over ranks, known later
        else:
            self.q = spec.quantize(x, swizzled=False)
            self.send = ("quantized", self.q)

    @staticmethod
    def _matches(q, desc: _Desc, spec: _Desc) -> bool:
        """Can ``q`` be gathered as is (maybe dropping a usage, maybe re-swizzled) to give ``spec``?"""
        if (q.fmt, desc.fp8_dtype, desc.pow2_scales, desc.amax_epsilon) != \
                (spec.fmt, spec.fp8_dtype, spec.pow2_scales, spec.amax_epsilon):
            return False
        if (spec.rowwise and not desc.rowwise) or (spec.columnwise and not desc.columnwise):
            return False
        if spec.fmt == "nvfp4" and spec.global_amax is not None:
            amax = q.amax_rowwise if q.amax_rowwise is not None else q.amax_columnwise
            return float(amax.reshape(-1)[0].item()) == spec.global_amax
        return True

    def _prepare_quantized(self, q, desc: _Desc, world):
        if len(q.shape) == 0 or len(q.shape) > _MAX_DIMS:
            raise ValueError(f"{_OP}: x has {len(q.shape)} dims; 1 to {_MAX_DIMS} are supported")
        if not (desc.rowwise or desc.columnwise):
            raise ValueError(f"{_OP}: x ({q.fmt}) has neither rowwise nor columnwise data")
        if desc.swizzled:
            q = q.with_compact_scales()  # gather compact (rank concatenation of swizzled scales is wrong, spec §5)
        self.kind, self.desc, self.dtype, self.shape = KIND_QUANTIZED, \
            dataclasses.replace(desc, swizzled=False) if desc.swizzled else desc, \
            q.dtype, tuple(q.shape)
        if desc.fmt == "nvfp4":
            row = q.amax_rowwise if desc.rowwise else None
            col = q.amax_columnwise if desc.columnwise else None
            self.amax_dev = (row if row is not None else col, col if col is not None else row)
        self.q = q
        if world == 1:
            return
        if self.desc.is_quantizable(self.shape):
            self.send = ("quantized", q)
        else:
            self.x = q.dequantize()
            self.send = ("plain", self.x)

    def record(self, rank) -> list:
        """The host part of this rank's metadata record (amax and hashes are written on the device)."""
        meta = [0] * _META_LEN
        meta[_F_MAGIC], meta[_F_RANK] = _MAGIC, rank
        if self.error is not None:
            meta[_F_ERROR] = 1
            return meta
        d = self.desc
        meta[_F_KIND], meta[_F_DTYPE], meta[_F_VERIFY] = self.kind, _DTYPE_CODE[self.dtype], int(self.verify)
        if d is not None:
            meta[_F_FMT], meta[_F_ROW], meta[_F_COL] = _FORMATS.index(d.fmt), int(d.rowwise), int(d.columnwise)
            meta[_F_FP8] = _DTYPE_CODE[d.fp8_dtype] if d.fmt != "nvfp4" else 0
            meta[_F_SWIZZLED], meta[_F_POW2], meta[_F_EPS] = int(self.out_swizzled), int(d.pow2_scales), \
                _f64_bits(d.amax_epsilon)
            if d.fmt == "nvfp4":
                meta[_F_AMAX_AUTO] = int(self.kind == KIND_TO_QUANTIZE and d.global_amax is None)
                if self.amax_value is not None:
                    meta[_F_AMAX_ROW] = meta[_F_AMAX_COL] = _f32_bits(self.amax_value)
        meta[_F_NDIM] = len(self.shape)
        meta[_F_SHAPE:_F_SHAPE + len(self.shape)] = self.shape
        if self.verify and self.parts is not None:
            meta[_F_HASHES_IN_META], meta[_F_NHASH] = 1, len(self.parts)
            assert len(self.parts) <= _MAX_HASHES
        return meta


# ---------------------------------------------------------------------------------------------
# Metadata exchange and agreement

_OPTS = None


def _allgather(outs, ins, group):
    """Start an all-gather of ``ins`` (contiguous, one device) into ``outs`` (W times as many
    elements each, rank-major); returns the backend's Work. The process group's own methods are
    called directly: torch.distributed's Python wrappers add tens of microseconds per call, and
    ``all_gather_into_tensor`` warns (FutureWarning) on torch >= 2.13. CUDA (NCCL): one coalesced
    collective (one ncclGroup). CPU (gloo): exactly one tensor, through ``_allgather_base`` (gloo's
    plain all-gather): gloo's coalesced all-gather mis-gathers lists of mixed dtypes, and with
    several gloo all-gathers in flight at once on torch 2.14 a rank was seen to hang in gloo's
    buffer teardown (another run died of heap corruption), so the CPU path never has more than one
    of its own in flight (see _launch)."""
    global _OPTS
    if _OPTS is None:
        _OPTS = dist.AllgatherOptions() if hasattr(dist, "AllgatherOptions") else \
            __import__("torch.distributed.distributed_c10d", fromlist=["x"]).AllgatherOptions()
        if hasattr(_OPTS, "asyncOp"):
            _OPTS.asyncOp = True
    if ins[0].is_cuda:
        return group.allgather_into_tensor_coalesced(outs, ins, _OPTS)
    (out,), (inp,) = outs, ins
    return group._allgather_base(out, inp, _OPTS)


_side_streams = {}  # device -> the stream the records travel on (created once per device)


def _side_stream(device):
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def _device_values(local: _Local, meta):
    """Write what the device computes (NVFP4 amax bits, PXH64 of the sent buffers) into ``meta``."""
    if local.amax_dev is not None:
        bits = torch.cat([a.reshape(1).float() for a in local.amax_dev]).view(torch.int32).to(torch.int64)
        meta[_F_AMAX_ROW:_F_AMAX_ROW + bits.numel()].copy_(bits)
    if local.verify and local.parts is not None:
        local.hashes = _hash_all(local.parts)
        meta[_F_HASH:_F_HASH + len(local.parts)].copy_(local.hashes)


class _RecordBuffers:
    """The buffers of one record exchange on a CUDA device, reused across calls (allocating pinned
    memory, device memory and an event per call cost more host time than the exchange itself): this
    rank's record (pinned host and device copies), the gathered records (device, and the pinned copy
    the host reads), the event after that copy, and ``read_done``, recorded when the set is given back
    on the stream where ``max_amax`` read the records on the device (if it did)."""

    def __init__(self, device, world):
        self.host_send = torch.empty(_META_LEN, dtype=torch.int64, pin_memory=True)
        self.send_np = self.host_send.numpy()
        self.host = torch.empty(world * _META_LEN, dtype=torch.int64, pin_memory=True)
        self.dev_send = torch.empty(_META_LEN, dtype=torch.int64, device=device)
        self.dev = torch.empty(world * _META_LEN, dtype=torch.int64, device=device)
        self.event, self.read_done = torch.cuda.Event(), torch.cuda.Event()
        self.read_pending = False
        self.key = (device, world)


_free_record_buffers = {}  # (device, world) -> sets no call holds (list pop / append are atomic)


class _Records:
    """One call's metadata: every rank's record, gathered; the host reads them once (``read``). A call
    holds a buffer set of its own until ``release()``, so that calls in flight never share one.

    Alone (``data_parts`` None, the waiting protocol): CUDA, on a side stream that waits for the
    caller's stream only when the record holds values computed there (amax, hashes), so the host's
    wait does not include unrelated queued work; CPU (gloo), waited for at once, so that gloo never
    has two of pyxfer's collectives in flight. Fused: the record is the last part of the collective
    that carries ``data_parts`` (``works``), posted from the caller's stream; on CUDA a side stream
    waits for it and copies the records to the host, so ``read`` waits for nothing else. A call that
    repeats the group's record uses the group's cached device copy of it (no host-to-device copy)."""

    def __init__(self, local: _Local, meta, group, world, device, agreed, data_parts=None, cached=False):
        self.world, self._metas, self._bufs, self._device_reader, self._work = world, None, None, None, None
        self.works, self._send = [], None
        fused = data_parts is not None
        device_values = local.error is None and (
            local.amax_dev is not None or (local.verify and local.parts is not None))
        if device.type != "cuda":
            send = torch.tensor(meta, dtype=torch.int64)
            if device_values:
                _device_values(local, send)
            self.dev = self.host = torch.empty(world * _META_LEN, dtype=torch.int64)
            self.event = None
            works = _launch(list(data_parts or ()) + [_Part("record", send, self.dev, None)], group, world)
            if fused:
                self.works, self._work = works, works[0]
            else:
                works[0].wait()
            return
        free = _free_record_buffers.setdefault((device, world), [])
        self._bufs = bufs = free.pop() if free else _RecordBuffers(device, world)
        self.host, self.dev, self.event = bufs.host, bufs.dev, bufs.event
        # Fused: the group's own read stream, so that no other group's records wait for this data gather.
        side = agreed.read_stream(device) if fused else _side_stream(device)
        if bufs.read_pending:  # the previous holder's device reads (max_amax)
            (torch.cuda.current_stream(device) if fused else side).wait_event(bufs.read_done)
            bufs.read_pending = False
        if fused:  # from the caller's stream, with no stream switch before the launch (host time delays the data)
            send = agreed.device_record(meta, device) if cached else self._send_from_host(bufs, meta)
            if device_values:
                send = send.clone() if cached else send
                _device_values(local, send)
            # Held until release(): the side stream's wait below lets the backend drop its reference
            # while the caller's stream, where the clone was allocated, has not waited for the collective.
            self._send = send
            self.works = _launch(data_parts + [_Part("record", send, self.dev, None)], group, world)
        if not fused and device_values:  # the amax / the sent bytes are computed on the caller's stream
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if not fused:
                send = self._send_from_host(bufs, meta)
                if device_values:
                    _device_values(local, send)
                works = _launch([_Part("record", send, self.dev, None)], group, world)
            for work in self.works if fused else works:
                work.wait()  # makes the side stream (current here) wait for the collective
            self.host.copy_(self.dev, non_blocking=True)
            self.event.record(side)

    @staticmethod
    def _send_from_host(bufs, meta) -> torch.Tensor:
        bufs.send_np[:] = meta  # the previous holder's copy out of it finished before its read()
        return bufs.dev_send.copy_(bufs.host_send, non_blocking=True)

    def read(self) -> list:
        """The W records as lists of ints (waits for them the first time)."""
        if self._metas is None:
            if self._work is not None:
                self._work.wait()
            elif self.event is not None:
                self.event.synchronize()
            flat = self.host.tolist()
            self._metas = [flat[r * _META_LEN:(r + 1) * _META_LEN] for r in range(self.world)]
        return self._metas

    def release(self):
        """Give the buffer set back (after ``read``, once the call's device work with the records is
        queued and, fused, once the caller's stream waited for the collective)."""
        bufs, self._bufs, self._send = self._bufs, None, None
        if bufs is None:
            return
        if self._device_reader is not None:
            bufs.read_done.record(self._device_reader)
            bufs.read_pending = True
        _free_record_buffers[bufs.key].append(bufs)

    def max_amax(self) -> torch.Tensor:
        """The largest shard amax of the group as a 1-element fp32 tensor on the current stream,
        computed on the device from the gathered records (no host read). Non-negative fp32 values
        order as their bit patterns do."""
        records = self.dev
        if self.event is not None:
            current = torch.cuda.current_stream(records.device)
            current.wait_event(self.event)
            self._device_reader = current
        bits = records.view(self.world, _META_LEN)[:, _F_AMAX_ROW].max()
        return bits.to(torch.int32).view(torch.float32).reshape(1)


# ---------------------------------------------------------------------------------------------
# Fused mode. Every rank keeps the same _Agreed state for a group, changed only by calls that read
# their records before posting data (so at the same point of the call sequence on every rank). After
# _FUSE_AFTER agreed calls in a row with one signature, every call of the group posts one collective:
# its data parts and its record. A rank whose call has that signature posts its data; any other
# rank posts scratch buffers of the agreed layout, so the collective matches on every rank, then reads
# the records at once: if every rank did the same (a new signature on all ranks) the call goes on as
# a waiting call (its data gathered next); if not, the ranks disagree, and each raises the same error
# (the ones that posted data, from wait()). Errors change no state. Signatures whose data depend on
# the records (quantize_as NVFP4 with the group's amax) never fuse.

_FUSE_AFTER = 2


class _Agreed:
    __slots__ = ("signature", "layout", "streak", "_records", "_read_streams")

    def __init__(self):
        self.signature = self.layout = None
        self.streak = 0  # agreed calls in a row with ``signature``
        self._records = {}  # device -> (record, its device copy)
        self._read_streams = {}  # device -> the stream that copies fused calls' records to the host

    def read_stream(self, device):
        stream = self._read_streams.get(device)
        if stream is None:
            stream = self._read_streams[device] = torch.cuda.Stream(device)
        return stream

    def fused(self) -> bool:
        return self.streak >= _FUSE_AFTER

    def agree(self, signature, layout):
        """A call that read its records before its data gather agreed on ``signature``."""
        fusable = signature is not None and not (signature[_F_KIND] == KIND_TO_QUANTIZE and
                                                 signature[_F_FMT] == _NVFP4_CODE and signature[_F_AMAX_AUTO])
        self.streak = 0 if not fusable else self.streak + 1 if signature == self.signature else 1
        self.signature, self.layout = signature, layout

    def device_record(self, meta, device) -> torch.Tensor:
        """This rank's record on ``device`` for a call of the agreed signature, made once and only
        read after that (NCCL keeps the tensors of a collective in flight alive)."""
        record, dev = self._records.get(device, (None, None))
        if record != meta:
            dev = torch.tensor(meta, dtype=torch.int64).to(device)
            self._records[device] = (list(meta), dev)
        return dev


_agreed_by_group = weakref.WeakKeyDictionary()


def _agreed(group) -> _Agreed:
    state = _agreed_by_group.get(group)
    if state is None:
        state = _agreed_by_group[group] = _Agreed()
    return state


def _signature(meta):
    """What must be equal on every rank for the same data gather: the agreed slots (and the NVFP4
    global amax that quantize_as gives). None for a rank whose input was rejected."""
    if meta[_F_ERROR]:
        return None
    sig = tuple(meta[:_AGREE_LEN])
    return sig + (meta[_F_AMAX_ROW],) if _gives_nvfp4_amax(meta) else sig


def _gives_nvfp4_amax(meta) -> bool:
    """quantize_as NVFP4 with a given global amax: every rank must give the same one."""
    return meta[_F_KIND] == KIND_TO_QUANTIZE and meta[_F_FMT] == _NVFP4_CODE and not meta[_F_AMAX_AUTO]


def _layout(parts) -> tuple:
    """(dtype code, elements) of what each part sends, as posted."""
    return tuple((_DTYPE_CODE[p.send.dtype], p.send.numel()) for p in parts)


def _scratch_parts(layout, world, device) -> list:
    """Buffers of the agreed layout that nobody reads: what a rank whose call has another signature
    posts in fused mode, so that its collective matches the others'."""
    parts = []
    for code, numel in layout:
        send = torch.empty(numel, dtype=_DTYPES[code - 1], device=device)
        parts.append(_Part("scratch", send, torch.empty(world * numel, dtype=send.dtype, device=device), None))
    return parts


def _ranks_by_value(metas, slot_fn):
    groups = {}
    for r, m in enumerate(metas):
        groups.setdefault(slot_fn(m), []).append(r)
    return groups


def _fmt_ranks(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _check_agreement(metas, local: _Local, rank: int):
    """Raise the same ValueError on every rank unless every record agrees (errors name the field,
    the values and the ranks); a rank whose own input was rejected re-raises its own error."""
    m0 = metas[0]
    signature = _signature(m0)
    if m0[_F_MAGIC] == _MAGIC and signature is not None and all(_signature(m) == signature for m in metas[1:]):
        return  # the common case: one comparison per rank
    bad = [r for r, m in enumerate(metas) if m[_F_MAGIC] != _MAGIC]
    if bad:
        raise RuntimeError(f"{_OP}: {_fmt_ranks(bad)} sent no pyxfer gather metadata (different pyxfer versions, "
                           "or the ranks are not calling all_gather at the same point)")
    bad = [r for r, m in enumerate(metas) if m[_F_ERROR]]
    if bad:
        if local.error is not None:
            raise local.error
        raise ValueError(f"{_OP}: {_fmt_ranks(bad)} rejected {'their' if len(bad) > 1 else 'its'} input or "
                         f"failed before sending (see the error raised there); nothing was gathered")

    def check(name, fn, show):
        groups = _ranks_by_value(metas, fn)
        if len(groups) > 1:
            detail = "; ".join(f"{show(v)} on {_fmt_ranks(rs)}" for v, rs in groups.items())
            raise ValueError(f"{_OP}: ranks disagree on {name}: {detail}")

    for slot, name in _AGREE:
        check(name, lambda m, s=slot: m[s], lambda v, s=slot: _describe(s, v))
    ndim = metas[0][_F_NDIM]
    check("shape[1:]", lambda m: tuple(m[_F_SHAPE + 1:_F_SHAPE + ndim]), lambda v: str(list(v)))
    check("dim 0 (shards must be of equal size)", lambda m: m[_F_SHAPE], str)
    if _gives_nvfp4_amax(m0):
        check("the NVFP4 global_amax of quantize_as", lambda m: m[_F_AMAX_ROW], lambda v: _describe(_F_AMAX_ROW, v))


# ---------------------------------------------------------------------------------------------
# Path decision: from this rank's input alone (the signature fixes it), identical on every rank
# that agrees. What only the records tell (NVFP4 shard amaxes) is handled after the data arrived.

class _Plan:
    """What to gather; ``build(finals)``: the result from the finished parts, queued before the
    records are read; ``rebuild(finals, records, result)``, if not None: the result once the records
    are known (NVFP4 shards may carry different amax)."""

    def __init__(self, parts, build, hashes_in_meta, warning=None, rebuild=None):
        self.parts, self.build, self.hashes_in_meta, self.warning, self.rebuild = \
            parts, build, hashes_in_meta, warning, rebuild


def _amaxes(metas, slot):
    return [_bits_f32(m[slot]) for m in metas]


def _nvfp4_shard_values(parts, r, shape, dtype, amax):
    """Rank ``r``'s NVFP4 shard decoded from the bytes gathered from it (rowwise if gathered, as
    QuantizedTensor.dequantize chooses), its trimmed scales zero-padded back to the compact shape."""
    by_name = {p.name: p for p in parts}
    m, k = math.prod(shape[:-1]), shape[-1]
    usage = "rowwise" if "rowwise_data" in by_name else "columnwise"
    layout = formats.buffer_layout("nvfp4", shape, rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    data = by_name[f"{usage}_data"].region(r).view(layout[f"{usage}_data"][0])
    scale = torch.zeros(layout[f"{usage}_scale_inv"][0], dtype=torch.uint8, device=data.device)
    rows, cols = (m, scale.shape[1]) if usage == "rowwise" else (k, m // 16)
    scale[:rows, :cols] = by_name[f"{usage}_scale_inv"].region(r).view(rows, cols)
    q = formats.NVFP4Tensor(shape=shape, dtype=dtype, **{
        f"{usage}_data": data, f"{usage}_scale_inv": scale,
        f"amax_{usage}": torch.tensor([amax], dtype=torch.float32, device=data.device)})
    return q.dequantize()


def _decide(local: _Local, records: _Records, world) -> _Plan:
    local.build_parts(world)
    kind, shape = local.kind, local.shape
    out_shape = (world * shape[0],) + tuple(shape[1:])
    if kind == KIND_PLAIN:
        return _Plan(local.parts, lambda finals: finals[0], True)
    desc = local.desc
    ranks = f"ranks 0-{world - 1}" if world > 2 else "ranks 0 and 1"
    shard_ok = desc.is_quantizable(shape)
    out_ok = desc.is_quantizable(out_shape)

    def requantize(hp, global_amax):
        return desc.quantize(hp, global_amax=global_amax, swizzled=local.out_swizzled) if out_ok else hp

    def fallback_warning(reason):
        dtype = str(local.dtype).removeprefix("torch.")
        then = f"requantized as {desc.fmt}" if out_ok else \
            f"returned in {dtype}, because the gathered shape {list(out_shape)} is not quantizable either " \
            f"({_why_not_quantizable(out_shape, desc.fmt)})"
        return f"{_OP} gathered in {dtype} instead of {desc.fmt}: {reason}. The result is {then}.", \
            (desc.fmt, "shape", out_ok)

    def quantized_plan(q, parts, hashes_in_meta):
        def build(finals):
            bufs = {p.name: t for p, t in zip(parts, finals)}
            amax_row = q.amax_rowwise.clone() if desc.fmt == "nvfp4" and desc.rowwise else None
            amax_col = q.amax_columnwise.clone() if desc.fmt == "nvfp4" and desc.columnwise else None
            out = _build_qt(desc, out_shape, local.dtype, bufs, amax_row, amax_col)
            return out.with_swizzled_scales() if local.out_swizzled else out

        def rebuild(finals, metas, result):
            row, col = _amaxes(metas, _F_AMAX_ROW), _amaxes(metas, _F_AMAX_COL)
            if len(set(row)) == 1 and len(set(col)) == 1:
                return result
            # The same result as dequantizing each shard with its own amax, gathering the values and
            # requantizing, from the quantized bytes already here (no second gather).
            amaxes = ", ".join(f"rank {r}: {a!r}" for r, a in enumerate(row if desc.rowwise else col))
            dtype = str(local.dtype).removeprefix("torch.")
            _warn_once(f"{_OP} gathered NVFP4 shards that were quantized with different global amax "
                       f"({amaxes}), so they cannot share one global scale (quantize with the group's "
                       f"all-reduced amax): each shard was decoded to {dtype} with its own amax and the "
                       f"result requantized as nvfp4, as the dequantize-then-gather fallback would.",
                       (desc.fmt, "amax", out_ok))
            mine = row if desc.rowwise else col
            hp = torch.cat([_nvfp4_shard_values(parts, r, shape, local.dtype, mine[r]) for r in range(world)])
            return requantize(hp, max(row + col))
        nvfp4_shards = kind == KIND_QUANTIZED and desc.fmt == "nvfp4"
        return _Plan(parts, build, hashes_in_meta, rebuild=rebuild if nvfp4_shards else None)

    if shard_ok:
        if local.parts is None:  # quantize_as NVFP4 with the group's amax: the max of the shard amaxes
            local.q = desc.quantize(local.x, global_amax=records.max_amax(), swizzled=False)
            local.parts = _quantized_parts(local.q, desc, world)
            return quantized_plan(local.q, local.parts, False)
        return quantized_plan(local.q, local.parts, True)
    what = "gathered quantized" if kind == KIND_QUANTIZED else f"quantized as {desc.fmt}"
    reason = f"the shards of shape {list(shape)} on {ranks} cannot be {what}: {_why_not_quantizable(shape, desc.fmt)}"
    # (NVFP4 tensors always hold whole 16x16 blocks, so only FP8-block and MXFP8 ones get here.)
    return _Plan(local.parts, lambda finals: requantize(finals[0], None), True,
                 fallback_warning(reason))


# ---------------------------------------------------------------------------------------------
# Launch, finish, handle

class _PackedWork:
    """gloo: the parts' bytes gathered as one buffer (what gloo's coalesced all-gather does inside,
    without its defects; see _allgather); ``wait()`` copies each rank's bytes into the parts."""

    def __init__(self, ops, group, world):
        self._ops, self._world, self._unpacked = ops, world, False
        self._send = torch.cat([_bytes(p.send) for p in ops])
        self._recv = torch.empty(world * self._send.numel(), dtype=torch.uint8)
        self._work = _allgather([self._recv], [self._send], group)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self):
        self._work.wait()
        if self._unpacked:
            return True
        self._unpacked = True
        rows, offset = self._recv.view(self._world, -1), 0
        for p in self._ops:
            _bytes(p.recv).view(self._world, p.nbytes).copy_(rows[:, offset:offset + p.nbytes])
            offset += p.nbytes
        return True


def _launch(parts, group, world):
    """Start the gathers of every non-empty part: one collective on either backend. CUDA (NCCL):
    one coalesced group straight into the parts' buffers. CPU (gloo): one part goes straight into
    its buffer; several are packed into one byte buffer (_PackedWork)."""
    ops = [p for p in parts if p.nbytes]
    if not ops:
        return []
    if ops[0].send.is_cuda:
        return [_allgather([p.recv for p in ops], [p.send for p in ops], group)]
    if len(ops) == 1:
        return [_allgather([_bytes(ops[0].recv)], [_bytes(ops[0].send)], group)]
    return [_PackedWork(ops, group, world)]


def _verify(data_parts, rank, world):
    """Queue the PXH64 of every shard received from another rank (the rank-major bytes, before any
    fix-up) and return ``check(expected)``, which compares them with the senders' hashes
    (``expected(r)`` lists rank r's hashes in part order) with one host read. Queued before the
    caller waits for its records, so that the host waits once for both."""
    checks = [(r, i, p) for r in range(world) if r != rank for i, p in enumerate(data_parts) if p.nbytes]
    got = torch.stack([torch.ops.pyxfer.checksum(p.region(r), 0) for r, _, p in checks]) if checks else None

    def check(expected):
        if got is None:
            return
        want = {r: expected(r) for r in range(world) if r != rank}
        bad = [(r, p, as_uint64(w), as_uint64(g)) for (r, i, p), g in zip(checks, got.tolist())
               for w in [want[r][i]] if as_uint64(w) != as_uint64(g)]
        if bad:
            r, p, w, g = bad[0]
            more = f" ({len(bad) - 1} more shard buffer(s) mismatched too)" if len(bad) > 1 else ""
            raise GatherVerificationError(
                f"{_OP}: the {p.name} shard from rank {r} arrived corrupted on rank {rank}: sender PXH64 {w:#018x}, "
                f"received PXH64 {g:#018x} ({p.nbytes} bytes){more}",
                src_rank=r, rank=rank, buffer=p.name, num_bytes=p.nbytes, expected=w, actual=g)
    return check


_HASH_PART = "pxh64"


class GatherHandle:
    """Returned by ``all_gather(..., async_op=True)``. ``wait()`` waits for the data (on NCCL: makes
    the current stream wait), then post-processes (verification, layout fix-ups, requantization)
    and returns the result; later calls return the same object (or raise the same error).
    ``is_completed()`` says whether the collectives finished (post-processing may still be due)."""

    def __init__(self, works, finish, device):
        self._works, self._finish, self._device = works, finish, device
        self._result, self._error, self._done = None, None, False

    def is_completed(self) -> bool:
        if self._done:
            return True
        return all(w.is_completed() for w in self._works)

    def wait(self):
        if not self._done:
            try:
                with _on_device(self._device):
                    for w in self._works:
                        w.wait()
                    self._result = self._finish()
            except Exception as e:
                self._error = e
            self._done, self._works, self._finish = True, None, None
        if self._error is not None:
            raise self._error
        return self._result


def _on_device(device):
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Warnings: once per call site and reason, pointing at the first frame outside pyxfer

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_warned = set()


def _warn_once(message, key):
    frame, level = sys._getframe(1), 2  # stacklevel 2 is our caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    site = (frame.f_code.co_filename, frame.f_lineno, key) if frame is not None else (None, None, key)
    if site in _warned:
        return
    _warned.add(site)
    warnings.warn(message, QuantizedGatherFallbackWarning, stacklevel=level)


# ---------------------------------------------------------------------------------------------

def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_OP}: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    if group is None:
        group = dist.group.WORLD
    from torch.distributed import distributed_c10d as c10d
    if isinstance(group, c10d.ProcessGroup):  # a member's group: its own methods (the dist helpers look it up)
        rank, world = group.rank(), group.size()
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{_OP}: this process is not a member of the given group")
    if group in c10d._world.pg_coalesce_state:
        raise RuntimeError(f"{_OP}: cannot run inside torch.distributed._coalescing_manager (it exchanges "
                           "metadata before gathering); call it outside, with async_op=True for overlap")
    return group, rank, world


def _default_device(group):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world_one(local: _Local, x, quantize_as):
    """World size 1: no communication; x itself unless quantize_as asks for something else."""
    if local.error is not None:
        raise local.error
    if local.kind == KIND_PLAIN or (local.kind == KIND_QUANTIZED and quantize_as is None):
        return x
    desc, q = local.desc, local.q
    if local.kind == KIND_QUANTIZED:  # provides the spec: keep the usages it asks for
        bufs = {n: t for n, t in q.buffers().items()
                if n.startswith("rowwise") and desc.rowwise or n.startswith("columnwise") and desc.columnwise}
        nvfp4 = desc.fmt == "nvfp4"
        q = _build_qt(desc, q.shape, q.dtype, bufs, q.amax_rowwise if nvfp4 and desc.rowwise else None,
                      q.amax_columnwise if nvfp4 and desc.columnwise else None)
    elif q is None:
        if not desc.is_quantizable(local.shape):
            return x if isinstance(x, torch.Tensor) else local.x
        q = desc.quantize(local.x, swizzled=False)
    return q.with_swizzled_scales() if local.out_swizzled else q


def all_gather(x, group=None, *, quantize_as=None, async_op: bool = False, verify: bool = False):
    """Gather ``x`` along dim 0 from every rank of ``group`` (default: the world group).

    ``x``: a tensor of any dtype, at least 1 dim (at most 8), any strides, or a
    pyxfer.formats.QuantizedTensor; on the device the group's backend serves (CUDA for NCCL, CPU for
    gloo). Every rank must pass the same kind, dtype, shape (dim 0 included), format, usages and
    options. Result: the same kind as ``x`` with dim 0 multiplied by the world size W, on x's device;
    a tensor is contiguous. A QuantizedTensor result is bit-identical, scale padding included (zero),
    to quantizing the gathered high-precision tensor in one process; swizzled inputs give a swizzled
    result (they are gathered compact).

    ``quantize_as``: a pyxfer.formats.QuantizeSpec asking for a quantized result from a float32 /
    bfloat16 / float16 tensor (TE's ``quantizer=``): the shard is quantized and gathered quantized
    when it is quantizable (NVFP4 without a given global amax uses the max of the shard amaxes, i.e.
    the full tensor's, so the result equals quantizing the full tensor); otherwise the tensor is
    gathered in its dtype and the result quantized if its shape is quantizable, else returned as is.
    A QuantizedTensor whose format, options or usages do not provide the spec is dequantized and
    requantized locally first (one with more usages only drops them).

    Fallback: when a shard is not quantizable for its format (TE's rule: M and K multiples of the
    block), x is dequantized to its nominal dtype, gathered contiguous, and requantized with the same
    format and options when the gathered shape is quantizable, else returned in high precision.
    NVFP4 shards that carry different global amax give the same result (each shard decoded with its
    own amax, requantized with the max of the shard amaxes), decoded after a quantized gather. A
    QuantizedGatherFallbackWarning (once per call site and reason) says why.

    ``async_op``: return a GatherHandle at once; its ``wait()`` returns the result. Every step after
    the data collective (verification, fix-ups, requantization) runs in ``wait()``.
    ``verify``: every rank checks the PXH64 of every shard it received from another rank against the
    hash its sender computed before sending (the hashes travel in the metadata exchange).

    World size 1: no communication; returns x itself (quantized per ``quantize_as`` if asked).
    Mutates nothing it was given. Collectives: a metadata all-gather, waited for, then one
    (coalesced) data gather; once the group's last two such calls agreed on the signature (kind,
    dtype, shape, format, usages, options, verify), one collective per call carries both and the
    metadata is checked after the data arrived (a call that then changes the signature costs one
    extra gather of the previous layout). Raises ValueError on every rank when the ranks disagree
    (the field, its values and the ranks are named) or when a rank's input is invalid or its call
    failed before sending, e.g. out of memory (that rank raises its own error), GatherVerificationError
    (a RuntimeError, on the receiving rank, from ``wait()`` when async) for a corrupted shard,
    RuntimeError when torch.distributed is not initialized or the call is inside a ``_coalescing_manager``.
    """
    group, rank, world = _group_info(group)
    local = _Local(x, quantize_as, verify, world)
    if world == 1:
        result = _world_one(local, x, quantize_as)
        return GatherHandle([], lambda: result, None) if async_op else result
    device = local.device or _default_device(group)
    with _on_device(device):
        meta = local.record(rank)
        signature, agreed = _signature(meta), _agreed(group)
        fast = agreed.fused() and signature == agreed.signature
        if fast:  # data and record in one collective; the records are checked after the data arrived
            try:
                plan = _decide(local, None, world)  # the signature fixes the plan, and it needs no record
                data_parts = parts = plan.parts
                if _layout(parts) != agreed.layout:  # before posting: never a collective of other sizes
                    raise RuntimeError(f"{_OP}: internal error: parts {_layout(parts)} differ from the agreed "
                                       f"layout {agreed.layout}")
            except Exception as e:  # e.g. out of memory for the result. The other ranks post the agreed
                # collective: post it too, with scratch buffers and an error record (below), so that they raise
                local.error, fast = e, False
                meta = local.record(rank)
                signature = None
        if fast:
            records = _Records(local, meta, group, world, device, agreed, parts, cached=True)
            works = records.works
        else:
            scratch = _scratch_parts(agreed.layout, world, device) if agreed.fused() else None
            records = _Records(local, meta, group, world, device, agreed, scratch)
            if local.error is None:
                local.build_parts(world)  # allocations overlap the exchange
            try:
                _check_agreement(records.read(), local, rank)
                plan = _decide(local, records, world)
            finally:
                records.release()
            data_parts = parts = plan.parts
            if verify and not plan.hashes_in_meta:  # sent bytes made after the exchange: hashes ride with the data
                local.hashes = _hash_all(data_parts)
                hashes = torch.empty(world * len(data_parts), dtype=torch.int64, device=device)
                parts = data_parts + [_Part(_HASH_PART, local.hashes, hashes, None)]
            agreed.agree(signature, _layout(parts))
            works = _launch(parts, group, world)
    if plan.warning is not None:
        _warn_once(*plan.warning)

    def read_records():
        metas = records.read()
        if fast:  # a rank that disagrees posted scratch buffers of the same layout, so the data has arrived
            records.release()
            _check_agreement(metas, local, rank)
        return metas

    def finish():
        # Everything the result needs is queued before the host waits for the records (in fused mode
        # they arrive with the data): the host's wait is the call's last step.
        try:
            if testing._gather_faults:
                testing._corrupt_gathered(rank, world, [(p.name, p.region, p.nbytes) for p in data_parts])
            check_hashes = _verify(data_parts, rank, world) if verify else None
            finals = [p.finish() for p in data_parts]
            result = plan.build(finals)
        except Exception:
            if fast:  # read before the buffer set is reused; the ranks' disagreement, if any, explains more
                read_records()
            raise
        metas = read_records()
        if verify:
            if plan.hashes_in_meta:
                check_hashes(lambda r: metas[r][_F_HASH:_F_HASH + len(data_parts)])
            else:
                gathered = parts[-1].recv.view(world, len(data_parts)).tolist()
                check_hashes(lambda r: gathered[r])
        if plan.rebuild is not None:
            result = plan.rebuild(finals, metas, result)
        return result

    handle = GatherHandle(works, finish, device)
    return handle if async_op else handle.wait()
