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
