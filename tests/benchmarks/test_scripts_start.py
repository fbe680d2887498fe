"""Every script in benchmarks/ starts on a CPU machine: its imports resolve and its options parse
(`--help`). Benchmarks run only on the GPU machines, so an import broken by a move (host_legs.py
imported pyxfer._timing after it became pyxfer.tools.timing) would otherwise surface there, in
device time."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_starts(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout, proc.stdout[-2000:]
