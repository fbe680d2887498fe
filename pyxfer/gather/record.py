"""The agreement record: what each rank tells the others about its call, as pure logic (no process
group, no device): encode a record, reduce it to the signature every rank must share, and explain
a disagreement with the same error on every rank. Also the status word that travels with the data
of a waiting call (a rank that failed after the records agreed names its step there).

A record is ``RECORD_LEN`` int64 slots. Slots [0, AGREE_LEN) must be equal on every rank (the common
case is checked with one comparison per rank); after them, values that may differ per rank: the
NVFP4 amax bits (written on the device for a QuantizedTensor or a shard amax, on the host for a
quantize_as amax given by the caller), and in the record that travels with the data (every data
collective carries one: pyxfer.gather.engine), with ``verify`` the PXH64 of every buffer the rank
sends (written on the device) and, in a waiting call, the status word (F_STATUS)."""
import struct

import torch

from .. import formats
from .errors import OP

KIND_PLAIN, KIND_QUANTIZED, KIND_TO_QUANTIZE = 0, 1, 2  # tensor; QuantizedTensor; tensor + quantize_as
KIND_NAMES = {KIND_PLAIN: "plain tensor", KIND_QUANTIZED: "QuantizedTensor",
              KIND_TO_QUANTIZE: "tensor with quantize_as"}
# Format codes: 0 none (a plain tensor), then pyxfer.formats.FORMATS in order.
FORMAT_CODE = {fmt: i + 1 for i, fmt in enumerate(formats.FORMATS)}
NVFP4_CODE = FORMAT_CODE["nvfp4"]
# Dtype codes (0: none): every dtype a plain tensor may be gathered in.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.float8_e5m2] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fnuz",
                                                            "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]
DTYPE_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}

MAGIC = 0x70786761_74680004  # "pxgath", protocol version 4
MAX_DIMS = 8
MAX_HASHES = 4
(F_MAGIC, F_ERROR, F_KIND, F_FMT, F_DTYPE, F_FP8, F_ROW, F_COL, F_SWIZZLED, F_POW2, F_EPS, F_AMAX_AUTO, F_VERIFY,
 F_NDIM) = range(14)
F_SHAPE = 14
AGREE_LEN = F_SHAPE + MAX_DIMS
F_AMAX_ROW, F_AMAX_COL = AGREE_LEN, AGREE_LEN + 1
F_HASH = AGREE_LEN + 2
RECORD_LEN = 48  # room to grow without changing the record's size
F_STATUS = RECORD_LEN - 1  # in the record that travels with a waiting call's data: 0, or a STEP_* code
assert F_HASH + MAX_HASHES <= F_STATUS
# Fields every rank must agree on, in the order they are compared, with their names in errors. Each
# can be the only one that differs (e.g. ndim: shapes (4, 3) and (4, 3, 0) fill the same shape slots).
AGREE = [(F_KIND, "input kind"), (F_FMT, "format"), (F_DTYPE, "dtype"), (F_FP8, "fp8_dtype"),
         (F_ROW, "rowwise usage"), (F_COL, "columnwise usage"), (F_SWIZZLED, "gemm_swizzled_scales"),
         (F_POW2, "pow2_scales"), (F_EPS, "amax_epsilon"), (F_AMAX_AUTO, "NVFP4 global_amax (given or not)"),
         (F_VERIFY, "verify"), (F_NDIM, "ndim")]


def f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def f64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def bits_f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def encode(*, kind=KIND_PLAIN, dtype=None, shape=(), verify=False, spec=None, out_swizzled=False,
           error=False) -> list:
    """The host part of a rank's record. ``kind``: KIND_*; ``dtype``: the plain or nominal dtype;
    ``shape``: the logical shard shape; ``spec``: the QuantizeSpec of the gathered (compact) shard
    (kinds 1 and 2); ``out_swizzled``: whether the result's scales are swizzled; ``error``: this rank
    rejected its input or failed before sending (every other slot then stays 0)."""
    meta = [0] * RECORD_LEN
    meta[F_MAGIC] = MAGIC
    if error:
        meta[F_ERROR] = 1
        return meta
    meta[F_KIND], meta[F_DTYPE], meta[F_VERIFY] = kind, DTYPE_CODE[dtype], int(verify)
    if spec is not None:
        opts = spec.options
        meta[F_FMT], meta[F_ROW], meta[F_COL] = FORMAT_CODE[spec.fmt], int(spec.rowwise), int(spec.columnwise)
        meta[F_FP8] = DTYPE_CODE[spec.fp8_dtype] if spec.fmt != "nvfp4" else 0
        meta[F_SWIZZLED], meta[F_POW2] = int(out_swizzled), int(opts.get("pow2_scales", True))
        meta[F_EPS] = f64_bits(opts.get("amax_epsilon", 0.0))
        if spec.fmt == "nvfp4" and kind == KIND_TO_QUANTIZE:
            amax = opts["global_amax"]
            meta[F_AMAX_AUTO] = int(amax is None)
            if amax is not None:
                meta[F_AMAX_ROW] = meta[F_AMAX_COL] = f32_bits(amax)
    meta[F_NDIM] = len(shape)
    meta[F_SHAPE:F_SHAPE + len(shape)] = shape
    return meta


def gives_nvfp4_amax(meta) -> bool:
    """quantize_as NVFP4 with a given global amax: every rank must give the same one."""
    return meta[F_KIND] == KIND_TO_QUANTIZE and meta[F_FMT] == NVFP4_CODE and not meta[F_AMAX_AUTO]


def amax_from_records(meta) -> bool:
    """quantize_as NVFP4 without a global amax: the group's amax is the max of the shard amaxes,
    known only from the records (such calls never fuse: their data depend on the records)."""
    return meta[F_KIND] == KIND_TO_QUANTIZE and meta[F_FMT] == NVFP4_CODE and bool(meta[F_AMAX_AUTO])


def signature(meta):
    """What must be equal on every rank for the same data gather: the agreed slots (and the NVFP4
    global amax that quantize_as gives). None for a rank whose input was rejected."""
    if meta[F_ERROR]:
        return None
    sig = tuple(meta[:AGREE_LEN])
    return sig + (meta[F_AMAX_ROW],) if gives_nvfp4_amax(meta) else sig


def amaxes(metas, slot) -> list:
    """The fp32 amax in ``slot`` (F_AMAX_ROW / F_AMAX_COL) of every rank."""
    return [bits_f32(m[slot]) for m in metas]


def describe(slot, value) -> str:
    """A record value as people read it (for error messages)."""
    if slot == F_KIND:
        return KIND_NAMES.get(value, str(value))
    if slot == F_FMT:
        return "none" if value == 0 else repr(formats.FORMATS[value - 1]) if 0 < value <= len(formats.FORMATS) \
            else str(value)
    if slot in (F_DTYPE, F_FP8):
        return str(DTYPES[value - 1]).removeprefix("torch.") if 0 < value <= len(DTYPES) else "none"
    if slot == F_EPS:
        return repr(bits_f64(value))
    if slot in (F_AMAX_ROW, F_AMAX_COL):
        return repr(bits_f32(value))
    if slot in (F_ROW, F_COL, F_SWIZZLED, F_POW2, F_AMAX_AUTO, F_VERIFY):
        return str(bool(value))
    return str(value)


def fmt_ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_agreement(metas, own_error=None):
    """Raise the same error on every rank unless every record of ``metas`` (one per rank, rank-major)
    agrees: RuntimeError when a record is not a pyxfer gather record, ValueError naming the field,
    its values and the ranks otherwise. A rank whose own input was rejected (``own_error``, the
    exception it caught) raises that instead."""
    m0 = metas[0]
    sig = signature(m0)
    if m0[F_MAGIC] == MAGIC and sig is not None and all(signature(m) == sig for m in metas[1:]):
        return  # the common case: one comparison per rank
    bad = [r for r, m in enumerate(metas) if m[F_MAGIC] != MAGIC]
    if bad:
        raise RuntimeError(f"{OP}: {fmt_ranks(bad)} sent no pyxfer gather metadata (different pyxfer versions, "
                           "or the ranks are not calling all_gather at the same point)")
    bad = [r for r, m in enumerate(metas) if m[F_ERROR]]
    if bad:
        if own_error is not None:
            try:
                raise own_error
            finally:  # this frame, on the error's traceback, must not hold it (a reference cycle)
                own_error = None
        raise ValueError(f"{OP}: {fmt_ranks(bad)} rejected {'their' if len(bad) > 1 else 'its'} input or "
                         f"failed before sending (see the error raised there); nothing was gathered")

    def check(name, fn, show):
        groups = {}
        for r, m in enumerate(metas):
            groups.setdefault(fn(m), []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"{show(v)} on {fmt_ranks(rs)}" for v, rs in groups.items())
            raise ValueError(f"{OP}: ranks disagree on {name}: {detail}")

    for slot, name in AGREE:
        check(name, lambda m, s=slot: m[s], lambda v, s=slot: describe(s, v))
    ndim = m0[F_NDIM]
    check("shape[1:]", lambda m: tuple(m[F_SHAPE + 1:F_SHAPE + ndim]), lambda v: str(list(v)))
    check("dim 0 (shards must be of equal size)", lambda m: m[F_SHAPE], str)
    if gives_nvfp4_amax(m0):
        check("the NVFP4 global_amax of quantize_as", lambda m: m[F_AMAX_ROW], lambda v: describe(F_AMAX_ROW, v))
    raise AssertionError(f"{OP}: internal error: records differ in no known field")  # signature() covers no more


# ---- the status word of a waiting call's data collective ----------------------------------------
# A rank that fails after the records agreed (the records said every rank would send) still posts
# the agreed collective, with scratch buffers and the code of the step that failed in the status slot
# (F_STATUS) of the record that travels with it, so that no rank waits for it; every rank reads the
# statuses after the data arrived.

STEPS = ("building the send and receive buffers", "quantizing with the group's NVFP4 global amax")
STEP_BUILD, STEP_NVFP4_QUANTIZE = range(1, len(STEPS) + 1)


def step_name(code) -> str:
    return STEPS[code - 1] if 0 < code <= len(STEPS) else f"step {code}"


def check_statuses(statuses, rank):
    """Raise RuntimeError on every rank but the failing ones when a rank's status (``statuses[r]``, 0
    for success, else a STEP_* code) says it failed after the records agreed."""
    bad = [(r, s) for r, s in enumerate(statuses) if s]
    if bad:
        detail = "; ".join(f"rank {r} while {step_name(s)}" for r, s in bad)
        raise RuntimeError(f"{OP}: the call failed after the ranks agreed on it ({detail}; see the error raised "
                           f"there), so rank {rank} received no usable data; nothing was gathered")
