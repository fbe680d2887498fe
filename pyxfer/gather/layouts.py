"""Per-format gathered layouts: what each rank sends of a quantizable shard's buffers and how the
rank-major concatenation becomes the gathered tensor's buffer (``quantized_layout``; the engine's
plans hand it to the native side, which applies the fix-ups). Padded shard scales are trimmed before
sending and zero-padded after, so the result is bit-identical (padding included) to quantizing the
full tensor in one process. Everything here is local: no collective, no record."""
import functools
import math
from typing import NamedTuple

import torch

from .. import formats

# Dtypes both NCCL and gloo gather natively; others (bool, fp8, complex, ...) travel as bytes.
NATIVE = frozenset((torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                    torch.float32, torch.float64))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (any dtype; 0-dim and empty included)."""
    t = t.reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class Gathered(NamedTuple):
    """How one buffer of a quantizable shard is gathered. ``trim``: (rows, cols) of the 2-D scale
    buffer that hold values (the rest is padding), None: the whole buffer; ``send_shape``: what each
    rank sends; ``fixup``: "direct" (the rank-major concatenation is the result, ``out_shape``),
    "prefix" (it is the first rows of the zero-padded result ``out_shape``) or "swap" (rank-major
    [W, A, B...] -> [A, W, B...], reshaped to ``out_shape`` or zero-padded into ``pad_shape``)."""
    name: str
    trim: tuple | None
    send_shape: tuple
    dtype: torch.dtype
    fixup: str
    out_shape: tuple | None
    pad_shape: tuple | None = None


def _rup(a, b):
    return -(-a // b) * b


@functools.lru_cache(maxsize=256)
def quantized_layout(spec, shape, world) -> tuple:
    """The Gathered buffers of a shard of logical ``shape`` (a tuple, quantizable for ``spec``'s format)
    with ``spec``'s usages, whose finished results are the buffers of quantizing the (W*d0, ...)
    tensor. Remembered: the same signature repeats call after call."""
    shape = tuple(shape)
    m, k = math.prod(shape[:-1]), shape[-1]
    wm, out = world * m, (world * shape[0],) + shape[1:]
    buffers = formats.buffer_layout(spec.fmt, shape, rowwise=spec.rowwise, columnwise=spec.columnwise)
    row, col = [], []

    def add(usage, name, trim, send_shape, fixup, out_shape, pad_shape=None):
        if name in buffers:  # the usages spec asks for
            usage.append(Gathered(name, trim, tuple(send_shape), buffers[name][1], fixup, out_shape, pad_shape))

    if spec.fmt == "fp8_block_1x128":
        # rowwise scales [K/128, M] (M the fast axis; M % 128 == 0, so no padding): swap to [K/128, W*M].
        # columnwise data (K, d0, ...) = [K, M]: swap to [K, W*M]; columnwise scales [M/128, K]: concat.
        add(row, "rowwise_data", None, shape, "direct", out)
        add(row, "rowwise_scale_inv", None, (k // 128, m), "swap", (k // 128, wm))
        add(col, "columnwise_data", None, (k, m), "swap", (k,) + out[:-1])
        add(col, "columnwise_scale_inv", None, (m // 128, k), "direct", (world * m // 128, k))
    elif spec.fmt == "fp8_block_128x128":
        # rowwise scales [M/128, rup(K/128, 4)]: concat. columnwise data = byte transpose [K, M]: swap.
        # columnwise scales [K/128, rup(M/128, 4)]: trim to [K/128, M/128], swap, zero-pad to rup(W*M/128, 4).
        kb, mb = k // 128, m // 128
        add(row, "rowwise_data", None, shape, "direct", out)
        add(row, "rowwise_scale_inv", None, (mb, _rup(kb, 4)), "direct", (world * mb, _rup(kb, 4)))
        add(col, "columnwise_data", None, (k, m), "swap", (k,) + out[:-1])
        add(col, "columnwise_scale_inv", (kb, mb), (kb, mb), "swap", None, (kb, _rup(world * mb, 4)))
    elif spec.fmt == "mxfp8":
        # Data not transposed: concat. Scales compact [rup(M,128), .] / [rup(M/32,4), .]: trim rows, concat, zero-pad.
        rcols = buffers["rowwise_scale_inv"][0][1] if spec.rowwise else 0
        ccols = buffers["columnwise_scale_inv"][0][1] if spec.columnwise else 0
        add(row, "rowwise_data", None, shape, "direct", out)
        add(row, "rowwise_scale_inv", (m, rcols), (m, rcols), "prefix", (_rup(wm, 128), rcols))
        add(col, "columnwise_data", None, shape, "direct", out)
        add(col, "columnwise_scale_inv", (m // 32, ccols), (m // 32, ccols), "prefix", (_rup(wm // 32, 4), ccols))
    else:  # nvfp4
        # rowwise data (..., K/2): concat; rowwise scales [rup(M,128), .]: trim rows, concat, zero-pad.
        # columnwise data [K, M/2]: swap to [K, W*M/2]; columnwise scales [rup(K,128), rup(M/16,4)]:
        # trim to [K, M/16], swap to [K, W*M/16], zero-pad to [rup(K,128), rup(W*M/16,4)].
        rcols = buffers["rowwise_scale_inv"][0][1] if spec.rowwise else 0
        add(row, "rowwise_data", None, shape[:-1] + (k // 2,), "direct", out[:-1] + (k // 2,))
        add(row, "rowwise_scale_inv", (m, rcols), (m, rcols), "prefix", (_rup(wm, 128), rcols))
        add(col, "columnwise_data", None, (k, m // 2), "swap", (k, wm // 2))
        add(col, "columnwise_scale_inv", (k, m // 16), (k, m // 16), "swap", None, (_rup(k, 128), _rup(wm // 16, 4)))
    return tuple(row + col)


@functools.lru_cache(maxsize=1024)
def quantizable(spec, shape) -> bool:
    """``spec.is_quantizable(shape)`` (``shape`` a tuple), remembered."""
    return spec.is_quantizable(shape)


def why_not_quantizable(shape, fmt) -> str:
    """Why TE's is_quantizable rejects ``shape`` for ``fmt`` (for the fallback warning)."""
    block = formats.BLOCK_LEN[fmt]
    if len(shape) < 2:
        return f"it has {len(shape)} dim(s) and {fmt} needs at least 2"
    m, k = math.prod(shape[:-1]), shape[-1]
    what = []
    if m % block:
        what.append(f"its flattened rows M = {'*'.join(map(str, shape[:-1]))} = {m} are not a multiple of {block}")
    if k % block:
        what.append(f"its last dim K = {k} is not a multiple of {block}")
    return " and ".join(what) + f" ({fmt} blocks need M and K multiples of {block})"
