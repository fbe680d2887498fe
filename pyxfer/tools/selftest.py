"""PXH64 test vectors from the spec (docs/specs/pxh64.md) and CPU/GPU agreement checks,
used by `pyxfer doctor` and by the tests."""
import torch

from ..checksums import checksum


def _pattern(n=4096):
    return bytearray((7 * i + 3) % 256 for i in range(n))


def _flipped():
    b = _pattern()
    b[1000] ^= 1
    return b


def _swapped():
    b = _pattern()
    b[0:64], b[64:128] = b[64:128], b[0:64]
    return b


# (description, bytes, seed, expected PXH64)
TEST_VECTORS = [
    ("n = 0", b"", 0, 0x9AC2BAC5A9C38BA3),
    ('"abc"', b"abc", 0, 0x4A80C1164D4089A2),
    ('"abc\\0"', b"abc\0", 0, 0xDD943FD6A823DBEE),
    ("4096 zero bytes", bytes(4096), 0, 0x3B671DADCB832981),
    ("b[i] = (7i+3) mod 256, n = 4096", bytes(_pattern()), 0, 0x43AFA5726913D462),
    ("same buffer, seed 1", bytes(_pattern()), 1, 0x19D1E2CBEC9D289F),
    ("same buffer, first 4095 bytes", bytes(_pattern(4095)), 0, 0xEF75B0C1FA90E9A7),
    ("bit 0 of byte 1000 flipped", bytes(_flipped()), 0, 0x8125941003348F84),
    ("bytes 0-63 and 64-127 swapped", bytes(_swapped()), 0, 0x82872B274EDE0438),
]


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def check_vectors(device="cpu"):
    """[(description, ok, got, expected)] for every spec vector hashed on `device`."""
    results = []
    for name, data, seed, expected in TEST_VECTORS:
        got = checksum(as_tensor(data).to(device), seed)
        results.append((name, got == expected, got, expected))
    return results


def check_agreement(device, seed=0):
    """[(case, ok, cpu_value, device_value)]: CPU and `device` hash the same fresh random data,
    at odd sizes and storage offsets (every alignment mod 16), and a non-contiguous view."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, ((1 << 22) + 45,), dtype=torch.uint8, generator=gen)
    on_device = base.to(device)
    cases = [(f"offset {o}, {n} B", slice(o, o + n)) for o in range(16) for n in (0, 1, 7, 8, 13, 4099)]
    cases.append(("offset 5, 4 MiB + 27 B", slice(5, 5 + (1 << 22) + 27)))
    results = []
    for name, sl in cases:
        a, b = checksum(base[sl]), checksum(on_device[sl])
        results.append((name, a == b, a, b))
    view = base[: 255 * 4099].view(255, 4099)[:, 3::7]
    a, b = checksum(view), checksum(on_device[: 255 * 4099].view(255, 4099)[:, 3::7])
    results.append(("strided 2-D view", a == b, a, b))
    return results


# ---- quantized formats: worked values of docs/specs/quantized-formats.md §8 (name, fmt, input
# builder, options, {buffer: expected leading bytes / values})
def _mxfp8_block():
    x = torch.zeros(32, 32)
    x[0, :8] = torch.tensor([1000.0, -1.0, 0.3, 250.0, -0.001, 7.0, -448.0, 3.0e-5])
    return x


def _fp8_block_row():
    return ((torch.arange(128, dtype=torch.float32) - 64) / 16).reshape(1, 128)


def _nvfp4_row():
    row = [0, 0.1, -0.2, 0.3, 0.5, -0.75, 1.0, 1.25, -1.5, 0.05, 0.9, -1.1, 0.6, 0, 0.4, 1.4,
           10, -5, 2.5, 0, 7.5, -10, 3.3, 1.0, -0.4, 6.0, 8.75, -2.0, 0.2, 4.4, -9.0, 5.5]
    x = torch.zeros(16, 32)
    x[0] = torch.tensor(row)
    return x


FORMAT_VECTORS = [
    ("MXFP8 E4M3 block (§8.1)", "mxfp8", _mxfp8_block, {},
     {"rowwise_data": [0x78, 0xA8, 0x1A, 0x68, 0x80, 0x3E, 0xEE, 0x00], "rowwise_scale_inv": [0x81]}),
    ("MXFP8 E5M2 block (§8.1)", "mxfp8", _mxfp8_block, {"fp8_dtype": torch.float8_e5m2},
     {"rowwise_data": [0x78, 0xD0, 0x49, 0x70, 0xA8, 0x5B, 0xF3, 0x14], "rowwise_scale_inv": [0x7A]}),
    ("FP8 1x128 pow2 scales (§8.3)", "fp8_block_1x128", _fp8_block_row, {},
     {"rowwise_data@0,1,33,63,64,65,100,127": [0xF8, 0xF8, 0xF0, 0xC8, 0x00, 0x48, 0x71, 0x78],
      "rowwise_scale_inv": [0.015625]}),
    ("FP8 1x128 fp32 scales (§8.3)", "fp8_block_1x128", _fp8_block_row, {"pow2_scales": False},
     {"rowwise_data@0,1,33,63,64,65,100,127": [0xFE, 0xFE, 0xF6, 0xCE, 0x00, 0x4E, 0x78, 0x7E],
      "rowwise_scale_inv": [0.008928571827709675]}),  # fp32 bits 3c124925
    ("NVFP4, global amax 10 (§8.4)", "nvfp4", _nvfp4_row, {"global_amax": 10.0},
     {"rowwise_data": [0x10, 0x3A, 0xD4, 0x76, 0x0F, 0xE6, 0x05, 0x73, 0xD7, 0x03, 0xF6, 0x14, 0x68, 0xA7, 0x50, 0x5F],
      "rowwise_scale_inv": [0x68, 0x7E]}),
]


def check_format_vectors(device="cpu"):
    """[(description, ok, got, expected)] for the spec's worked quantization values on `device`."""
    from ..formats import quantize

    results = []
    for name, fmt, build, options, expected in FORMAT_VECTORS:
        qt = quantize(build().to(device), fmt, **options)
        got = {}
        for key, want in expected.items():
            buffer, _, at = key.partition("@")
            flat = getattr(qt, buffer).reshape(-1).cpu()
            picked = flat[[int(i) for i in at.split(",")]] if at else flat[: len(want)]
            got[key] = picked.tolist()
        results.append((name, got == expected, got, expected))
    return results


def check_format_agreement(device, seed=0):
    """[(case, ok, detail)]: every format and usage quantized from the same random bf16 data on the
    CPU and on `device` gives identical buffers, and identical dequantized values."""
    from ..formats import FORMATS, quantize

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(256, 384, generator=gen) * torch.logspace(-3, 3, 384)).to(torch.bfloat16)
    results = []
    for fmt in FORMATS:
        a = quantize(x, fmt, rowwise=True, columnwise=True)
        b = quantize(x.to(device), fmt, rowwise=True, columnwise=True)
        bad = [name for name, buf in a.buffers().items() if not torch.equal(buf, b.buffers()[name].cpu())]
        for usage in ("rowwise", "columnwise"):
            if not torch.equal(a.dequantize(usage=usage), b.dequantize(usage=usage).cpu()):
                bad.append(f"dequantize({usage})")
        results.append((fmt, not bad, ", ".join(bad)))
    return results
