"""Per-format gathered layouts and their fix-ups.

A shard's buffers are gathered as ``Part``s: ``send`` (this rank's contiguous bytes) into ``recv``
(rank-major, W times as many elements). Where the rank-major concatenation already is the gathered
tensor's buffer, ``recv`` is (a prefix of) the result; elsewhere ``finish()`` fixes the layout up
(``quantized_layout`` says which, per format and buffer). Padded shard scales are trimmed before
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


class Part:
    """``send``: this rank's contiguous buffer; ``recv``: the rank-major receive buffer (W times
    ``send``'s elements, same dtype); ``nbytes``: bytes each rank sends; ``finish()``: the final tensor."""
    __slots__ = ("name", "send", "recv", "nbytes", "finish")

    def __init__(self, name, send, recv, finish=None):
        if send.dtype not in NATIVE:
            send, recv = as_bytes(send), as_bytes(recv)
        self.name, self.send, self.recv, self.finish = name, send, recv, finish
        self.nbytes = send.numel() * send.element_size()

    def region(self, rank) -> torch.Tensor:
        """The bytes received from ``rank`` (a flat uint8 view of ``recv``)."""
        return as_bytes(self.recv)[rank * self.nbytes:(rank + 1) * self.nbytes]


def layout_of(parts) -> tuple:
    """(dtype, elements) of what each part sends, as posted."""
    return tuple((p.send.dtype, p.send.numel()) for p in parts)


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


def send_layout(spec, dtype, shape, world) -> tuple:
    """(dtype, elements) of the parts a rank sends for a shard of ``shape``: quantized for ``spec``
    when the shard is quantizable, else one plain part in ``dtype`` (bytes for non-native dtypes).
    What a rank that cannot build its parts posts instead (scratch buffers of the agreed layout)."""
    if spec is not None and spec.is_quantizable(shape):
        return tuple((g.dtype, math.prod(g.send_shape)) for g in quantized_layout(spec, tuple(shape), world))
    numel = math.prod(shape)
    if dtype in NATIVE:
        return ((dtype, numel),)
    return ((torch.uint8, numel * dtype.itemsize),)


def scratch_parts(layout, world, device) -> list:
    """Buffers of ``layout`` that nobody reads: what a rank posts when it cannot send its data but its
    peers do, so that its collective matches theirs."""
    parts = []
    for dtype, numel in layout:
        send = torch.empty(numel, dtype=dtype, device=device)
        parts.append(Part("scratch", send, torch.empty(world * numel, dtype=dtype, device=device)))
    return parts


def _gathered_part(g: Gathered, buf, world) -> Part:
    if g.trim is not None:  # (each view op costs host time: only those that change something)
        rows, cols = g.trim
        buf = buf if cols == buf.shape[1] else buf[:, :cols]
        buf = buf if rows == buf.shape[0] else buf[:rows]
    src = buf if buf.shape == g.send_shape else buf.reshape(g.send_shape)
    src = src if src.is_contiguous() else src.contiguous()
    if g.fixup == "direct":
        out = torch.empty(g.out_shape, dtype=src.dtype, device=src.device)
        return Part(g.name, src, out, lambda: out)
    if g.fixup == "prefix":  # its padding rows are zeroed now (the collective never writes them)
        out = torch.empty(g.out_shape, dtype=src.dtype, device=src.device)
        rows = world * g.send_shape[0]
        if rows < out.shape[0]:
            out[rows:].zero_()
        return Part(g.name, src, out[:rows], lambda: out)
    temp = torch.empty((world * g.send_shape[0],) + g.send_shape[1:], dtype=src.dtype, device=src.device)

    def finish():  # rank-major [W, A, B...] -> out[a, r, b...] (then maybe zero-padding)
        swapped = torch.ops.pyxfer.swap_first_dims(temp.view((world,) + g.send_shape))
        if g.pad_shape is None:
            return swapped.reshape(g.out_shape)
        rows, cols = g.send_shape[0], world * g.send_shape[1]
        out = torch.zeros(g.pad_shape, dtype=src.dtype, device=src.device)
        out[:rows, :cols].copy_(swapped.reshape(rows, cols))
        return out
    return Part(g.name, src, temp, finish)


def quantized_parts(q, spec, world) -> list:
    """Parts gathering compact QuantizedTensor ``q`` (shard quantizable for its format) with ``spec``'s
    usages, so that the finished buffers are those of quantizing the (W*d0, ...) tensor in one process."""
    return [_gathered_part(g, getattr(q, g.name), world) for g in quantized_layout(spec, tuple(q.shape), world)]


def plain_part(t: torch.Tensor, world: int) -> Part:
    """The part gathering plain tensor ``t`` (any strides) into a contiguous (W*d0, ...) result."""
    src = t.contiguous()
    out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return Part("data", src, out, lambda: out)


def hash_all(parts) -> torch.Tensor:
    """PXH64 of every part's send bytes, as one int64 tensor on their device (no host sync)."""
    return torch.stack([torch.ops.pyxfer.checksum(p.send, 0) for p in parts])


def nvfp4_shard_values(parts, r, shape, dtype, amax) -> torch.Tensor:
    """Rank ``r``'s NVFP4 shard decoded from the bytes gathered from it (rowwise if gathered, as
    QuantizedTensor.dequantize chooses), its trimmed scales zero-padded back to the compact shape."""
    by_name = {p.name: p for p in parts}
    usage = "rowwise" if "rowwise_data" in by_name else "columnwise"
    spec = formats.QuantizeSpec("nvfp4", rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    buffers = formats.buffer_layout("nvfp4", shape, rowwise=spec.rowwise, columnwise=spec.columnwise)
    data = by_name[f"{usage}_data"].region(r).view(buffers[f"{usage}_data"][0])
    scale = torch.zeros(buffers[f"{usage}_scale_inv"][0], dtype=torch.uint8, device=data.device)
    (g,) = [g for g in quantized_layout(spec, tuple(shape), 1) if g.name == f"{usage}_scale_inv"]
    rows, cols = g.trim
    scale[:rows, :cols] = by_name[g.name].region(r).view(rows, cols)
    q = formats.tensor_from_buffers(spec, shape, dtype, {
        f"{usage}_data": data, f"{usage}_scale_inv": scale,
        f"amax_{usage}": torch.tensor([amax], dtype=torch.float32, device=data.device)})
    return q.dequantize()


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
