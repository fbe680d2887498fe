"""Python wrappers of the native ops: argument checks with clear errors, Python-friendly results."""
import json

import torch

__all__ = ["build_info", "checksum", "checksum_tensor", "as_uint64", "check_tensor"]

_U64_MASK = (1 << 64) - 1


def check_tensor(op: str, name: str, t) -> None:
    """Raise a clear error unless ``t`` is a dense strided tensor with data."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise ValueError(f"{op}: {name} must be a dense tensor, got a nested tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} must be a dense strided tensor, got layout {t.layout}")
    if t.device.type == "meta":
        raise ValueError(f"{op}: {name} is on the meta device and has no data to read")


def _seed_bits(op: str, seed) -> int:
    """PXH64 seeds are uint64; the op schema carries their bits as int64."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{op}: seed must be an int in [0, 2**64), got {type(seed).__name__}")
    if not 0 <= seed <= _U64_MASK:
        raise ValueError(f"{op}: seed must be in [0, 2**64), got {seed}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def as_uint64(value) -> int:
    """The unsigned value of a PXH64 result (a 0-dim int64 tensor or an int)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) & _U64_MASK


def checksum_tensor(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """PXH64 of ``t`` as a 0-dim int64 tensor (the uint64 bits) on ``t.device``, without a host sync.

    ``t``: any dtype, shape or strides (the logical row-major bytes are hashed), on CPU or CUDA;
    computed on ``t``'s device and, for CUDA, on that device's current stream. Mutates nothing.
    Raises TypeError / ValueError for a non-tensor, sparse, nested or meta input or a bad seed.
    """
    check_tensor("pyxfer.checksum", "t", t)
    return torch.ops.pyxfer.checksum(t, _seed_bits("pyxfer.checksum", seed))


def checksum(t: torch.Tensor, seed: int = 0) -> int:
    """PXH64 of ``t`` (see shared spec checksum.md) as an unsigned Python int in [0, 2**64).

    Same inputs and errors as :func:`checksum_tensor`; waits for the value (one host sync).
    """
    return as_uint64(checksum_tensor(t, seed))


def build_info() -> dict:
    """Facts of this build: torch it was built against, CUDA on/off, CUDA version and architectures."""
    info = json.loads(torch.ops.pyxfer.build_info())
    info["torch_runtime"] = torch.__version__
    return info
