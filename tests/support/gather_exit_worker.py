"""Runs ``--runs`` 2-rank gloo groups of pyxfer.all_gather in processes forked from this one (torch and
pyxfer already imported), ``--parallel`` groups at a time, each process leaving through the
interpreter's normal exit, and prints one JSON object: how the processes ended.

Each rank of a run keeps a reference to its group until exit (as programs do with the groups they
make), makes 4 agreeing calls (the group goes fused: native calls), one where rank 1 passes None (a fused
call: rank 1 raises its TypeError at once, rank 0 gets a result marked invalid and raises the ValueError in
check_gathers) and one where it passes another dim 0 (a waiting call again: both raise in the call), one
agreeing call, and a last one, which
rank 0 makes with ``async_op=True`` and drops unwaited, calls destroy_process_group() and exits, holding
the GIL in its last exit step (the first atexit handler, registered before torch is imported: a C call
that keeps the GIL, as C extensions may, with forced thread switches off) while rank 1 posts its part
POST_DELAY_S after the call began. Gloo's worker thread drops its references to a collective's tensors
just after the collective completed: a posted tensor with a Python object then needs the GIL on that
thread, which it gets only in finalization, and the process aborts after Python finished ("terminate
called without an active exception", SIGABRT). pyxfer posts to gloo only buffers without Python objects
and waits (so rank 0's call returns once rank 1 posted, and nothing of it is left to gloo at exit).
Shards are fresh random (5, 3) tensors; every result is checked exactly.

    python gather_exit_worker.py --runs 12 --parallel 4 --dir TMPDIR
"""
import atexit
import ctypes
import sys

_hold_at_exit = []  # the seconds to hold the GIL at the last exit step


@atexit.register  # first registered, so the last to run: nothing after it releases the GIL before finalizing
def _hold_gil_at_exit():
    if _hold_at_exit:
        sys.setswitchinterval(60)  # a thread that waits for the GIL from now on does not force a switch
        ctypes.PyDLL(None).sleep(_hold_at_exit[0])  # a PyDLL call keeps the GIL


import argparse  # noqa: E402 (after the handler above, on purpose)
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pyxfer  # noqa: E402

GROUPS = []  # the groups the program still references at exit
HOLD_S = 4  # seconds rank 0 holds the GIL at exit
POST_DELAY_S = 1.5  # rank 1 posts the last call this long after rank 0 made it


def run_rank(rank, init, seed):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    GROUPS.append(dist.group.WORLD)
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(10, 3, generator=gen) for _ in range(7)]

    def agreeing(i, **kw):
        return pyxfer.all_gather(full[i][5 * rank:5 * rank + 5].clone(), **kw)

    for i in range(4):  # the group goes fused
        assert torch.equal(agreeing(i), full[i])
    # rank 1 passes None (it raises its own TypeError), then another dim 0: rank 0 raises a ValueError
    for other, text, own in ((None, "rejected its input", TypeError), (torch.zeros(6, 3), "dim 0", ValueError)):
        try:
            agreeing(4) if rank == 0 else pyxfer.all_gather(other)
            pyxfer.check_gathers()  # (rank 0's fused call returned a result marked invalid: its error comes here)
        except (TypeError, ValueError) as e:
            assert type(e) is (ValueError if rank == 0 else own) and (rank == 1 or text in str(e)), repr(e)
        else:
            raise AssertionError(f"rank {rank}: no error raised for a disagreeing call")
    assert torch.equal(agreeing(5), full[5])
    if rank == 0:
        handle = agreeing(6, async_op=True)
        del handle  # dropped unwaited
        dist.destroy_process_group()  # the group lives on (GROUPS)
        _hold_at_exit.append(HOLD_S)
    else:
        time.sleep(POST_DELAY_S)  # rank 0 holds the GIL at exit by now (with a pending collective, before the fix)
        assert torch.equal(agreeing(6), full[6])
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=12)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    ended = {"ok": 0, "error": 0, "signals": {}}
    for first in range(0, a.runs, a.parallel):
        pids = []
        for r in range(first, min(a.runs, first + a.parallel)):
            init = f"file://{os.path.join(a.dir, f'init{r}')}"
            seed = int.from_bytes(os.urandom(4), "little")
            for rank in (0, 1):
                pid = os.fork()
                if pid == 0:  # the child: run, then leave through the interpreter's normal exit
                    code = 0
                    try:
                        run_rank(rank, init, seed)
                    except BaseException as e:  # noqa: BLE001 (reported as an exit code)
                        print(f"run {r} rank {rank} (seed {seed}): {type(e).__name__}: {e}", file=sys.stderr)
                        code = 3
                    sys.exit(code)
                pids.append(pid)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                name = signal.Signals(os.WTERMSIG(status)).name
                ended["signals"][name] = ended["signals"].get(name, 0) + 1
            elif os.WEXITSTATUS(status):
                ended["error"] += 1
            else:
                ended["ok"] += 1
    print(json.dumps(ended))


if __name__ == "__main__":
    main()
