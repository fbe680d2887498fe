"""Processes that used pyxfer.all_gather on a gloo group exit normally (issue 39, item 1): gloo frees
the tensors of a collective on its worker thread once the collective completed; a posted tensor whose
Python object had been dropped then needs the GIL there, and when the thread gets it only as the
interpreter finalizes (the group still referenced at exit), the process aborts after Python finished
("terminate called without an active exception"). tests/support/gather_exit_worker.py runs 12 2-rank groups,
4 at a time, in forked processes that exit through normal finalization: fused (native) calls, a None
input in a fused call (the deferred error), a dim 0 mismatch in a waiting call, destroy_process_group(),
and a last record exchange (the Python post of every waiting call on gloo) that one rank drops unwaited
while it holds the GIL (every such run aborted without the guarantee: 12 of 12)."""
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
