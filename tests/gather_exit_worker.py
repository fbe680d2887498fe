"""Runs ``--runs`` 2-rank gloo groups of pyxfer.all_gather in forked processes that exit through
normal interpreter finalization, and prints one JSON object: how each process ended. Each run: 4
matching calls (the group goes fused), one call where rank 1 passes another dim 0 (``shape``) or
None (``none``), expected to raise the documented error on every rank (rank 0, which called as the
group predicted, from pyxfer.check_gathers), one good call,
destroy_process_group(), normal exit. An object of the failed call that outlives the process group
(e.g. a gloo Work kept alive by a stored exception's traceback) aborts the process at exit.

    python gather_exit_worker.py --variant shape|none --runs 25 --dir TMPDIR [--parallel 5]
"""
import argparse
import datetime
import json
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

import pyxfer


def run_rank(variant, rank, init):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    x = torch.ones(4, 3)
    for _ in range(4):
        assert torch.equal(pyxfer.all_gather(x), torch.ones(8, 3))
    odd = torch.ones(5, 3) if variant == "shape" else None
    try:
        pyxfer.all_gather(odd if rank == 1 else x)
        pyxfer.check_gathers()  # (a fused call: the ranks that called as predicted raise here)
    except (ValueError, TypeError) as e:
        if rank == 0 or variant == "shape":
            assert "dim 0" in str(e) if variant == "shape" else "rejected its input" in str(e), e
    else:
        raise AssertionError("no error raised")
    assert torch.equal(pyxfer.all_gather(x), torch.ones(8, 3))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=("shape", "none"), required=True)
    p.add_argument("--runs", type=int, default=25)
    p.add_argument("--parallel", type=int, default=5)
    p.add_argument("--dir", required=True)
    p.add_argument("--spawn", action="store_true", help="fresh interpreters instead of forks")
    p.add_argument("--child", nargs=2, metavar=("RANK", "INIT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        run_rank(a.variant, int(a.child[0]), a.child[1])
        return
    torch.set_num_threads(1)
    ended = {"ok": 0, "error": 0, "signals": {}}
    run = 0
    while run < a.runs:
        pids = []
        for r in range(run, min(a.runs, run + a.parallel)):
            init = f"file://{os.path.join(a.dir, f'init{r}')}"
            for rank in (0, 1):
                if a.spawn:
                    pids.append(subprocess.Popen([sys.executable, __file__, "--variant", a.variant, "--dir", a.dir,
                                                  "--child", str(rank), init]))
                    continue
                pid = os.fork()
                if pid == 0:  # the child: run, then leave through the interpreter's normal exit
                    code = 0
                    try:
                        run_rank(a.variant, rank, init)
                    except BaseException as e:  # noqa: BLE001 (reported as an exit code)
                        print(f"run {r} rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
                        code = 3
                    sys.exit(code)
                pids.append(pid)
        for pid in pids:
            if a.spawn:
                code = pid.wait()
                status = (-code & 0x7f) if code < 0 else (code << 8)
            else:
                _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                name = signal.Signals(os.WTERMSIG(status)).name
                ended["signals"][name] = ended["signals"].get(name, 0) + 1
            elif os.WEXITSTATUS(status):
                ended["error"] += 1
            else:
                ended["ok"] += 1
        run += a.parallel
    print(json.dumps(ended))


if __name__ == "__main__":
    main()
