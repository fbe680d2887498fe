"""pyxfer.audit on real GPUs: host <-> device copies made with torch are counted with their bytes,
pyxfer's verified copies (which use aten copies inside on the host <-> device path) count once as
pyxfer's; with two GPUs, ops on tensors of a device that is not current are counted, and the guard
makes that count zero."""
import pytest
import torch

import pyxfer
from pyxfer.audit import Tally


class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(9, 9)

    def forward(self, x):
        labels = x.to("cuda:0")                     # unverified, by the model body
        y = pyxfer.verified_copy(x, "cuda:0")        # verified
        back = pyxfer.verified_copy(y, "cpu")        # verified, device -> host
        out = torch.empty_like(labels)
        out.copy_(x)                                 # unverified copy_
        return self.proj(y + labels + out), back


@pytest.mark.gpu
def test_host_device_copies_are_counted_once_and_told_apart(gen):
    model = Body().to("cuda:0")
    x = torch.randn(5, 9, generator=gen)
    with pyxfer.audit(model) as report:
        out, back = model(x)
        out.cpu()                                     # unverified, outside any module
    assert torch.equal(back, x)
    n = x.numel() * 4
    assert report.unverified_copies == {
        ("Body", "cpu", "cuda:0"): Tally(2, 2 * n),
        ("(no module)", "cuda:0", "cpu"): Tally(1, out.numel() * 4),
    }, report
    assert {k: v.count for k, v in report.pyxfer_copies.items()} == {
        ("Body", "cpu", "cuda:0"): 1, ("Body", "cuda:0", "cpu"): 1}
    assert report.num_off_device_ops == 0


@pytest.mark.multigpu
def test_ops_off_the_current_device_are_counted_and_guarded_to_zero(gen):
    torch.cuda.set_device(0)
    x1 = torch.randn(64, generator=gen).to("cuda:1")
    lin = torch.nn.Linear(64, 8).to("cuda:1")
    with pyxfer.audit(lin) as plain:
        y = lin(x1 * 2)
    assert plain.num_off_device_ops >= 2 and all(c == "cuda:0" and d == "cuda:1"
                                                 for (_, _, d, c) in plain.off_device_ops), plain
    assert ("(no module)", "mul", "cuda:1", "cuda:0") in plain.off_device_ops
    with pyxfer.audit(lin) as guarded, pyxfer.device_guard(x1):
        z = lin(x1 * 2)
    assert guarded.num_off_device_ops == 0 and torch.equal(y, z)
    torch.cuda.set_device(0)
