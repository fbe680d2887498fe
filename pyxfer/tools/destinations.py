"""Checking where a copy landed, shared by `pyxfer doctor` (verdicts) and `pyxfer bench` (its check of every
point): destinations are filled with a sentinel first, so bytes a copy never wrote show, and are checked
with PXH64 on their own device (no copy back when they are right); only a mismatch brings both sides to the
host, for the evidence (first wrong offset, count)."""
import torch

__all__ = ["SENTINEL", "sentinel_bytes", "compare", "describe"]

SENTINEL = 0xC3


def sentinel_bytes(numel, device, *, pin=False):
    """``numel`` bytes on ``device`` (pinned host memory with ``pin``), every one SENTINEL."""
    return torch.full((numel,), SENTINEL, dtype=torch.uint8, device=device, pin_memory=pin)


def compare(out, src, want=None):
    """None when ``out`` holds exactly ``src``'s bytes, judged by PXH64 on each tensor's own device (``want``:
    the source's PXH64 when already known); else {"first_offset", "wrong_bytes", "got", "want", "all_zero",
    "all_sentinel"} from comparing the bytes on the host."""
    from ..checksums import checksum

    want = checksum(src) if want is None else want
    got = checksum(out)
    if got == want:
        return None
    host = out.reshape(-1).view(torch.uint8).cpu()
    wrong = (host != src.reshape(-1).view(torch.uint8).cpu()).nonzero()
    return {"first_offset": int(wrong[0]) if len(wrong) else None, "wrong_bytes": int(len(wrong)),
            "got": got, "want": want, "all_zero": bool((host == 0).all()),
            "all_sentinel": bool((host == SENTINEL).all())}


def describe(device, diff):
    """One line of evidence for a ``compare`` result."""
    return (f"{device}: PXH64 {diff['got']:#018x}, source {diff['want']:#018x}; {diff['wrong_bytes']} wrong bytes, "
            f"the first at offset {diff['first_offset'] if diff['first_offset'] is not None else '?'}")
