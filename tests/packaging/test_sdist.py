"""The sdist (``python -m build --sdist``, as CI makes it): made without torch (build isolation has
none; here a shadow ``torch`` that fails to import stands for that), it carries every native source
and header, the build's delegate, the docs, the tests, the scripts and the benchmarks (not their run
logs), with the metadata pip needs (Python and torch ranges, the extras); building the extension
without torch stops with what to do. CI also installs the sdist into a fresh venv (.ci/run)."""
import email
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("build", reason="the sdist test needs the `build` frontend (pip install build)")

SHADOW = 'raise ImportError("torch is hidden from this build (tests/packaging/test_sdist.py)")\n'


def built(rel: str) -> bool:
    """Whether ``rel`` is a build product, which no sdist carries (bytecode, objects, the extension)."""
    return "__pycache__" in rel.split("/") or rel.endswith((".pyc", ".so", ".o"))


def without_torch(tmp_path):
    """The environment of a child process in which ``import torch`` fails (as in an isolated build)."""
    (tmp_path / "shadow" / "torch").mkdir(parents=True)
    (tmp_path / "shadow" / "torch" / "__init__.py").write_text(SHADOW)
    path = [str(tmp_path / "shadow")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def files_under(*folders, exclude=()):
    """The checkout's files under ``folders`` (what the sdist is made from), relative to the root."""
    out = set()
    for folder in folders:
        for p in (ROOT / folder).rglob("*"):
            rel = p.relative_to(ROOT).as_posix()
            if p.is_file() and not built(rel) and not rel.startswith(exclude):
                out.add(rel)
    return out


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(file names relative to the sdist's root, PKG-INFO as a message) of a fresh sdist."""
    tmp = tmp_path_factory.mktemp("sdist")
    # --no-isolation: no index needed (GPU machines have none); the shadow torch keeps setup.py on the
    # torch-less path an isolated build takes
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp / "dist"),
                        str(ROOT)], capture_output=True, text=True, env=without_torch(tmp), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (archive,) = (tmp / "dist").glob("pyxfer-*.tar.gz")
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n and tar.getmember(n).isfile()}
        info = email.message_from_bytes(tar.extractfile(f"{top}/PKG-INFO").read())
    return names, info


def test_the_sdist_carries_sources_docs_tests_scripts_and_benchmarks(sdist):
    names, _ = sdist
    wanted = files_under("csrc", "docs", "tests", "scripts", "benchmarks", "pyxfer", exclude=("benchmarks/runs/",))
    wanted |= {"setup.py", "pyproject.toml", "MANIFEST.in", "CMakeLists.txt", "README.md"}
    assert not wanted - names, sorted(wanted - names)
    assert any(n.endswith(".cu") for n in names) and any(n.startswith("csrc/include/pyxfer/") for n in names)
    assert not [n for n in names if n.startswith("benchmarks/runs/") or built(n)]


def test_the_sdist_metadata(sdist):
    _, info = sdist
    assert info["Name"] == "pyxfer" and info["Requires-Python"] == ">=3.10"
    requires = info.get_all("Requires-Dist")
    torch_range = [r for r in requires if r.startswith("torch")]
    assert len(torch_range) == 1 and set(torch_range[0][len("torch"):].split(",")) == {">=2.11", "<2.15"}
    assert set(info.get_all("Provides-Extra")) == {"test", "plot", "nvml"}
    assert 'matplotlib>=3.5; extra == "plot"' in requires and 'nvidia-ml-py; extra == "nvml"' in requires


def test_building_the_extension_without_torch_says_what_to_do(tmp_path):
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "temp")], cwd=ROOT, capture_output=True, text=True,
                       env=without_torch(tmp_path), timeout=300)
    assert r.returncode != 0
    assert "pyxfer: building the native extension needs torch, which is not importable here" in r.stderr
    assert "pip install --no-build-isolation" in r.stderr
