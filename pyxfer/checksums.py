"""PXH64 checksums of tensors (docs/specs/pxh64.md): Python wrappers of torch.ops.pyxfer.checksum."""
import torch

from ._checks import check_seed, check_tensor

__all__ = ["checksum", "checksum_tensor", "as_uint64"]

_U64_MASK = (1 << 64) - 1


def as_uint64(value) -> int:
    """The unsigned value of a PXH64 result (a 0-dim int64 tensor or an int)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) & _U64_MASK


def checksum_tensor(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """PXH64 of ``t`` as a 0-dim int64 tensor (the uint64 bits) on ``t.device``, without a host sync.

    ``t``: any dtype, shape or strides (the logical row-major bytes are hashed), on CPU or CUDA;
    computed on ``t``'s device and, for CUDA, on that device's current stream. Mutates nothing.
    Raises TypeError / ValueError for a non-tensor, a sparse, nested, quantized or meta input, or a
    bad seed.
    """
    check_tensor("pyxfer.checksum", "t", t)
    return torch.ops.pyxfer.checksum(t, check_seed("pyxfer.checksum", seed))


def checksum(t: torch.Tensor, seed: int = 0) -> int:
    """PXH64 of ``t`` (docs/specs/pxh64.md) as an unsigned Python int in [0, 2**64).

    Same inputs and errors as :func:`checksum_tensor`; waits for the value (one host sync).
    """
    return as_uint64(checksum_tensor(t, seed))
