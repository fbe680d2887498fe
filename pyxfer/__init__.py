"""pyxfer: trustworthy, fast tensor transfers between GPUs.

Importing pyxfer loads the native ops into ``torch.ops.pyxfer`` and patches nothing. (A fault named
by $PYXFER_INJECT_FAULT is installed, for demos; see pyxfer.testing.)
"""
import torch  # noqa: F401  (the native module needs torch's libraries loaded first)

# imported for what importing them does: _C registers torch.ops.pyxfer.*, _checks the errors for
# unsupported tensor kinds, _fake the fake kernels for torch.compile
from . import _C, _checks, _fake, buffers, checksums, formats, health, testing  # noqa: F401
from ._build import build_info
from .audit import audit  # the function; the module stays importable as `from pyxfer.audit import ...`
from .buffers import PackedBuffer, SubviewSpec, capture_subviews, pack, restore_subviews
from .checksums import checksum
from .formats import QuantizedTensor, QuantizeSpec, quantize
from .gather import GatherVerificationError, QuantizedGatherFallbackWarning, all_gather, check_gathers
from .guard import device_guard, on_device_of
from .transfer import TransferError, check_transfers, configure_staging, staged_copy, verified_copy, verified_copy_many

__version__ = "0.1.0"

__all__ = [
    "__version__", "all_gather", "buffers", "build_info", "capture_subviews", "check_gathers", "check_transfers",
    "checksum",
    "checksums", "configure_staging", "formats", "GatherVerificationError", "health", "pack", "PackedBuffer",
    "quantize", "QuantizedGatherFallbackWarning", "QuantizedTensor", "QuantizeSpec", "restore_subviews", "staged_copy",
    "SubviewSpec", "testing", "TransferError", "verified_copy", "verified_copy_many", "audit", "device_guard",
    "on_device_of",
]

testing._install_from_env()
health.load_from_env()  # opt-in: $PYXFER_HEALTH_FROM_DOCTOR (see pyxfer.health)
