"""The gather's public error and warning classes, and the once-per-call-site warning."""
import os
import sys
import warnings

OP = "pyxfer.all_gather"


class QuantizedGatherFallbackWarning(UserWarning):
    """all_gather gathered in high precision instead of quantized; the message says why (the shard
    dimension and block size, or the NVFP4 amax that differs). Shown once per call site and reason."""
    __module__ = "pyxfer.gather"


class GatherVerificationError(RuntimeError):
    """A shard arrived with other bytes than its sender hashed (``verify=True``). Attributes:
    ``src_rank`` (sender, group rank), ``rank`` (receiver), ``buffer`` (e.g. "rowwise_data"),
    ``num_bytes``, ``expected`` (sender PXH64) and ``actual`` (receiver PXH64), unsigned ints."""
    __module__ = "pyxfer.gather"

    def __init__(self, message, *, src_rank, rank, buffer, num_bytes, expected, actual):
        super().__init__(message)
        self.src_rank, self.rank, self.buffer = src_rank, rank, buffer
        self.num_bytes, self.expected, self.actual = num_bytes, expected, actual

    def __reduce__(self):
        # BaseException rebuilds an error as cls(*args), without the keyword-only fields, so pickling
        # (a process-pool worker raising it: BrokenProcessPool) and copying failed. The fields are passed
        # again; the state (__dict__: the fields, notes, attributes set later) is restored after.
        fields = {name: getattr(self, name) for name in _VERIFICATION_FIELDS}
        return _rebuild, (type(self), self.args, fields), self.__dict__


_VERIFICATION_FIELDS = ("src_rank", "rank", "buffer", "num_bytes", "expected", "actual")


def _rebuild(cls, args, fields):
    return cls(*args, **fields)


# The warning points at the first frame outside pyxfer (the caller's call site).
_PYXFER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_warned = set()


def warn_once(message, key):
    """Warn QuantizedGatherFallbackWarning once per (call site, ``key``)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2 is our caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PYXFER_DIR):
        frame, level = frame.f_back, level + 1
    site = (frame.f_code.co_filename, frame.f_lineno, key) if frame is not None else (None, None, key)
    if site in _warned:
        return
    _warned.add(site)
    warnings.warn(message, QuantizedGatherFallbackWarning, stacklevel=level)
