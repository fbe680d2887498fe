"""Every script in benchmarks/ starts on a CPU machine: its imports resolve and its options parse
(`--help`). Benchmarks run only on the GPU machines, so an import broken by a move (host_legs.py
imported pyxfer._timing after it became pyxfer.tools.timing) would otherwise surface there, in
device time. In this process (torch is imported once): each script runs as __main__ until argparse
exits on --help."""
import contextlib
import io
import pathlib
import runpy
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_starts(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: its folder first
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    assert exited.value.code in (0, None), out.getvalue()[-2000:]
    assert "usage:" in out.getvalue(), out.getvalue()[-2000:]
