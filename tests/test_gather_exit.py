"""Processes that used pyxfer.all_gather exit normally after a disagreement in fused mode (issue 20,
defect 5: objects of the failed call kept alive by its error outlived the process group and gloo
aborted the process at exit, "terminate called without an active exception", in 3-6 of 25 runs).
25 runs of 2-rank gloo groups per variant (rank 1 passes another dim 0, or None), in processes
forked from one interpreter (tests/gather_exit_worker.py) that exit through normal finalization."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("variant", ["shape", "none"])
def test_no_abort_at_exit_after_a_fused_mismatch(variant, tmp_path):
    path = [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "gather_exit_worker.py"), "--variant", variant,
                           "--runs", "25", "--parallel", "25", "--dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ended == {"ok": 50, "error": 0, "signals": {}}, (ended, proc.stderr[-3000:])
