"""pyxfer.integrations.transformer_engine against real Transformer Engine (no mocks, no GPU).

TE needs its own venv (CUDA build of torch, TE's core wheels, the transformer_engine_torch
extension built from its sdist): ``bash scripts/te_env.sh`` makes ``.venv-te``, then
``.venv-te/bin/pytest -q tests/integrations/test_transformer_engine.py``. Without TE every test here but the
"TE missing" one is skipped with the reason.

- gloo groups of 2 and 3 processes (tests/support/te_worker.py; each group spawned once, running every
  case): the format x usages x quantizable or not x input kind x sync / async matrix through the
  binding TE's Linear module uses, bit-identical to pyxfer.quantize of the full tensor on every
  rank; NVFP4 amax (shards with their own amax, an amax-reduction group wider than the gather
  group); output_tensor filled in place; verify=True; options pyxfer lacks handed to TE; and for
  each defect the patch fixes, unpatched TE on the same input showing it.
- In this process: the patch contract on TE's real modules (every binding, identity on unpatch,
  double patch, a raising context, a module imported after patch()), and TE missing.
- In a script run as __main__ (also registered as __mp_main__ by torch's import of multiprocessing)
  that imported gather_along_first_dim by name: patched once, restored by unpatch.
"""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pyxfer  # noqa: F401  (torch and pyxfer before TE: TE's core library needs torch's NCCL)
from pyxfer.integrations import IntegrationError
from pyxfer.integrations import transformer_engine as pyxfer_te

from support import te_shims as shims
from support.gather_harness import spawn_cases

SUPPORT = os.path.dirname(os.path.abspath(shims.__file__))  # tests/support: the TE worker's folder

TE_OK, TE_WHY = shims.te_available()
needs_te = pytest.mark.skipif(
    not TE_OK, reason=f"Transformer Engine is not importable here ({TE_WHY}); bash scripts/te_env.sh makes "
                      f".venv-te with it, then .venv-te/bin/pytest tests/integrations/test_transformer_engine.py")
WORLD_SIZES = (2, 3)
SPAWN_TIMEOUT_S = 420


def _case_names(world):
    if not TE_OK:
        return ["(TE not installed)"]
    from support import te_worker
    return te_worker.case_names(world)


def run_group(world, seed=None):
    """Spawn ``world`` TE workers; returns (seed, {case: [None or error text per rank]})."""
    if seed is None:
        seed = int(os.environ.get("PYXFER_TE_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, spawn_cases(os.path.join(SUPPORT, "te_worker.py"), world, _case_names(world), seed, SPAWN_TIMEOUT_S)


_groups = {}


@needs_te
@pytest.mark.parametrize("world,case", [(w, c) for w in WORLD_SIZES for c in _case_names(w)])
def test_te_gather_case(world, case):
    if world not in _groups:
        _groups[world] = run_group(world)
    seed, results = _groups[world]
    errors = results.get(case)
    assert errors is not None, f"case {case} did not run (seed {seed})"
    failed = [(r, e) for r, e in enumerate(errors) if e]
    assert not failed, f"seed {seed} (PYXFER_TE_SEED replays it): " + \
        "\n".join(f"--- rank {r}:\n{e}" for r, e in failed)


# ---- the patch contract on TE's real modules (this process) ---------------------------------------

@pytest.fixture
def ted():
    import transformer_engine.pytorch.distributed as ted
    pyxfer_te.unpatch()
    yield ted
    pyxfer_te.unpatch()


def _originals(ted):
    names = ("_start_all_gather_fp8_blockwise", "_all_gather_mxfp8", "_all_gather_nvfp4", "gather_along_first_dim")
    return {name: ted.__dict__[name] for name in names}


@needs_te
def test_patch_reports_every_binding_and_unpatch_restores_identical_objects(ted):
    originals = _originals(ted)
    report = pyxfer_te.patch()
    assert pyxfer_te.is_patched() and pyxfer_te.report() is report
    where = {b.where for b in report.bindings}
    for name in originals:
        assert f"transformer_engine.pytorch.distributed.{name}" in where
    for module in pyxfer_te._IMPORTERS:  # the 9 modules that import gather_along_first_dim by name
        assert f"{module}.gather_along_first_dim" in where, module
        assert importlib.import_module(module).gather_along_first_dim is not originals["gather_along_first_dim"]
    for b in report.bindings:
        assert getattr(b.owner, b.attribute) is b.replacement
        assert b.replacement.__pyxfer_original__ is b.original is originals[
            "gather_along_first_dim" if b.attribute not in originals else b.attribute]
    assert "binding" in str(report) and "2.20" in report.target_version
    pyxfer_te.unpatch()
    assert not pyxfer_te.is_patched()
    for b in report.bindings:
        assert getattr(b.owner, b.attribute) is b.original
    assert _originals(ted) == originals


@needs_te
def test_double_patch_is_a_no_op_and_other_options_are_refused(ted):
    first = pyxfer_te.patch()
    replaced = ted.gather_along_first_dim
    assert pyxfer_te.patch() is first and ted.gather_along_first_dim is replaced
    with pytest.raises(ValueError, match="already patched"):
        pyxfer_te.patch(verify=True)
    pyxfer_te.unpatch()
    with pytest.raises(TypeError, match="verify must be a bool"):
        pyxfer_te.patch(verify="yes")
    assert not pyxfer_te.is_patched() and ted.gather_along_first_dim is not replaced


@needs_te
def test_patched_context_unpatches_when_the_body_raises(ted):
    originals = _originals(ted)
    with pytest.raises(KeyError):
        with pyxfer_te.patched(verify=True) as report:
            assert pyxfer_te.is_patched() and report.options == {"verify": True}
            assert ted.gather_along_first_dim is not originals["gather_along_first_dim"]
            raise KeyError("inside")
    assert not pyxfer_te.is_patched() and _originals(ted) == originals


@needs_te
def test_modules_bound_before_and_after_patch(ted, tmp_path, monkeypatch):
    original = ted.gather_along_first_dim
    (tmp_path / "pyxfer_te_early.py").write_text(textwrap.dedent("""
        from transformer_engine.pytorch.distributed import gather_along_first_dim as gather_tp  # Megatron-style
    """))
    (tmp_path / "pyxfer_te_late.py").write_text(textwrap.dedent("""
        from transformer_engine.pytorch.distributed import gather_along_first_dim
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    early = importlib.import_module("pyxfer_te_early")
    try:
        report = pyxfer_te.patch()
        assert any(b.owner is early and b.attribute == "gather_tp" for b in report.bindings)
        assert early.gather_tp is ted.gather_along_first_dim is not original
        late = importlib.import_module("pyxfer_te_late")
        assert late.gather_along_first_dim is ted.gather_along_first_dim  # it bound pyxfer's replacement
        assert [(o, a) for o, a, _ in pyxfer_te.late_bindings()] == [(late, "gather_along_first_dim")]
        with pytest.warns(RuntimeWarning, match="pyxfer_te_late.gather_along_first_dim"):
            pyxfer_te.unpatch()
        assert late.gather_along_first_dim is original and early.gather_tp is original
        assert pyxfer_te.late_bindings() == []
    finally:
        sys.modules.pop("pyxfer_te_early", None)
        sys.modules.pop("pyxfer_te_late", None)


@needs_te
def test_arguments_te_does_not_take_get_te_own_type_error(ted):
    """A call gather_along_first_dim cannot bind goes to TE's function as it is: its own TypeError."""
    original = ted.gather_along_first_dim
    x = torch.ones(4, 3)
    calls = [((x,), {}), ((x, None), {"group_size": 2}), ((x, None, False, None, None, False, "extra"), {}),
             ((x, None), {"inp": x})]
    want = []
    for args, kwargs in calls:
        with pytest.raises(TypeError) as e:
            original(*args, **kwargs)
        want.append(str(e.value))
    assert want[0] == "gather_along_first_dim() missing 1 required positional argument: 'process_group'"
    pyxfer_te.patch()
    for (args, kwargs), message in zip(calls, want):
        with pytest.raises(TypeError) as e:
            ted.gather_along_first_dim(*args, **kwargs)
        assert str(e.value) == message


def _python(*args):
    """``python *args`` (``-c code`` or a script) in a fresh interpreter importing the same pyxfer as
    this one: run from tests/support, not the source tree (whose pyxfer/ may lack a build for this torch),
    with PYTHONPATH made absolute."""
    path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False,
                          cwd=SUPPORT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})


@needs_te
def test_a_script_that_imported_gather_along_first_dim_by_name_is_patched(tmp_path):
    """Issue 39 item 9: the script is __main__ and, once torch imported multiprocessing, also
    __mp_main__ (one module under two names): its binding is patched once, not refused."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import torch
        import pyxfer
        from transformer_engine.pytorch.distributed import gather_along_first_dim
        import transformer_engine.pytorch.distributed as ted
        from pyxfer.integrations import transformer_engine as pyxfer_te

        kept = [gather_along_first_dim]  # not a global: that would be one more binding to patch
        report = pyxfer_te.patch()
        mine = [b.where for b in report.bindings if b.owner is sys.modules["__main__"]]
        patched = gather_along_first_dim is ted.gather_along_first_dim is not kept[0]
        pyxfer_te.unpatch()
        print(json.dumps({"two_names": sys.modules["__mp_main__"] is sys.modules["__main__"], "mine": mine,
                          "patched": patched, "restored": gather_along_first_dim is kept[0]}))
    """))
    out = _python(str(script))
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"two_names": True, "mine": ["__main__.gather_along_first_dim"], "patched": True, "restored": True}


def test_te_missing_is_a_clear_error():
    """Without TE (this venv, or TE's import blocked in a fresh interpreter): IntegrationError."""
    if not TE_OK:
        with pytest.raises(IntegrationError, match="transformer") as e:
            pyxfer_te.patch()
        assert isinstance(e.value, ImportError) and not pyxfer_te.is_patched()
        return
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "transformer_engine":
                    raise ImportError("blocked for the test: " + name)
        sys.meta_path.insert(0, Block())
        from pyxfer.integrations import IntegrationError
        from pyxfer.integrations import transformer_engine as t
        try:
            t.patch()
        except IntegrationError as e:
            print("IntegrationError:", e)
    """)
    out = _python("-c", code)
    assert "IntegrationError: pyxfer.integrations.transformer_engine: importing transformer_engine.pytorch" \
        in out.stdout, out.stdout + out.stderr


def test_importing_the_integration_imports_no_te():
    code = ("import sys, pyxfer.integrations.transformer_engine; "
            "print(any(m.startswith('transformer_engine') for m in sys.modules))")
    out = _python("-c", code)
    assert out.stdout.strip() == "False", out.stdout + out.stderr

