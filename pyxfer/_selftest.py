"""PXH64 test vectors from the spec (shared/specs/checksum.md) and CPU/GPU agreement checks,
used by `pyxfer doctor` and by the tests."""
import torch

from .ops import checksum


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
