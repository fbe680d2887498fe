"""Facts about this machine for reports and JSON: driver, GPUs (with UUIDs), peer access, versions."""
import ctypes
import os
import platform

import torch

from .._devices import as_device

__all__ = ["driver_version", "nvidia_driver", "gpus", "peer_matrix", "memory_bytes", "machine_info"]


def driver_version():
    """CUDA driver version as 'major.minor' (from libcuda), or None where there is no driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
        return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        return None


def nvidia_driver():
    """The NVIDIA driver's own version string (e.g. '570.86.15', which names the release exactly, unlike
    driver_version's CUDA API version) from NVML, where nvidia-ml-py is installed (pip install
    'pyxfer[nvml]') and a driver answers; else None. Raises nothing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else version


def gpus():
    """[{index, name, uuid, capability, memory_gib, sms}] of the visible CUDA GPUs ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", "")) or None
        if uuid and not uuid.startswith("GPU-"):
            uuid = f"GPU-{uuid}"
        out.append({"index": i, "name": p.name, "uuid": uuid, "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count})
    return out


def peer_matrix(n):
    """n x n: [i][j] is whether cuda:i can access cuda:j's memory (None on the diagonal)."""
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
            for i in range(n)]


def memory_bytes(device) -> int:
    """Total memory of ``device`` in bytes: the host's physical memory for "cpu", the GPU's for a CUDA device."""
    device = as_device("pyxfer.tools.machine.memory_bytes", "device", device)
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return torch.cuda.get_device_properties(device).total_memory


def machine_info():
    """Machine and versions for a benchmark's JSON: host, Python, torch, CUDA, NCCL, driver, GPUs (with
    UUIDs), peer access, pyxfer build, CPU threads and the NCCL / multicast / pyxfer environment."""
    import pyxfer
    nccl = None
    if torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    devices = gpus()
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "nccl": nccl, "driver": driver_version(),
            "nvidia_driver": nvidia_driver(), "gpus": devices, "peer_access": peer_matrix(len(devices)),
            "pyxfer": pyxfer.__version__, "build": pyxfer.build_info(),
            "threads": torch.get_num_threads(),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "CUDA_VISIBLE", "PYXFER_"))}}
