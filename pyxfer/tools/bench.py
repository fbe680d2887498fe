"""`pyxfer bench`: bandwidth and latency of every ordered device pair and copy mode.

Rows (SRC -> DST): host -> every GPU and back, from pinned and from pageable host memory; every GPU
to itself (GPU-local); every ordered GPU pair. Without a GPU: cpu -> cpu (host memcpy, CPU verified
and staged copies). Plus PXH64 checksum throughput on every device.

Modes:
  ce                 torch's copy_ of contiguous bytes: the driver's copy engine (cudaMemcpyAsync)
  ce_bidir           ce in both directions at once, each direction issued from its own GPU on streams of its
                     own on both GPUs, nothing ordering one direction after the other (nvbandwidth's
                     bidirectional tests); GB/s is the total of both directions (nvbandwidth's "Total")
  sm_pull            pyxfer's copy kernel (torch.ops.pyxfer.sm_copy: 16-byte loads and stores, one
                     wave of blocks) on the destination GPU, reading the source's memory; GPU pairs
                     with peer access (the way pyxfer's verified peer copies move data)
  sm_push            the same kernel on the source GPU, writing into the destination's memory; GPU
                     pairs with peer access and GPU-local rows (where pull and push are one thing)
  staged             pyxfer.staged_copy (through the pinned host pool)
  verified           pyxfer.verified_copy(verify="sync"): hashes on both ends, compared on the host
  verified_deferred  pyxfer.verified_copy(verify="deferred"): compared on the device, no host wait

Method (pyxfer.tools.timing, shared with benchmarks/; nvbandwidth's): CUDA events on the stream torch
issues the copy on (the source GPU's; the GPU's for host rows), --warmup untimed repetitions, then
--reps samples, each timing a loop of calls (16 for small sizes, fewer for large ones) while a spin
kernel holds the stream, so the events time the GPU's work, not the host's issue rate; the median
is reported with min and max. Modes whose host waits for the GPU (pageable host memory, verified
sync, staged) cannot be held: they are timed from an idle stream ("held": false in the JSON). CPU
rows: wall clock. GB/s is 1e9 bytes per second of the bytes copied per call (ce_bidir: both
directions' bytes). After every point the destination is checked with PXH64 on its own device,
outside the timed region: a pair that writes wrong bytes is reported "corrupt" and the bench carries
on. Each point's spread is its coefficient of variation (CV: standard deviation over mean of the
samples), printed beside the median; points above 5% are listed as warnings.

Latency, per row (kinds): "ce" and "sm", as the GPU sees it: 100 8-byte copies (copy_; the copy
kernel, pulling between GPUs) queued back to back behind a held stream, timed by events, per copy;
"chase", one load: the source GPU walks a 2 MiB ring of random pointers in the destination's memory
(torch.ops.pyxfer.pointer_chase, one dependent load per hop; nvbandwidth's SM latency; GPU pairs
with peer access and GPU-local rows; the CPU walks host memory without GPUs); "host_call", the
host's round trip of one call: one 8-byte copy issued from an idle stream and waited for (the host's
cost, not the link's latency).

Without a GPU (CPU mode): the preset's sizes stop at 64 MiB (peak memory under 2 GB), the copies run
on 1 torch thread (--threads), and a host memcpy (ce) slower than staged, or under 1 GB/s at 1 MiB
and up, is warned about as implausible (CPU threads contended).

The method check times torch's copy_ in the simplest correct way (20 back-to-back copies between
two events from an idle stream) at the largest size on host <-> GPU and GPU-local rows, and reports
bench's ce figure over it (1.00 = the harness adds nothing and loses nothing).

--json PATH writes one document, schema "pyxfer.bench", version 3 (version 2 had one latency figure
per row and no CV, and its ce_bidir serialized the two directions between GPUs; version 1 had one "sm"
mode, torch's copy kernel pushing; --compare reads versions 1 and 2 too, version 1's "sm" points match
nothing):
  schema, schema_version, created (UTC ISO 8601), argv, gpu (bool), machine (host, platform, python,
  torch, torch_cuda, nccl, driver, nvidia_driver (NVML's; null without pyxfer[nvml]), gpus [{index, name,
  uuid, capability, memory_gib, sms}], peer_access [[bool|null]], pyxfer, build, threads, env),
  method {description, warmup, reps, units},
  config {sizes [int], matrix_size, modes [str], rows [[src, dst]], threads (torch threads of the measurement)},
  results [{src, dst, mode, bytes, gbps|null, median_ms, min_ms, max_ms, cv, reps, loop, held,
            check: "ok"|"corrupt"|"error", detail}],
  ratios [{src, dst, bytes, ratio: "verified/ce"|"staged/ce", value}],
  latency [{src, dst, kind: "ce"|"sm"|"chase"|"host_call", bytes (the ring's for chase), median_us|null,
            min_us, max_us, cv, detail}] (null and detail: the figure failed; a row lacks the kinds it has not),
  checksum [{device, bytes, gbps, median_ms, min_ms, max_ms}],
  method_check [{src, dst, bytes, bench_gbps, torch_gbps, ratio}],
  corrupt [{src, dst, mode, bytes, detail}],
  compare: null | {old, threshold, slower [{src, dst, mode, bytes, old_gbps, new_gbps, ratio}]},
  warnings [str] (implausible CPU figures, points whose CV is above 5%)
Exit code 1 when a destination was wrong or --compare flagged a slowdown; 2 for a bad option (every
option, the --compare document and the outputs' paths are checked before anything is measured) or
for an output that could not be written after the run (the run is then saved in a new file of the
temporary directory, and the message says where).
"""
import datetime
import json
import os
import sys
import tempfile

import torch

from .bench_measure import (  # noqa: F401
    CHASE_BYTES,
    CPU_MAX_BYTES,
    CPU_THREADS,
    LATENCY_BYTES,
    LATENCY_KINDS,
    PRESETS,
    _is_host,
    _loop,
    _peer,
    _Point,
    chase,
    chase_ring,
    default_rows,
    measure_all,
    modes_of,
    parse_modes,
    parse_rows,
    plan_points,
    plausibility,
    ratios,
    spread_warnings,
)
from .bench_report import _text_color, matrix, plot, print_results  # noqa: F401
from .bench_schema import MODES, SCHEMA, SCHEMA_VERSION, compare, read_compare, validate  # noqa: F401
from .files import write_json_atomic
from .timing import fmt_size

# The kit: bench_measure measures, bench_report prints and draws, bench_schema defines and checks the
# document; this module is the command (options, the run, its outputs).
__all__ = ["MODES", "PRESETS", "SCHEMA", "SCHEMA_VERSION", "run", "validate", "compare", "parse_rows", "parse_modes",
           "plan_points"]


def _configure(args, gpus):
    """(sizes, reps, warmup, rows, modes, old document) of a run, every option checked before anything is
    measured. Raises ValueError naming the option and what was expected."""
    from .machine import memory_bytes

    preset = PRESETS[args.preset]
    sizes = sorted(set(args.sizes or preset["sizes"]))
    if not gpus and not args.sizes:  # the CPU mode's memory bound (CPU_MAX_BYTES); --sizes is taken as given
        sizes = [n for n in sizes if n <= CPU_MAX_BYTES]
    threads = getattr(args, "threads", None)
    threads = threads if threads is not None else None if gpus else CPU_THREADS
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    reps = args.reps if args.reps is not None else preset["reps"]
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    if reps < 1 or warmup < 0:
        raise ValueError(f"--reps must be >= 1 and --warmup >= 0, got {reps} and {warmup}")
    rows = parse_rows(args.pairs, gpus) if args.pairs is not None else default_rows(gpus)
    modes = parse_modes(args.modes) if args.modes is not None else list(MODES)
    if args.modes is not None:  # every mode asked for must be measured somewhere
        planned = {m for _, _, m in plan_points(rows, modes)}
        if unsupported := [m for m in modes if m not in planned]:
            supports = "; ".join(f"{s}->{d}: {','.join(modes_of(s, d, _peer(s, d)))}" for s, d in rows)
            raise ValueError(f"--modes: expected modes the rows support ({supports}), got {','.join(unsupported)}, "
                             f"which no row supports")
    # each point holds about three buffers of its size on a device: the random data, the source, the destination
    n = max(sizes)
    for dev in sorted({"cpu" if _is_host(e) else e for row in rows for e in row} | {"cuda:0" if gpus else "cpu"}):
        if 3 * n > memory_bytes(dev):
            raise ValueError(f"--sizes: expected sizes whose buffers fit: {fmt_size(n)} needs about 3 x "
                             f"{fmt_size(n)} on {dev}, which has {fmt_size(memory_bytes(dev))}")
    old = read_compare(args.compare) if args.compare is not None else None
    if args.plot:
        if args.json and os.path.abspath(args.json) == os.path.abspath(args.plot):
            raise ValueError(f"--json and --plot: expected two files, got {args.plot!r} twice")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'pyxfer[plot]' (or matplotlib)") from None
    return sizes, reps, warmup, rows, modes, old, threads


def _write_json(doc, path):
    """Write ``doc`` to ``path``: over a regular file through a temporary file renamed (a failed write
    leaves the old file and no temporary), into anything else (a pipe, /dev/stdout) directly."""
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return
    write_json_atomic(path, doc)


def _save_elsewhere(doc):
    """Save a finished run whose --json could not be written: in a new file of the temporary
    directory (returns its path), else as JSON on stderr (returns None)."""
    try:
        fd, path = tempfile.mkstemp(prefix="pyxfer-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        return path
    except OSError:
        json.dump(doc, sys.stderr, indent=1)
        print(file=sys.stderr)
        return None


def run(args) -> int:
    """`pyxfer bench` with parsed ``args`` (see cli.py). Returns the exit code: 0, 1 (a destination
    was wrong, or --compare flagged a slowdown), 2 (a bad option, before anything is measured; or an
    output that could not be written after the run: the run is then saved elsewhere and said where)."""
    from .machine import machine_info

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        sizes, reps, warmup, rows, modes, old, threads = _configure(args, gpus)
    except ValueError as e:
        print(f"pyxfer bench: {e}", file=sys.stderr)
        return 2
    if not gpus:
        print(f"pyxfer bench: no CUDA GPU visible: measuring host memcpy, checksum and CPU verified / staged "
              f"copies only, on {threads} torch thread(s)" + ("" if args.sizes else
                                                            f", sizes up to {fmt_size(CPU_MAX_BYTES)}"),
              file=sys.stderr)
    before = torch.get_num_threads()
    try:
        if threads is not None:  # the copies' own threads: more than free cores makes torch's copy_ wait on them
            torch.set_num_threads(threads)
        threads = torch.get_num_threads()  # what the measurement ran on, recorded
        results, latency, sums, method = measure_all(rows, modes, sizes, reps=reps, warmup=warmup,
                                                     progress=not args.no_progress)
    finally:
        torch.set_num_threads(before)
    n = max(sizes)
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv[1:], "gpu": bool(gpus), "machine": machine_info(),
           "method": {"description": " ".join(__doc__[__doc__.index("Method"):__doc__.index("--json PATH")].split()),
                      "warmup": warmup, "reps": reps, "units": "GB/s = 1e9 bytes per second; ms per call; us"},
           "config": {"sizes": sizes, "matrix_size": n, "modes": [m for m in MODES if m in modes],
                      "rows": [list(r) for r in rows], "threads": threads},
           "results": results, "ratios": ratios(results, n), "latency": latency, "checksum": sums,
           "method_check": method,
           "corrupt": [{k: r[k] for k in ("src", "dst", "mode", "bytes", "detail")} for r in results
                       if r["check"] == "corrupt"],
           "compare": None,
           "warnings": plausibility(results) + spread_warnings(results, latency)}
    if old is not None:
        doc["compare"] = {"old": args.compare, "threshold": args.threshold,
                          "slower": compare(doc, old, args.threshold)}
    status = 1 if doc["corrupt"] or (doc["compare"] and doc["compare"]["slower"]) else 0
    # From here the run is finished: it is saved before anything else can fail, and an output that
    # cannot be written (a full disk) is reported with where the run went instead.
    errors, wrote = [], []
    if args.json:
        try:
            _write_json(doc, args.json)
            wrote.append(args.json)
        except (OSError, ValueError) as e:
            spare = _save_elsewhere(doc)
            errors.append(f"--json: could not write {args.json} ({e}); the run is saved in "
                          f"{spare if spare else 'the JSON above, on stderr'}")
    print_results(doc)
    if args.plot:
        try:
            plot(doc, args.plot)
            wrote.append(args.plot)
        except Exception as e:  # noqa: BLE001  (the run is printed and saved: report the plot and go on)
            errors.append(f"--plot: could not write {args.plot} ({type(e).__name__}: {e})")
    for path in wrote:
        print(f"wrote {path}")
    for message in errors:
        print(f"pyxfer bench: {message}", file=sys.stderr)
    return 2 if errors else status
