"""GatherVerificationError samples for tests/gather/test_errors.py, in the support package so that a spawned
process-pool worker can import them (a test module is not importable by name there)."""
from pyxfer.gather import GatherVerificationError


def make_error(seed):
    """An error with fields that differ from one another (so a swap shows), hashes over 2**63; (error,
    message, fields)."""
    g = int.from_bytes(seed, "little")
    fields = dict(src_rank=3 + g % 5, rank=g % 3, buffer="columnwise_scale_inv", num_bytes=2 ** 20 + 3 + g % 1000,
                  expected=2 ** 63 + g % 2 ** 62, actual=(g * 7919) % 2 ** 63 + 1)
    message = f"pyxfer.all_gather: the columnwise_scale_inv shard from rank {fields['src_rank']} arrived corrupted"
    return GatherVerificationError(message, **fields), message, fields


def raise_error(seed):  # runs in a process-pool worker
    raise make_error(seed)[0]
