"""CUDA devices simulated for device-guard logic on machines without them (the ``gpus`` fixture of
tests/conftest.py installs one at the one place pyxfer reads device counts, pyxfer._devices, and at
torch.cuda's current-device functions; pyxfer's own code runs unchanged)."""
import threading


class SimulatedCuda:
    """Four CUDA devices as torch.cuda's device functions see them: a current device per thread
    (0 in a new thread, as in the CUDA runtime) and the exchanges device guards make."""

    count = 4

    def __init__(self):
        self.local = threading.local()
        self.entered = []  # every index made current, in order

    def current(self):
        return getattr(self.local, "device", 0)

    def set(self, index):
        assert 0 <= index < self.count, index
        self.local.device = index

    def exchange(self, index):
        prev = self.current()
        self.entered.append(index)
        self.set(index)
        return prev

    def maybe_exchange(self, index):
        prev = self.current()
        self.set(index)
        return prev
