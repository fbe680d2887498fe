import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist


def _num_gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    gpus = _num_gpus()
    why = "no CUDA GPU visible (torch.cuda.is_available() is False)" if gpus == 0 else None
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {why}"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus}"))


@pytest.fixture
def gen():
    """A fresh, randomly seeded generator per test (the seed is printed on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


def run_python(code: str, env=None, timeout=600):
    """Run code in a fresh interpreter (for anything that may leave a sticky CUDA error)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one process (this one), unless a group already exists."""
    created = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if created:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        yield
        if created:
            dist.destroy_process_group()
