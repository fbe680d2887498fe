"""pyxfer: trustworthy, fast tensor transfers between GPUs.

Importing pyxfer loads the native ops into ``torch.ops.pyxfer`` and patches nothing.
"""
import torch  # noqa: F401  (the native module needs torch's libraries loaded first)

from . import _C  # noqa: F401  (registers torch.ops.pyxfer.*)
from . import _fake  # noqa: F401  (fakes for torch.compile / FakeTensor)
from .ops import build_info, checksum

__version__ = "0.1.0"

__all__ = ["build_info", "checksum", "__version__"]
