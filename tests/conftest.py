"""Markers (gpu, multigpu: skipped with the reason where the GPUs are missing) and the fixtures
tests of several subjects share. Helpers that tests import live in the support package."""
import os
import tempfile

import pytest

# before support is imported: its helpers' asserts explain their failures like the tests' own
pytest.register_assert_rewrite("support")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from support.simulated_cuda import SimulatedCuda  # noqa: E402


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


@pytest.fixture
def gpus(monkeypatch):
    """Four simulated CUDA devices (support.simulated_cuda), for device-guard logic without GPUs."""
    from pyxfer import _devices
    sim = SimulatedCuda()
    monkeypatch.setattr(_devices, "_num_cuda_devices", sim.count)
    monkeypatch.setattr(torch.cuda, "current_device", sim.current)
    monkeypatch.setattr(torch.cuda, "_exchange_device", sim.exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", sim.maybe_exchange)
    return sim


@pytest.fixture
def clean_transfers():
    """cuda:0 current (where CUDA is) and every pair's health unknown before a test; after it, the
    GPUs' work finished, no latched deferred mismatch left behind (check_transfers raises it) and
    health, current device reset."""
    import pyxfer
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    pyxfer.health.reset()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_device(0)
    pyxfer.check_transfers()  # no test may leave a latched mismatch behind
    pyxfer.health.reset()
