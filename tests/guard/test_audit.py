"""pyxfer.audit without a GPU: copies a model makes itself are counted per module (to the meta
device, the only other device a CPU machine has), pyxfer's own copies are told apart (their inner
aten copies are not counted again), hooks and the mode are removed afterwards, also on errors."""
import pytest
import torch

import pyxfer
from pyxfer.audit import AuditReport, Tally


class Mover(torch.nn.Module):
    """Moves tensors itself, as model bodies do (labels.to(logits.device), masks...)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(7, 7)

    def forward(self, x):
        side = x.to("meta")                 # aten._to_copy between devices
        buf = torch.empty(x.shape, device="meta")
        buf.copy_(x)                        # aten.copy_ between devices
        y = pyxfer.verified_copy(x, "cpu")  # pyxfer's copy (its own aten ops are not re-counted)
        return self.proj(y + x), side


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Mover()
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        h, _ = self.inner(x)
        return self.head(h).to("meta")


def test_counts_per_module(gen):
    model = Outer()
    x = torch.randn(5, 7, generator=gen)
    want = model(x)
    with pyxfer.audit(model) as report:
        got = model(x)
        model.inner(x)
    assert got.device.type == "meta" and got.shape == want.shape
    nbytes = x.numel() * 4
    assert report.unverified_copies == {
        ("inner", "cpu", "meta"): Tally(4, 4 * nbytes),     # two calls of inner, two copies each
        ("Outer", "cpu", "meta"): Tally(1, 5 * 3 * 4),      # the root, named by its class
    }
    assert report.pyxfer_copies == {("inner", "cpu", "cpu"): Tally(2, 2 * nbytes)}
    assert report.num_unverified_copies == 5 and report.num_pyxfer_copies == 2
    assert report.num_off_device_ops == 0 and report.off_device_ops == {}
    text = str(report)
    assert text.startswith("pyxfer audit: 5 copies between devices not made by pyxfer, 2 by pyxfer; 0 ops")
    assert "  inner: cpu -> meta: 4, 560" in text
    data = report.as_dict()
    assert dict(module="Outer", src="cpu", dst="meta", count=1, num_bytes=60) in data["unverified_copies"]


def test_unnamed_modules_and_code_outside_modules(gen):
    x = torch.randn(3, generator=gen)
    mover = Mover()
    mover.proj = torch.nn.Linear(3, 3)
    with pyxfer.audit() as report:
        x.to("meta")
        mover(x)
    assert report.unverified_copies[("(no module)", "cpu", "meta")].count == 1
    assert report.unverified_copies[("Mover", "cpu", "meta")].count == 2


def test_hooks_and_mode_are_removed_even_when_the_block_raises(gen):
    before = (dict(torch.nn.modules.module._global_forward_pre_hooks),
              dict(torch.nn.modules.module._global_forward_hooks))
    model = Outer()
    with pytest.raises(RuntimeError, match="stop"):
        with pyxfer.audit(model) as report:
            model(torch.randn(2, 7, generator=gen))
            raise RuntimeError("stop")
    assert (dict(torch.nn.modules.module._global_forward_pre_hooks),
            dict(torch.nn.modules.module._global_forward_hooks)) == before
    counted = report.num_unverified_copies
    torch.randn(2).to("meta")
    assert report.num_unverified_copies == counted == 3
    assert isinstance(report, AuditReport)


def test_nested_audits_both_count(gen):
    x = torch.randn(4, generator=gen)
    with pyxfer.audit() as outer:
        with pyxfer.audit() as inner:
            x.to("meta")
            pyxfer.verified_copy(x, "cpu")
        x.to("meta")
    assert inner.num_unverified_copies == 1 and outer.num_unverified_copies == 2
    assert inner.num_pyxfer_copies == outer.num_pyxfer_copies == 1


def test_audit_rejects_non_modules():
    with pytest.raises(TypeError, match="pyxfer.audit: models must be torch.nn.Module, got int"):
        with pyxfer.audit(3):
            pass


def test_copies_within_one_device_are_not_counted(gen):
    x = torch.randn(6, 5, generator=gen)
    buf = torch.empty(6, 5)
    with pyxfer.audit() as report:
        buf.copy_(x)                          # copy_ on the CPU
        x.to(torch.float64)                   # _to_copy changing only the dtype
        x.to("cpu", copy=True)                # an explicit copy in place
        pyxfer.verified_copy(x, "cpu")        # pyxfer's copies count even within a device
    assert report.unverified_copies == {} and report.num_unverified_copies == 0
    assert report.pyxfer_copies == {("(no module)", "cpu", "cpu"): Tally(1, 120)}
    # only pyxfer's table has rows: the other is left out of the text
    assert str(report).splitlines() == [
        "pyxfer audit: 0 copies between devices not made by pyxfer, 1 by pyxfer; 0 ops with CUDA tensors off the "
        "current device",
        "copies made by pyxfer (module: from -> to: count, bytes):",
        "  (no module): cpu -> cpu: 1, 120"]


def test_off_device_ops_in_the_text_and_data():
    # what a GPU run fills (see test_audit_gpu.py), rendered the same way on any machine
    report = AuditReport()
    report.off_device_ops[("layers.1", "mm", "cuda:1", "cuda:0")] = 3
    report.off_device_ops[("head", "add", "cuda:2", "cuda:0")] = 1
    assert report.num_off_device_ops == 4
    assert str(report).splitlines()[1:] == [
        "ops off the current device (module: op: tensor device / current device: count):",
        "  head: add: cuda:2 / cuda:0: 1", "  layers.1: mm: cuda:1 / cuda:0: 3"]
    assert report.as_dict()["off_device_ops"][0] == dict(module="layers.1", op="mm", device="cuda:1",
                                                         current="cuda:0", count=3)


class OpensAnAudit(torch.nn.Module):
    """Starts an audit inside its forward and leaves it open: the audit sees this module return
    without having seen it start."""

    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, x):
        self.report = self.stack.enter_context(pyxfer.audit())
        return x.to("meta")


def test_an_audit_opened_inside_a_forward(gen):
    import contextlib
    x = torch.randn(3, generator=gen)
    with pyxfer.audit() as outer, contextlib.ExitStack() as stack:
        opener = OpensAnAudit(stack)
        opener(x)  # returns while the inner audit runs, which never saw it start: nothing to pop there
        x.to("meta")
    assert opener.report.unverified_copies == {("(no module)", "cpu", "meta"): Tally(2, 24)}
    assert outer.unverified_copies == {("OpensAnAudit", "cpu", "meta"): Tally(1, 12),
                                       ("(no module)", "cpu", "meta"): Tally(1, 12)}
