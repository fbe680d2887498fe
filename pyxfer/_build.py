"""Facts of the native build (torch.ops.pyxfer.build_info), for users, bug reports and the doctor."""
import json

import torch

from . import _C  # noqa: F401  (registers torch.ops.pyxfer.*)

__all__ = ["build_info"]


def build_info() -> dict:
    """Facts of this build: torch it was built against, CUDA on/off, CUDA version and architectures,
    plus ``torch_runtime`` (the torch imported now). Mutates nothing; raises nothing."""
    info = json.loads(torch.ops.pyxfer.build_info())
    info["torch_runtime"] = torch.__version__
    return info
