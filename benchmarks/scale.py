"""Scale run (issue 6), one call: quantized all-gather at world sizes 2, 4, 8 and verified copies over
every ordered GPU pair, sequentially and all at once; then `pyxfer doctor`.

G = the visible GPUs. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set).
1. all-gather: benchmarks/gather.py's measurement (every case, same timing and checks, NCCL, one
   process per GPU, 8192x8192 bf16 per rank) at each world size of 2, 4, 8 that is <= G; its tables,
   then one line per world size: bf16 time and busbw, the quantized speed-ups, the worst fallback and
   verify ratios, and whether every result was bit-identical to quantizing the full tensor.
2. pair matrix: for each of the G(G-1) ordered pairs, 256 MiB of random int64 (its own source per
   pair): raw ``dst.copy_(src)`` vs ``pyxfer.verified_copy(src, dst, verify="sync")``, timed as
   benchmarks/transfer.py times them (wall clock around a batch of calls plus a synchronize of both
   GPUs, median of 10 after warm-up; GB/s = tensor bytes / time); results checked bit-exact after.
3. all pairs at once: every ordered pair copies its 256 MiB at the same time, each pair on its own
   stream on its source and on its destination, launched from one thread: raw ``copy_`` vs
   ``verified_copy(verify="deferred")`` (a "sync" verification waits on the host inside each call,
   which would serialize the pairs; deferred compares the hashes on the device and
   ``pyxfer.check_transfers()`` raises a mismatch afterwards). Wall clock from a synchronize of every
   GPU to a synchronize of every GPU, median of 10; aggregate GB/s = bytes of all pairs / time.
   Target: verified >= 90% of raw. Then one more round of both with the raw destinations prefilled
   with a sentinel, ``check_transfers()``, and every destination compared bitwise with its own source
   staged through the host (no pair got another pair's data, nothing left unwritten).
4. ``python -m pyxfer doctor --json`` in a child process: wall time (goal: under 2 minutes for 56
   pairs), verdicts, the JSON. ``pyxfer bench`` is run the same way if the CLI has it (it does not yet:
   reported as not run).
The JSON (--json) records the machine and versions, every table and the targets.

    python benchmarks/scale.py [--world-sizes 2,4,8] [--pair-mib 256] [--json out.json]
    python benchmarks/scale.py --cpu-smoke      # no GPU: the gather on gloo (2 ranks, tiny), doctor
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before anything starts NCCL

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gather  # noqa: E402
import transfer  # noqa: E402

import pyxfer  # noqa: E402
from pyxfer.tools.machine import machine_info  # noqa: E402
from pyxfer.tools.timing import fmt_gbps  # noqa: E402

from common import print_table, print_targets, write_json  # noqa: E402

MiB = 1 << 20
CONCURRENT_TARGET = 0.90
PAIR_TARGET = 0.95      # verified sync / raw at >= 256 MiB (the verified-transfer target, for reference)
DOCTOR_TARGET_S = 120
SENTINEL = -0x0101010101010102  # bytes 0xfe..: what an unwritten destination would still hold


# ---- 1. all-gather at each world size -----------------------------------------------------------
def gather_runs(world_sizes, args):
    runs = []
    for w in world_sizes:
        print(f"--- all-gather, world size {w}")
        if args.cpu_smoke:
            res = gather.run(w, "gloo", "cpu", rows=256, cols=256, reps=3, warmup=1)
        else:
            res = gather.run(w, "nccl", "cuda", rows=args.rows, cols=args.cols, reps=args.reps, warmup=5)
        gather.show(res)
        runs.append(res)
    return runs


def gather_summary(runs):
    rows, out = [], []
    for res in runs:
        by = {r["case"]: r for r in res["rows"]}
        w = res["config"]["world_size"]
        fallback = max(1 / r["speedup"] for r in res["rows"] if r["kind"] == "fallback")
        verify = max(r["verify_overhead"] for r in res["rows"] if r["kind"] == "verify")
        identical = all(r.get("identical", True) for r in res["rows"])
        line = {"world_size": w, "bf16_ms": by["torch bf16"]["ms"], "bf16_busbw_gbps": by["torch bf16"]["busbw_gbps"],
                **{f"{fmt}_speedup": by[f"quantized {fmt} rowwise"]["speedup"] for fmt in gather.SPEEDUP_TARGETS},
                "worst_fallback_ratio": fallback, "worst_verify_overhead": verify, "identical": identical}
        out.append(line)
        rows.append([w, f"{line['bf16_ms']:.3f}", fmt_gbps(line["bf16_busbw_gbps"]),
                     *(f"{line[f'{fmt}_speedup']:.2f}x" for fmt in gather.SPEEDUP_TARGETS),
                     f"{fallback:.2f}x", f"{verify:+.1%}", "yes" if identical else "NO"])
    print_table("all-gather by world size (8192x8192 per rank unless --rows/--cols; quantized rowwise speed-up = "
                "bf16 time / quantized time; targets 1.6x, 1.6x, 2.5x; fallback <= 1.25x; verify <= +15%)",
                ["W", "bf16 ms", "bf16 busbw", *(f"{f} x" for f in gather.SPEEDUP_TARGETS), "worst fallback",
                 "worst verify", "bit-identical"], rows)
    return out


# ---- 2. pair matrix -----------------------------------------------------------------------------
def ordered_pairs(num_gpus):
    return [(i, j) for i in range(num_gpus) for j in range(num_gpus) if i != j]


def pair_matrix(num_gpus, size):
    rows = []
    for i, j in ordered_pairs(num_gpus):
        pair = transfer.Pair(f"cuda:{i}", f"cuda:{j}")
        src = transfer.random_int64(size, pair.src)
        dst = torch.empty_like(src, device=pair.dst)
        raw_ms = transfer.wall_ms(lambda p: p[1].copy_(p[0]), [(src, dst)], pair)
        sync_ms = transfer.wall_ms(transfer.verified(pair, "sync"), [src], pair)
        transfer.check(dst, src, f"{pair.name} raw copy_")  # outside the timed regions
        transfer.check(transfer.verified(pair, "sync")(src), src, f"{pair.name} verified (sync)")
        rows.append({"src": i, "dst": j, "bytes": size, "raw_ms": raw_ms, "verified_ms": sync_ms,
                     "raw_gbps": size / raw_ms / 1e6, "verified_gbps": size / sync_ms / 1e6})
        del src, dst
    torch.cuda.empty_cache()
    return rows


def show_matrix(num_gpus, rows, title, fmt):
    cell = {(r["src"], r["dst"]): r for r in rows}
    print_table(title, ["src \\ dst", *range(num_gpus)],
                [[i, *("-" if i == j else fmt(cell[i, j]) for j in range(num_gpus))] for i in range(num_gpus)])


# ---- 3. all pairs at once -----------------------------------------------------------------------
class Concurrent:
    """Every ordered pair with its own source, raw destination and a stream on each end."""

    def __init__(self, num_gpus, size):
        self.num_gpus, self.size = num_gpus, size
        self.pairs = []
        for i, j in ordered_pairs(num_gpus):
            src = transfer.random_int64(size, torch.device("cuda", i))
            self.pairs.append({"src": i, "dst": j, "x": src, "out": torch.empty_like(src, device=f"cuda:{j}"),
                               "s_src": torch.cuda.Stream(i), "s_dst": torch.cuda.Stream(j)})
        self.sync()

    def sync(self):
        for d in range(self.num_gpus):
            torch.cuda.synchronize(d)

    def launch(self, verified):
        """Start every pair's copy on its streams; returns the destinations (verified: new tensors)."""
        outs = []
        for p in self.pairs:
            with torch.cuda.stream(p["s_src"]), torch.cuda.stream(p["s_dst"]):
                if verified:
                    outs.append(pyxfer.verified_copy(p["x"], p["dst"], route="auto", verify="deferred"))
                else:
                    outs.append(p["out"].copy_(p["x"]))
        return outs

    def time_ms(self, verified, warmup=2, reps=10):
        times = []
        for k in range(warmup + reps):
            self.sync()
            t0 = time.perf_counter()
            outs = self.launch(verified)
            self.sync()
            if k >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            del outs
        pyxfer.check_transfers()
        return statistics.median(times)

    def check(self):
        """One more round of both, raw destinations prefilled with a sentinel; every destination vs its
        own source staged through the host. Returns the pairs that differ."""
        for p in self.pairs:
            p["out"].fill_(SENTINEL)
        self.sync()
        raw = self.launch(verified=False)
        ver = self.launch(verified=True)
        self.sync()
        pyxfer.check_transfers()
        bad = []
        for p, r, v in zip(self.pairs, raw, ver):
            want = p["x"].cpu().to(r.device)
            for what, got in (("raw", r), ("verified", v)):
                if not torch.equal(got, want):
                    bad.append(f"{what} cuda:{p['src']}->cuda:{p['dst']}")
        return bad


def concurrent(num_gpus, size):
    c = Concurrent(num_gpus, size)
    total = size * len(c.pairs)
    raw_ms, ver_ms = c.time_ms(False), c.time_ms(True)
    bad = c.check()
    del c
    torch.cuda.empty_cache()
    return {"pairs": num_gpus * (num_gpus - 1), "bytes_per_pair": size, "bytes_total": total, "raw_ms": raw_ms,
            "verified_ms": ver_ms, "raw_gbps": total / raw_ms / 1e6, "verified_gbps": total / ver_ms / 1e6,
            "ratio": raw_ms / ver_ms, "mismatched": bad}


# ---- 4. CLI -------------------------------------------------------------------------------------
def cli_run(*argv):
    """`python -m pyxfer ARGV` in a child process: (wall seconds, exit code, stdout, stderr)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pyxfer", *argv], capture_output=True, text=True)
    return time.perf_counter() - t0, p.returncode, p.stdout, p.stderr


def doctor_and_bench():
    out = {}
    wall, rc, stdout, stderr = cli_run("doctor", "--json")
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        doc = None
    checks = doc["checks"] if doc else []
    failed = [c["check"] for c in checks if c["status"] == "FAIL"]
    out["doctor"] = {"wall_s": wall, "rc": rc, "checks": len(checks), "failed": failed, "json": doc,
                     "stderr_tail": stderr[-2000:]}
    print(f"pyxfer doctor --json: {wall:.1f} s wall (goal < {DOCTOR_TARGET_S} s), exit code {rc}, "
          f"{len(checks)} checks, " + (f"FAILED: {', '.join(failed)}" if failed else "none failed") +
          ("" if doc else " (no JSON on stdout)"))
    _, _, help_text, _ = cli_run("--help")
    if "bench" not in help_text:
        out["bench"] = {"ran": False,
                        "why": "`pyxfer bench` does not exist in this build (the CLI has no bench command)"}
        print(f"pyxfer bench: not run: {out['bench']['why']}")
    else:
        wall, rc, stdout, stderr = cli_run("bench", "--json")
        try:
            doc = json.loads(stdout)
        except json.JSONDecodeError:
            doc = None
        out["bench"] = {"ran": True, "wall_s": wall, "rc": rc, "json": doc,
                        "stdout_tail": None if doc else stdout[-4000:], "stderr_tail": stderr[-2000:]}
        print(f"pyxfer bench --json: {wall:.1f} s wall, exit code {rc}" + ("" if doc else " (no JSON on stdout)"))
    print()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4,8",
                   help="all-gather world sizes (those above the GPU count are skipped)")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--reps", type=int, default=30, help="all-gather reps per case")
    p.add_argument("--pair-mib", type=float, default=256.0, help="bytes per pair copy, MiB")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: gloo gather at world size 2 (tiny) and doctor")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    num_gpus = torch.cuda.device_count()
    started = time.perf_counter()
    result = {"env": machine_info(), "method": __doc__.split("\n\n    python")[0], "num_gpus": num_gpus,
              "args": vars(args)}
    print(f"{num_gpus} GPU(s): {', '.join(g['name'] for g in result['env']['gpus']) or '-'}; torch "
          f"{torch.__version__}, NCCL {result['env']['nccl']}, driver {result['env']['driver']}; "
          f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}\n")
    wanted = sorted({int(w) for w in args.world_sizes.split(",")})
    world_sizes = [2] if args.cpu_smoke else [w for w in wanted if w <= num_gpus]
    result["skipped_world_sizes"] = [w for w in wanted if w not in world_sizes]
    if result["skipped_world_sizes"]:
        print(f"all-gather world sizes {result['skipped_world_sizes']} skipped: {num_gpus} GPU(s) visible\n")
    targets = []

    def add(name, ok, measured):
        targets.append({"target": name, "measured": measured, "result": "PASS" if ok else "MISS"})

    runs = gather_runs(world_sizes, args) if world_sizes else []
    result["gather"] = runs
    if runs:
        result["gather_summary"] = gather_summary(runs)
        for res in runs:
            for t in res["targets"]:
                targets.append({**t, "target": f"W={res['config']['world_size']}: {t['target']}"})

    if num_gpus >= 2:
        size = int(args.pair_mib * MiB) // 8 * 8
        rows = pair_matrix(num_gpus, size)
        result["pairs"] = rows
        show_matrix(num_gpus, rows, f"raw dst.copy_(src) GB/s, {args.pair_mib:g} MiB, one pair at a time "
                    "(wall clock, median)", lambda r: fmt_gbps(r["raw_gbps"]))
        show_matrix(num_gpus, rows, "pyxfer.verified_copy(verify=\"sync\") GB/s, same pairs",
                    lambda r: fmt_gbps(r["verified_gbps"]))
        show_matrix(num_gpus, rows, "verified / raw", lambda r: f"{r['verified_gbps'] / r['raw_gbps']:.3f}")
        worst = min(rows, key=lambda r: r["verified_gbps"] / r["raw_gbps"])
        ratio = worst["verified_gbps"] / worst["raw_gbps"]
        add(f"every pair: verified(sync)/raw >= {PAIR_TARGET:.0%} at {args.pair_mib:g} MiB (worst pair)",
            ratio >= PAIR_TARGET, f"{ratio:.1%} (cuda:{worst['src']}->cuda:{worst['dst']})")

        conc = concurrent(num_gpus, size)
        result["concurrent"] = conc
        print_table(f"all {conc['pairs']} ordered pairs at once, {args.pair_mib:g} MiB each, own streams per pair "
                    "(wall clock from sync to sync, median of 10; GB/s = bytes of all pairs / time)",
                    ["", "ms", "aggregate GB/s", "per pair GB/s"],
                    [["raw copy_", f"{conc['raw_ms']:.2f}", fmt_gbps(conc["raw_gbps"]),
                      fmt_gbps(conc["raw_gbps"] / conc["pairs"])],
                     ["verified (deferred)", f"{conc['verified_ms']:.2f}", fmt_gbps(conc["verified_gbps"]),
                      fmt_gbps(conc["verified_gbps"] / conc["pairs"])]])
        print(f"verified / raw: {conc['ratio']:.1%}; destinations checked bitwise against their own sources: "
              + ("all equal" if not conc["mismatched"] else "MISMATCHED: " + ", ".join(conc["mismatched"])) + "\n")
        add(f"all pairs at once: verified >= {CONCURRENT_TARGET:.0%} of raw throughput",
            conc["ratio"] >= CONCURRENT_TARGET, f"{conc['ratio']:.1%}")
        add("all pairs at once: every destination bit-identical to its own source", not conc["mismatched"],
            "all" if not conc["mismatched"] else f"{len(conc['mismatched'])} differ")
    else:
        print(f"pair matrix and concurrent copies: skipped ({num_gpus} GPU(s) visible, need 2)\n")

    result.update(doctor_and_bench())
    doc = result["doctor"]
    add(f"pyxfer doctor under {DOCTOR_TARGET_S} s ({num_gpus * (num_gpus - 1)} ordered pairs), all checks ok",
        doc["wall_s"] < DOCTOR_TARGET_S and doc["rc"] == 0 and not doc["failed"],
        f"{doc['wall_s']:.1f} s, " + ("ok" if not doc["failed"] and doc["rc"] == 0 else f"rc {doc['rc']}, failed: "
                                      f"{', '.join(doc['failed']) or '-'}"))
    result["targets"] = targets
    result["wall_s"] = time.perf_counter() - started
    print(f"targets (measured in this run; {result['wall_s']:.0f} s in all)")
    print_targets(targets + [{"target": what, "measured": "-", "result": "NOT RUN"}
                             for what in not_run(result, num_gpus)])
    write_json(args.json, result)


def not_run(result, num_gpus):
    """What the issue asks for that this machine could not run."""
    out = [f"all-gather at world size {w} ({num_gpus} GPUs visible)" for w in result["skipped_world_sizes"]]
    if num_gpus < 8:
        out.append(f"pair matrix / concurrent copies over 56 ordered pairs (only {num_gpus * (num_gpus - 1)} here)")
    if not result["bench"]["ran"]:
        out.append("pyxfer bench (does not exist yet)")
    return out


if __name__ == "__main__":
    main()
