"""Processes that used pyxfer.all_gather on a gloo group exit normally (issue 39, item 1): gloo drops its
references to a collective's tensors on its worker thread just after the collective completed; a tensor
with a Python object then needs the GIL on that thread, and a process that keeps the GIL from there until
it finalizes aborts after Python finished ("terminate called without an active exception", SIGABRT).
tests/support/gather_exit_worker.py runs 12 2-rank groups, 4 at a time, in forked processes that exit
through normal finalization: fused calls, a None input and a dim 0 mismatch, and a last call after which
each rank keeps the GIL until it exits. pyxfer hands gloo only tensors that never had a Python object
(csrc/gather/gloo_bytes.cpp)."""
import json
import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support",
                      "gather_exit_worker.py")


def test_no_abort_at_exit_after_fused_gathers(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, WORKER, "--runs", "12",
                           "--parallel", "4", "--dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ended == {"ok": 24, "error": 0, "signals": {}}, (ended, proc.stderr[-3000:])
