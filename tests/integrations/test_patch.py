"""The integration patch contract (pyxfer.integrations._patch) on real targets, and accelerate's
opt-in patch_send_to_device; its edges (owners that are modules or __slots__ instances, a binding
listed twice, a rebind that fails half-way, a target that fails to import, the base class without
bindings, a version string that is not one) and a script's own module (``__main__``, which
multiprocessing also registers as ``__mp_main__``: its binding is patched once)."""
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

import pyxfer
from pyxfer.integrations import Integration, IntegrationError, PatchConflictError, PatchReport
from pyxfer.integrations import accelerate as pxa

pytest.importorskip("accelerate", reason="the integration tests need accelerate (pip install '.[test]')")
import accelerate.hooks  # noqa: E402
import accelerate.utils.operations  # noqa: E402

from support.integrations_models import dispatch, input_ids, tiny_llama  # noqa: E402

ACCELERATE_VERSION = importlib.metadata.version("accelerate")


class Owner:
    """A real class as a patch owner: its own function, a staticmethod, an inherited attribute."""

    def method(self):
        return "original"

    @staticmethod
    def static():
        return "static"


class Child(Owner):
    pass


class OwnerPatch(Integration):
    """An integration of accelerate (real import, real version check) that patches Owner/Child."""

    def __init__(self, tested=("1.0", "99"), missing=False):
        super().__init__("owner-test", module="accelerate.hooks", distribution="accelerate", tested=tested)
        self.missing = missing

    def bindings(self, target, *, tag="a"):
        if tag not in ("a", "b"):
            raise ValueError(f"tag must be 'a' or 'b', got {tag!r}")
        yield Owner, "method", lambda self: f"patched-{tag}"
        yield Owner, "static", staticmethod(lambda: f"static-{tag}")
        yield Child, "method", lambda self: f"child-{tag}"  # inherited until patched
        if self.missing:
            yield Owner, "no_such_attribute", None


def test_patch_unpatch_restores_the_identical_objects():
    p = OwnerPatch()
    own = dict(vars(Owner))
    assert not p.is_patched() and p.report() is None
    report = p.patch(tag="b")
    assert isinstance(report, PatchReport) and report.options == {"tag": "b"}
    assert report.target_version == ACCELERATE_VERSION
    assert [b.where for b in report.bindings] == [
        f"{__name__}.Owner.method", f"{__name__}.Owner.static", f"{__name__}.Child.method"]
    assert report.bindings[0].original is own["method"] and report.bindings[1].original is own["static"]
    assert report.bindings[2].inherited and not report.bindings[0].inherited
    assert Owner().method() == "patched-b" and Owner.static() == "static-b" and Child().method() == "child-b"
    assert "3 bindings patched" in str(report)
    assert p.patch(tag="b") is report  # idempotent: nothing changes
    with pytest.raises(ValueError, match=r"already patched with options \{'tag': 'b'\}"):
        p.patch(tag="a")
    p.unpatch()
    assert not p.is_patched()
    assert vars(Owner)["method"] is own["method"] and vars(Owner)["static"] is own["static"]
    assert "method" not in vars(Child) and Child().method() == "original"
    assert Owner.static() == "static"
    p.unpatch()  # not patched: nothing to do


def test_a_missing_binding_changes_nothing():
    p = OwnerPatch(missing=True)
    before = dict(vars(Owner))
    with pytest.raises(IntegrationError, match=r"Owner has no attribute 'no_such_attribute'"):
        p.patch()
    assert dict(vars(Owner)) == before and "method" not in vars(Child) and not p.is_patched()


def test_bad_options_raise_from_bindings_and_change_nothing():
    p = OwnerPatch()
    with pytest.raises(ValueError, match="tag must be"):
        p.patch(tag="c")
    with pytest.raises(TypeError):
        p.patch(colour="red")
    assert not p.is_patched() and Owner().method() == "original"


def test_unpatch_refuses_a_binding_rebound_by_someone_else():
    p = OwnerPatch()
    original = vars(Owner)["method"]
    p.patch()
    theirs = lambda self: "theirs"  # noqa: E731
    Owner.method = theirs
    with pytest.raises(PatchConflictError, match=r"Owner.method now holds"):
        p.unpatch()
    assert p.is_patched() and vars(Owner)["method"] is theirs and Owner.static() == "static-a"  # nothing changed
    with pytest.warns(RuntimeWarning, match="overwrites bindings re-bound"):
        p.unpatch(force=True)
    assert vars(Owner)["method"] is original and not p.is_patched() and Owner.static() == "static"


def test_patched_context_unpatches_when_the_body_raises():
    p = OwnerPatch()
    with pytest.raises(KeyError):
        with p.patched(tag="b") as report:
            assert report.options == {"tag": "b"} and Owner().method() == "patched-b"
            raise KeyError("body")
    assert not p.is_patched() and Owner().method() == "original"
    # A patch applied before the block is left in place after it.
    p.patch()
    with p.patched() as report:
        assert report is p.report()
    assert p.is_patched()
    p.unpatch()


def test_concurrent_patch_calls_patch_once():
    p = OwnerPatch()
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(p.patch())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in reports}) == 1 and Owner().method() == "patched-a"
    p.unpatch()
    assert Owner().method() == "original"


def test_untested_version_is_an_import_error(monkeypatch):
    monkeypatch.delenv("PYXFER_ALLOW_UNTESTED", raising=False)
    p = OwnerPatch(tested=("0.1", "0.2"))
    with pytest.raises(IntegrationError,
                       match=rf"tested with accelerate>=0.1,<0.2, found accelerate {ACCELERATE_VERSION}"):
        p.patch()
    assert isinstance(IntegrationError("x"), ImportError) and Owner().method() == "original"
    monkeypatch.setenv("PYXFER_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="PYXFER_ALLOW_UNTESTED"):
        with OwnerPatch(tested=("0.1", "0.2")).patched():
            assert Owner().method() == "patched-a"
    assert Owner().method() == "original"


def test_missing_library_is_an_import_error_naming_it():
    class Missing(Integration):
        def __init__(self):
            super().__init__("missing", module="pyxfer_no_such_module", distribution="pyxfer-no-such-dist",
                             tested=("1", "2"))

        def bindings(self, target):
            yield target, "x", None

    with pytest.raises(IntegrationError, match=r"needs pyxfer-no-such-dist .* not installed: pip install") as e:
        Missing().patch()
    assert isinstance(e.value, ImportError) and e.value.name == "pyxfer_no_such_module"


def test_bad_tested_range_is_rejected():
    with pytest.raises(ValueError, match="tested must be"):
        Integration("x", module="x", distribution="x", tested=("2", "1"))


def test_version_ordering():
    from pyxfer.integrations._patch import _below, _release
    assert _release("1.15.0.dev0") == (1, 15) and _release("2.20.2+cu130") == (2, 20, 2)
    assert _below("1.15.9", "1.16") and not _below("1.16.0rc1", "1.16") and not _below("1.16", "1.16.0")
    assert _below("1.9.9", "1.10") and not _below("1.10.0", "1.10")


def test_importing_pyxfer_imports_no_target_library():
    code = ("import sys, pyxfer, pyxfer.integrations, pyxfer.integrations.accelerate;"
            "bad = [m for m in ('accelerate', 'transformers', 'transformer_engine') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- accelerate's patch_send_to_device ----------------------------------------------------------

def test_patch_send_to_device_rebinds_only_the_hooks_name(gen):
    original = accelerate.hooks.send_to_device
    assert original is accelerate.utils.operations.send_to_device
    report = pxa.patch_send_to_device(verify="deferred")
    try:
        assert pxa.is_send_to_device_patched()
        assert [(b.owner, b.attribute) for b in report.bindings] == [(accelerate.hooks, "send_to_device")]
        assert report.bindings[0].original is original
        replacement = accelerate.hooks.send_to_device
        assert replacement is not original
        # The dataloader's, the re-export's and the recursion's binding stay accelerate's.
        assert accelerate.utils.operations.send_to_device is original
        assert accelerate.utils.send_to_device is original
        assert accelerate.data_loader.send_to_device is original
        assert pxa.patch_send_to_device(verify="deferred") is report
        # Same signature and semantics, positional and keyword.
        x = torch.randn(3, generator=gen)
        out = replacement({"a": (x,), "k": x}, "meta", False, ["k"])
        assert out["a"][0].device.type == "meta" and out["k"] is x
        assert replacement(x, "cpu", non_blocking=True) is x
    finally:
        pxa.unpatch_send_to_device()
    assert accelerate.hooks.send_to_device is original and not pxa.is_send_to_device_patched()


def test_patched_send_to_device_runs_a_dispatched_model_identically(gen):
    model = tiny_llama(gen)
    ids = input_ids(gen)
    with torch.no_grad():
        want = model(ids).logits
    dispatch(model, "cpu", force_hooks=True)
    with pxa.send_to_device_patched(include_cpu=True) as report:
        assert report.options == {"verify": "sync", "include_cpu": True, "route": None}
        with torch.no_grad():
            got = model(ids).logits
    assert torch.equal(got, want) and not pxa.is_send_to_device_patched()


def test_patch_send_to_device_rejects_bad_options(gen):
    op = "pyxfer.integrations.accelerate.patch_send_to_device"
    with pytest.raises(ValueError, match=f"{op}: verify must be one of"):
        pxa.patch_send_to_device(verify="later")
    with pytest.raises(ValueError, match=f"{op}: route must be one of"):
        pxa.patch_send_to_device(route="carrier-pigeon")
    for value in ("no", None, 0):  # a string where a bool is: TypeError, not truthiness
        with pytest.raises(TypeError, match=f"{op}: include_cpu must be a bool, got {type(value).__name__} {value!r}"):
            pxa.patch_send_to_device(include_cpu=value)
        with pytest.raises(TypeError, match="send_to_device_patched: include_cpu must be a bool, got"):
            pxa.send_to_device_patched(include_cpu=value)
    assert not pxa.is_send_to_device_patched()
    pxa.patch_send_to_device()
    try:
        with pytest.raises(TypeError, match=f"{op}: include_cpu must be a bool"):  # checked before "already patched"
            pxa.patch_send_to_device(include_cpu="no")
        # what accelerate's callers pass to the replacement is reported against it
        with pytest.raises(TypeError, match=r"hooks.send_to_device \(patched by pyxfer\): skip_keys must be"):
            accelerate.hooks.send_to_device({"a": torch.randn(2, generator=gen)}, "cpu", skip_keys=3)
    finally:
        pxa.unpatch_send_to_device()


def test_pyxfer_exports():
    assert pyxfer.integrations.IntegrationError is IntegrationError
    assert {"audit", "device_guard", "on_device_of"} <= set(pyxfer.__all__)


# ---- edges of the patch contract -----------------------------------------------------------------

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


# ---- a script's own module (__main__, also __mp_main__) ------------------------------------------

TARGET = '''
def scale(x):
    return 2 * x
'''

SCRIPT = '''
import functools
import json
import sys

before = "__mp_main__" in sys.modules
import torch  # noqa: E402,F401  (registers this module again as __mp_main__, through multiprocessing)

from pyxfer_main_target import scale  # noqa: E402  the patched function, imported by name
from pyxfer_main_target import scale as twice  # noqa: E402  and under a second name
from pyxfer.integrations._patch import Integration, holders  # noqa: E402


class Everywhere(Integration):
    """A real integration (real import and version check of a real distribution) that patches a
    function in its module and in every module that imported it by name, as the TE one does."""

    def __init__(self):
        super().__init__("main-module-test", module="pyxfer_main_target", distribution="torch", tested=("1.0", "99"))

    def bindings(self, target):
        original = target.scale
        replacement = functools.wraps(original)(lambda x: -original(x))
        yield target, "scale", replacement
        for owner, attribute in holders(original, exclude=target):
            yield owner, attribute, replacement


kept = [scale]  # in a list: a global named ``original`` would be one more binding to patch
p = Everywhere()
report = p.patch()
patched = (scale(3), twice(5), sys.modules["pyxfer_main_target"].scale(7))
p.unpatch()
print(json.dumps({
    "aliased_by_torch": not before and sys.modules["__mp_main__"] is sys.modules["__main__"],
    "where": [b.where for b in report.bindings],
    "patched": patched,
    "restored": scale is twice is kept[0] is sys.modules["pyxfer_main_target"].scale,
    "after": (scale(3), twice(5)),
}))
'''


def test_a_script_importing_the_target_by_name_is_patched_once(tmp_path):
    (tmp_path / "pyxfer_main_target.py").write_text(textwrap.dedent(TARGET))
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    # run from tmp_path: the script's folder is first on sys.path; pyxfer comes from the environment
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                       cwd=str(tmp_path), env={**os.environ})
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["aliased_by_torch"], "import torch no longer registers __main__ as __mp_main__: the test is vacuous"
    assert got["where"] == ["pyxfer_main_target.scale", "__main__.scale", "__main__.twice"]
    assert got["patched"] == [-6, -10, -14]
    assert got["restored"] and got["after"] == [6, 10]
