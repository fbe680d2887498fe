"""Independent PXH64 references written straight from docs/specs/pxh64.md (no pyxfer code):
one in pure Python integers, one vectorised with numpy's wrapping uint64 arithmetic."""
import numpy as np

K = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
MASK = (1 << 64) - 1


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * M1) & MASK
    z = ((z ^ (z >> 27)) * M2) & MASK
    return z ^ (z >> 31)


def partial_py(data: bytes, seed: int = 0, word_offset: int = 0) -> int:
    acc = 0
    for j in range((len(data) + 7) // 8):
        w = int.from_bytes(data[8 * j:8 * j + 8].ljust(8, b"\0"), "little")
        acc = (acc + mix(w ^ ((seed + (word_offset + j + 1) * K) & MASK))) & MASK
    return acc


def finalize(acc: int, num_bytes: int, seed: int = 0) -> int:
    return mix(acc ^ mix(num_bytes ^ seed ^ M1))


def pxh64_py(data: bytes, seed: int = 0) -> int:
    return finalize(partial_py(data, seed), len(data), seed)


def _mix_np(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(M2)
    return z ^ (z >> np.uint64(31))


def partial_np(data: bytes, seed: int = 0, word_offset: int = 0) -> int:
    padded = np.frombuffer(bytes(data) + b"\0" * (-len(data) % 8), dtype="<u8")
    j = np.arange(word_offset + 1, word_offset + 1 + padded.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = np.uint64(seed) + j * np.uint64(K)
        return int(_mix_np(padded ^ keys).sum(dtype=np.uint64))


def pxh64_np(data: bytes, seed: int = 0) -> int:
    return finalize(partial_np(data, seed), len(data), seed)
