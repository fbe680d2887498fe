"""Edges of the integration patch contract (pyxfer.integrations._patch) that test_integrations.py's
cases do not reach: owners that are modules or __slots__ instances, a binding listed twice, a rebind
that fails half-way (the earlier ones are put back), a target that fails to import, the base class
without bindings, a version string that is not one."""
import types

import pytest

from pyxfer.integrations import Integration, IntegrationError

pytest.importorskip("accelerate", reason="the integration tests need accelerate (pip install '.[test]')")

from test_integrations import ACCELERATE_VERSION, Owner  # noqa: E402


class Listed(Integration):
    """A real integration of accelerate (real import and version check) whose bindings are given."""

    def __init__(self, bindings, module="accelerate.hooks"):
        super().__init__("edges-test", module=module, distribution="accelerate", tested=("1.0", "99"))
        self._bindings = bindings

    def bindings(self, target):
        yield from self._bindings


class Slotted:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


class ReadOnly:
    """Its ``value`` is a property without a setter: rebinding it on an instance raises."""

    @property
    def value(self):
        return "read-only"


def test_module_and_slots_owners_are_patched_and_restored():
    module = types.ModuleType("pyxfer_edges_owner")
    original = module.fn = lambda: "original"
    slotted = Slotted(original)
    p = Listed([(module, "fn", lambda: "patched"), (slotted, "fn", lambda: "patched-slot")])
    report = p.patch()
    assert [b.where for b in report.bindings] == ["pyxfer_edges_owner.fn", "Slotted.fn"]
    assert not any(b.inherited for b in report.bindings)  # a slot is the instance's own attribute
    assert module.fn() == "patched" and slotted.fn() == "patched-slot"
    p.unpatch()
    assert module.fn is original and slotted.fn is original


def test_a_binding_listed_twice_changes_nothing():
    before = dict(vars(Owner))
    p = Listed([(Owner, "method", lambda self: "one"), (Owner, "static", staticmethod(lambda: "s")),
                (Owner, "method", lambda self: "two")])
    with pytest.raises(RuntimeError, match=r"pyxfer.integrations.edges-test: binding .*Owner.method listed twice"):
        p.patch()
    assert dict(vars(Owner)) == before and not p.is_patched()


def test_a_rebind_failing_half_way_puts_back_the_earlier_ones():
    before = dict(vars(Owner))
    p = Listed([(Owner, "method", lambda self: "patched"), (ReadOnly(), "value", "new")])
    with pytest.raises(AttributeError):
        p.patch()
    assert dict(vars(Owner)) == before and Owner().method() == "original" and not p.is_patched()


def test_a_target_that_fails_to_import_is_an_import_error_naming_it():
    p = Listed([], module="accelerate.pyxfer_no_such_submodule")
    with pytest.raises(IntegrationError, match=rf"edges-test: importing accelerate.pyxfer_no_such_submodule "
                                               rf"\(accelerate {ACCELERATE_VERSION}\) failed: "
                                               rf"ModuleNotFoundError: ") as e:
        p.patch()
    assert e.value.name == "accelerate.pyxfer_no_such_submodule" and isinstance(e.value.__cause__, ImportError)


def test_the_base_class_has_no_bindings():
    with pytest.raises(NotImplementedError):
        Integration("base", module="accelerate.hooks", distribution="accelerate", tested=("1.0", "99")).patch()


def test_a_version_that_is_not_one():
    from pyxfer.integrations._patch import _release
    with pytest.raises(ValueError, match="not a version: 'dev'"):
        _release("dev")
    with pytest.raises(ValueError, match="not a version: 'x1.2'"):
        Integration("x", module="x", distribution="x", tested=("x1.2", "2"))
    assert _release(" v2.0.1") == (2, 0, 1)
