"""Buffers for the pyxfer.buffers tests on the CPU and on GPUs: mixed dtypes, sentinel-filled byte
buffers carved into typed views, and a TE-like bulk allocation of quantized tensors."""
import torch

from pyxfer.buffers import SubviewSpec

from support.tensors import random_tensor

MIXED_DTYPES = [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.bfloat16,
                torch.int64, torch.bool, torch.complex64]
SENTINEL = 0xA5


def bits(t):
    """The tensor's logical row-major bytes: exact and NaN-safe comparisons via torch.equal."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def te_bulk_quantized(gen, m=37, k=129):
    """FP8 data + fp32 scale_inv + fp32 amax laid out like TE's bulk allocator: 256-aligned
    sub-buffers of one uint8 buffer (the rest prefilled with a sentinel)."""
    sizes = [m * k, 4 * ((k + 127) // 128) * m, 4]
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append((offsets[-1] + n + 255) // 256 * 256)
    buf = sentinel_buffer(offsets[-1] + sizes[-1] + 13)
    data = carve(buf, offsets[0], (m, k), torch.uint8, gen)
    scale_inv = carve(buf, offsets[1], ((k + 127) // 128, m), torch.float32, gen)
    amax = carve(buf, offsets[2], (1,), torch.float32, gen)
    return buf, [data, scale_inv, amax, scale_inv.t()]  # TE also hands out transposed scale views


def sentinel_buffer(nbytes):
    return torch.full((nbytes,), SENTINEL, dtype=torch.uint8)


def carve(buf, byte_offset, shape, dtype, gen):
    """A contiguous typed view of ``buf`` at ``byte_offset``, filled with random bits."""
    n = SubviewSpec(0, shape, torch.empty(shape).stride(), dtype).nbytes
    view = buf[byte_offset:byte_offset + n].view(dtype).view(shape)
    buf[byte_offset:byte_offset + n] = random_tensor((n,), torch.uint8, gen) & (1 if dtype == torch.bool else 255)
    return view
