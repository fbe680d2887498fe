"""Verified copies between devices: hash on the source, copy, hash on the destination, compare;
on a mismatch, repair through the staged path or raise TransferError. See docs/transfers.md; the
protocol runs natively (torch.ops.pyxfer.verified_copy).

Host work -- hashing what lands in host memory as each chunk arrives, hashing a CPU source beside its
copy, the host legs of staged copies, CPU checksums -- runs on one pool of threads per process, made at
its first use: $PYXFER_HOST_HASH_THREADS workers (0..256; default min(CPU threads / 2, 16); 0: the
calling threads do it all) and PXH64 in $PYXFER_HOST_HASH_ISA (auto, scalar, avx2 or avx512; default
auto: the best this CPU runs; every one gives the same bits), both read once. torch.ops.pyxfer.
host_hash_info() tells what is in use."""
import os

import torch

from . import health
from ._checks import check_bool, check_int, check_tensor
from ._devices import ANY_CODE as _ANY_CODE
from ._devices import as_device, device_name

__all__ = ["TransferError", "verified_copy", "staged_copy", "check_transfers", "configure_staging", "ROUTES"]

ROUTES = ("auto", "direct", "staged")
VERIFY_MODES = ("sync", "deferred", "none")
_NATIVE_PREFIX = "pyxfer.TransferError: "
_verified_copy_op = torch.ops.pyxfer.verified_copy.default  # the overload itself: no packet lookup per call
_RECORD_ROUTES = (None, "direct", "staged")  # the route code of an error record
_MASK64 = (1 << 64) - 1


class TransferError(RuntimeError):
    """A copy whose destination did not match its source. Attributes (None if unknown): ``src`` and
    ``dst`` (device names), ``num_bytes``, ``src_hash`` and ``dst_hash`` (PXH64 values as ints; the
    destination's of the first failing attempt), ``route`` ("direct" or "staged": the route of that
    attempt; None for deferred copies), ``attempt`` (the last attempt that failed: 2 when a sync
    copy's staged retry failed too, 1 for a deferred copy, which is never retried) and
    ``retry_dst_hash`` (the destination PXH64 of that staged retry)."""

    def __init__(self, message, *, src=None, dst=None, num_bytes=None, src_hash=None, dst_hash=None, route=None,
                 attempt=None, retry_dst_hash=None):
        super().__init__(message)
        self.src, self.dst, self.num_bytes, self.src_hash, self.dst_hash = src, dst, num_bytes, src_hash, dst_hash
        self.route, self.attempt, self.retry_dst_hash = route, attempt, retry_dst_hash


def _error_fields(record) -> dict:
    """TransferError's keyword arguments from a native error record (csrc/transfer/errors.cpp:
    [count, src, dst, num_bytes, src_hash, dst_hash, route, attempt, retry_dst_hash])."""
    _, src, dst, num_bytes, src_hash, dst_hash, route, attempt, retry_dst_hash = record
    return dict(src=device_name(src), dst=device_name(dst), num_bytes=num_bytes, src_hash=src_hash & _MASK64,
                dst_hash=dst_hash & _MASK64, route=_RECORD_ROUTES[route], attempt=attempt,
                retry_dst_hash=retry_dst_hash & _MASK64 if attempt > 1 else None)


def _sync_error(message: str) -> TransferError:
    """The TransferError of the sync copy that just failed in this thread: its native message, and its
    fields from the record the native op kept for this thread."""
    text = message[message.index(_NATIVE_PREFIX) + len(_NATIVE_PREFIX):].splitlines()[0]
    record = torch.ops.pyxfer.take_sync_transfer_error()
    return TransferError(text, **_error_fields(record)) if record else TransferError(text)


_default_route = None


def default_route() -> str:
    """The route used when none is given: $PYXFER_ROUTE (auto, direct or staged), else "auto".
    Read at the first copy, like the native knobs (no environment lookup on every call)."""
    global _default_route
    if _default_route is None:
        route = os.environ.get("PYXFER_ROUTE", "auto")
        if route not in ROUTES:
            raise ValueError(f"PYXFER_ROUTE must be one of {ROUTES}, got {route!r}")
        _default_route = route
    return _default_route


def verified_copy(src: torch.Tensor, device, *, route=None, verify: str = "sync",
                  pin_memory: bool = True) -> torch.Tensor:
    """Copy ``src`` to ``device`` and prove the copy is bit-exact.

    Returns a contiguous tensor on ``device`` with src's dtype, shape and bits, ready for work queued
    on the destination device's current stream (like ``Tensor.to``). ``src``: any dtype, shape or
    strides, on the CPU or a GPU; it is not modified and is kept alive until the copy has read it.
    ``device``: torch.device, string or CUDA index. ``route``: "direct" (peer copy engine; peer
    access enabled explicitly), "staged" (through the pinned host pool), "auto" (direct unless
    pyxfer.health says the pair is corrupt or has no peer access); default $PYXFER_ROUTE or "auto".
    ``verify``: "sync" (wait for both checksums; on a mismatch mark the pair corrupt, copy again
    staged and verify again), "deferred" (no host wait: the comparison runs on the device and a
    mismatch is raised by this thread's check_transfers(); capturable in a CUDA graph), "none".
    A CPU destination is compared on the host, so there "deferred" is synchronous like "sync" (the
    copy is hashed as it lands and a mismatch is latched for check_transfers() instead of repaired).
    ``pin_memory`` (a bool): the CPU result of a copy from a GPU is page-locked memory from torch's
    caching host allocator, as ``t.to("cpu", non_blocking=True)`` returns (fast: the GPU writes it
    directly; it is freed back to that cache); False returns pageable memory (staged through pyxfer's
    pinned pool, at a fraction of the speed). Ignored for every other pair (a CPU -> CPU result is
    pageable, a GPU result is GPU memory).
    In CUDA graph capture, refused with a RuntimeError: verify="sync", the staged route (also when
    "auto" resolves to it), a CPU destination, verify="deferred" from a CPU source, a CPU source
    that is not contiguous and pinned, a non-contiguous source on a device that is not capturing.
    Differentiable: the gradient goes back to src's device through a verified copy.

    Raises TransferError (a RuntimeError) when the data arrived wrong on both paths (nothing is
    returned); TypeError/ValueError/RuntimeError with the argument named for bad input (sparse,
    nested or meta tensors, unknown devices or routes, a pin_memory that is not a bool), before
    anything is allocated.
    """
    op = "pyxfer.verified_copy"
    check_tensor(op, "src", src)
    check_bool(op, "pin_memory", pin_memory)
    route = default_route() if route is None else route
    if route not in ROUTES:
        raise ValueError(f"{op}: route must be one of {ROUTES}, got {route!r}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"{op}: verify must be one of {VERIFY_MODES}, got {verify!r}")
    device = as_device(op, "device", device)
    try:
        return _verified_copy_op(src, device, route, verify, pin_memory)
    except RuntimeError as e:
        if _NATIVE_PREFIX in str(e):
            raise _sync_error(str(e)) from None
        raise


def staged_copy(src: torch.Tensor, device) -> torch.Tensor:
    """Unverified copy of ``src`` to ``device`` through the bounded, reused pool of pinned host
    buffers, chunk k+1 leaving the source while chunk k arrives. Same result and stream semantics
    as verified_copy (a CPU result of a GPU source is pinned memory, as with its default
    pin_memory=True); differentiable like it (the gradient goes back to src's device, staged);
    raises for bad input like it, and RuntimeError during CUDA graph capture."""
    op = "pyxfer.staged_copy"
    check_tensor(op, "src", src)
    return torch.ops.pyxfer.staged_copy(src, as_device(op, "device", device))


def check_transfers() -> None:
    """Raise TransferError for mismatches found by this thread's ``verify="deferred"`` copies (and
    by replays of the CUDA graphs it captured) since its last call, after waiting for the devices
    that ran them; mark every pair that had one corrupt. The error's message counts them all and its
    fields are those of the first. Returns None otherwise. Other threads' copies are reported by
    their own calls; a replay queued after this call is reported by the next one."""
    record = torch.ops.pyxfer.take_transfer_errors()
    if not record:
        return
    count, first, others = record[0], record[:9], record[9:]
    if first[1] == _ANY_CODE:  # counted, but no record complete yet (a replay was still writing it)
        raise TransferError(f"{count} deferred verified cop{'y' if count == 1 else 'ies'} failed verification "
                            f"(details not recorded)")
    fields = _error_fields(first)
    health.mark(fields["src"], fields["dst"], "corrupt")
    for src, dst in zip(others[0::2], others[1::2]):
        health.mark(device_name(src), device_name(dst), "corrupt")
    raise TransferError(
        f"{count} deferred verified cop{'y' if count == 1 else 'ies'} failed verification; the first: copy "
        f"{fields['src']} -> {fields['dst']} of {fields['num_bytes']} bytes: source PXH64 {fields['src_hash']:#x}, "
        f"destination PXH64 {fields['dst_hash']:#x}", **fields)


def configure_staging(chunk_bytes: int = 8 << 20, num_slots: int = 4) -> None:
    """Size of the staging pool used by later staged copies: ``num_slots`` (2..64) pinned buffers of
    ``chunk_bytes`` (a multiple of 4096) each, allocated once and reused (never per tensor).
    Raises TypeError for a non-int (a float or a string like "8M" is not rounded or parsed) and
    RuntimeError for a value out of range."""
    op = "pyxfer.configure_staging"
    torch.ops.pyxfer.configure_staging(check_int(op, "chunk_bytes", chunk_bytes), check_int(op, "num_slots", num_slots))
