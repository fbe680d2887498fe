"""The test tree's rules (CONTRIBUTING.md): tests live in tests/<subject>/ folders, shared helpers in the
tests/support package, and no test module imports another test module (a helper two modules need goes
to support/)."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _test_modules():
    return sorted(p for p in TESTS.rglob("test_*.py") if "support" not in p.relative_to(TESTS).parts)


def test_every_test_module_is_in_a_subject_folder():
    loose = [p.name for p in _test_modules() if p.parent == TESTS]
    assert not loose, f"test modules directly in tests/ (put them in tests/<subject>/): {loose}"


def test_no_test_module_imports_another():
    names = {p.stem for p in _test_modules()}
    offenders = []
    for path in _test_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for mod in mods:
                if any(part in names or part.startswith("test_") for part in mod.split(".")):
                    offenders.append(f"{path.relative_to(TESTS)} imports {mod}")
    assert not offenders, "test modules importing test modules (move the helper to tests/support/): " + \
        "; ".join(offenders)
