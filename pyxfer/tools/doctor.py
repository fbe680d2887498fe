"""`pyxfer doctor`: is this machine safe for pyxfer, and which device pairs can be trusted?

It prints the build facts, the torch / CUDA / driver versions, the GPUs and their peer access, the
self-checks (PXH64 and format spec vectors on the CPU and on every GPU, CPU == GPU agreement,
architecture), then a verdict per ordered device pair (host <-> every GPU, every GPU pair; cpu -> cpu
on a machine without GPUs):

  ok           every probe's destination held exactly the source's bytes
  corrupt      a destination held wrong bytes (evidence: path, size, first wrong offset, count)
  dropped      a destination was all zeros or still the sentinel it was filled with
  slow         right bytes, but under --slow-fraction (0.5) of the median GB/s of comparable pairs
               (GPU -> GPU, host -> GPU, GPU -> host) in the same run, or under the pair's absolute floor
               (pyxfer.tools.floors: per GPU model and link, e.g. H100 / H200 SXM NVLink 335 GB/s)
  unsupported  no peer access between the GPUs: their copies route staged (the staged path is probed)
  hung         a probe did not finish within --timeout seconds (its child process was killed), or in the
               concurrent probe a GPU waited for its partner's flags past the wait limit (2 s)
  error        a probe raised or its process died (a sticky CUDA error, ...): the evidence says what

Every pair also gets its path (nvlink, pcie, peer, none, local, host, memory: pyxfer.tools.advice) and, when
its verdict is not ok, the advice for that path: what to check next. With --repeat N / --duration S every
pair is probed in several rounds (fresh data each time: intermittent faults need repetition); its verdict is
the worst round's, with the count of each verdict.

Probes: random bytes at 3 sizes (4093 B, 4 MiB and --large, default 256 MiB; 16 MiB for cpu -> cpu)
copied into sentinel-filled (0xC3) destinations along each path: "ce" (torch's copy_, the copy engine
for host <-> GPU and peer pairs), "sm" (pyxfer's copy kernel on the destination GPU reading the
source's memory, torch.ops.pyxfer.sm_copy; GPU pairs with peer access), "pyxfer" (pyxfer's direct path, unverified:
the path verified copies take first), "staged" (through host memory: pairs without peer access, and peer
pairs, where it is pyxfer's fallback and the rate a direct path must beat) — each destination checked with
PXH64 on its own device (pyxfer.tools.destinations) — then one 4 KiB copy with an injected bit flip that must
be caught, proving the check works. GB/s is that of BURST (4) back-to-back "ce" copies of the large size,
checked again after them ("ce-burst"). GPU pairs with peer access also run a "concurrent" probe: one block on
each GPU at the same time, each writing 8 rounds of 512 KiB into the other's memory and polling flags in its
own for the partner's rounds and acknowledgements (torch.ops.pyxfer.peer_exchange), so that a path that only
works when a synchronize flushes it shows as corrupt or hung. Then one NCCL all-gather per GPU pair over a
2-rank group (pyxfer.tools.pair_collectives: one process per GPU), both directions checked ("collective"
probes, a check "NCCL collective per GPU pair"; skipped with the reason where NCCL is missing). Every probe
runs in a child process under a watchdog, so a sticky CUDA error or a hang takes down only the child: the pair
is reported and the doctor carries on in a fresh child. The NVLink / PCIe error counters are read through NVML
before and after the probes (nvidia-ml-py, optional): a rise fails the "link error counters" check and is
reported against the pairs of that GPU.

A fault armed from $PYXFER_INJECT_FAULT is in the children too: the report names it next to every
verdict it can have caused; a malformed value is a failed check. The probes name their routes, so
the environment the user's copies run with is checked on its own: a PYXFER_* value pyxfer refuses
when it reads it (PYXFER_ROUTE=fast makes every default-route verified_copy raise; a peer knob the
CUDA path refuses; a PYXFER_HEALTH_FROM_DOCTOR that loads nothing) is a failed check. The verdicts
are cached (see pyxfer.tools.verdict_cache; not when a fault was armed from the environment) for
pyxfer.health.load_doctor_verdicts and for other software: --env prints them as shell exports
(pyxfer.tools.exports). Exit code 0 when every check passed and every pair is ok, else 1;
2 for a bad option (said before anything is probed).

--json prints one document (schema "pyxfer.doctor", version 3):
  schema, schema_version, ok (bool), seconds, rounds,
  build {pyxfer, torch, cuda, cuda_version, cuda_archs, ...}, system {python, platform, torch,
  torch_cuda, driver}, gpus [{index, name, uuid, capability, memory_gib, sms}], peer_access [[bool|null]],
  links {nvml: bool, why, pcie {"cuda:N": {gen, width}}, kinds {"cuda:I->cuda:J": "nvlink"|"pcie"}},
  counters {available, why, before / after / rises {"cuda:N": {counter: int}}},
  floors {applied, count, note}, injected_fault: null | {spec, kind, path, src, dst, times},
  checks [{check, status: "ok"|"FAIL"|"skip", detail, seconds}],
  pairs [{src, dst, path, verdict, evidence: [str], advice: [str], notes: [str], gbps: float|null,
          staged_gbps, floor_gbps, floor_source, seconds, runs, counts {verdict: n}, link_errors {str: int},
          fault_from_env: bool,
          probes [{path, bytes, result: "ok"|"corrupt"|"dropped"|"injected-caught"|"injected-missed"
                   (a "collective" probe: also "hung"|"error", with detail), first_offset?, wrong_bytes?,
                   gbps?, copies?, detail?}]}],
  cache {path, written: bool, note}
"""
import json
import math
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from .._devices import as_device
from .advice import advice
from .destinations import SENTINEL, compare, sentinel_bytes
from .files import last_line
from .floors import MIN_BYTES as MIN_FLOOR_BYTES
from .floors import PATHS as FLOOR_PATHS
from .floors import floor_for, load_floors
from .links import COUNTERS, counter_rises, nvml_facts, read_counters
from .machine import driver_version, gpus, peer_matrix
from .pairs import parse_pairs

__all__ = ["VERDICTS", "SCHEMA", "SCHEMA_VERSION", "Report", "doctor", "print_report", "run"]

OK, FAIL, SKIP = "ok", "FAIL", "skip"
VERDICTS = ("ok", "corrupt", "dropped", "slow", "unsupported", "hung", "error")
SCHEMA, SCHEMA_VERSION = "pyxfer.doctor", 3
SMALL = 4093  # an odd size: the tail of every vectorized loop
BURST = 4  # back-to-back copies of the large probe for a pair's GB/s
# The concurrent exchange of a GPU pair: rounds of an odd number of words each way (512 KiB and 3 words),
# a wait limit per round far above a healthy pair's microseconds; the words after the op's header.
EXCHANGE_ROUNDS, EXCHANGE_WORDS, EXCHANGE_WAIT_S, EXCHANGE_HEADER_WORDS = 8, (64 << 10) + 3, 2.0, 16
MIB = 1 << 20
# Test-only: "hang:SRC->DST" makes the probe of that pair never finish (the watchdog's case),
# "crash:SRC->DST" makes its process die without a word (SIGABRT, as a crashing driver would).
TEST_FAULT_ENV = "PYXFER_DOCTOR_TEST_FAULT"
STARTUP_S = 120.0  # a child's time to import torch and pyxfer (a loaded machine), before its first task


class Report:
    """Sections (facts), checks (self-tests) and pairs (verdicts) of one doctor run."""

    def __init__(self):
        self.sections = {}
        self.checks = []
        self.pairs = []

    def section(self, name, value):
        self.sections[name] = value

    def check(self, name, fn):
        """Run fn() -> (status, detail); any exception is a failed check, never a crash."""
        self.checks.append(run_check(name, fn))

    @property
    def failed(self):
        return [c for c in self.checks if c["status"] == FAIL]

    @property
    def bad_pairs(self):
        return [p for p in self.pairs if p["verdict"] != "ok"]

    def as_json(self):
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "ok": not (self.failed or self.bad_pairs),
                **self.sections, "checks": self.checks, "pairs": self.pairs}


def run_check(name, fn):
    start = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as e:  # noqa: BLE001  (a doctor reports what broke and carries on)
        status, detail = FAIL, f"{type(e).__name__}: {e}"
    return {"check": name, "status": status, "detail": detail, "seconds": round(time.perf_counter() - start, 3)}


# ---- self-checks (worked values of the specs; CPU == GPU)

def _verdict(bad, ok_detail):
    """A self-check's result: FAIL listing what went wrong, else OK with ``ok_detail``."""
    return (FAIL, "; ".join(bad)) if bad else (OK, ok_detail)


def _vector_check(device):
    from .selftest import check_vectors

    results = check_vectors(device)
    bad = [f"{name}: got {got:016x}, expected {exp:016x}" for name, ok, got, exp in results if not ok]
    return _verdict(bad, f"{len(results)} spec vectors match")


def _agreement_check(device):
    from .selftest import check_agreement

    results = check_agreement(device)
    bad = [f"{name}: cpu {a:016x} != {device} {b:016x}" for name, ok, a, b in results if not ok]
    return _verdict(bad[:5], f"{len(results)} random buffers (every alignment mod 16) agree")


def _format_vector_check(device):
    from .selftest import check_format_vectors

    results = check_format_vectors(device)
    bad = [f"{name}: got {got}, expected {exp}" for name, ok, got, exp in results if not ok]
    return _verdict(bad, f"{len(results)} worked examples of the spec match")


def _format_agreement_check(device):
    from .selftest import check_format_agreement

    results = check_format_agreement(device)
    bad = [f"{fmt}: {detail} differ" for fmt, ok, detail in results if not ok]
    return _verdict(bad, f"{len(results)} formats x both usages bit-identical")


def _arch_check(info, gpu):
    archs = [int(a[3:]) for a in info["cuda_archs"]]
    cc = int(gpu["capability"].replace(".", ""))
    if cc in archs:
        return OK, f"sm_{cc} machine code in the build"
    if archs and max(archs) < cc:
        return OK, f"no sm_{cc} machine code; runs from sm_{max(archs)} PTX (JIT at first use)"
    return FAIL, f"built for {info['cuda_archs']}, which cannot run on sm_{cc}: rebuild with PYXFER_CUDA_ARCHS={cc}"


def _torch_match_check(info):
    built, runtime = info["torch"], torch.__version__.split("+")[0]
    if built != runtime:
        return FAIL, f"built against torch {built}, running torch {runtime}: rebuild pyxfer"
    return OK, f"built against torch {built}"


def _cuda_build_check(info, devices):
    if not devices:
        return SKIP, "no CUDA GPU visible: GPU checks skipped, CPU checks run"
    if not info["cuda"]:
        return FAIL, "GPUs are visible but pyxfer was built without CUDA (CPU torch or no nvcc at build time)"
    return OK, f"CUDA {info['cuda_version']} build for {', '.join(info['cuda_archs'])}"


def _env_fault_check():
    """(check result, parsed fault or None) for $PYXFER_INJECT_FAULT."""
    from ..testing import parse_env_fault

    spec = os.environ.get("PYXFER_INJECT_FAULT")
    if not spec:
        return (OK, "not set"), None
    try:
        fault = parse_env_fault(spec)
    except ValueError as e:
        return (FAIL, f"{e}; the probes run without it"), None
    return (OK, f"{spec!r} armed in every probe: the verdicts it can cause say so"), {"spec": spec, **fault}


# The PYXFER_* variables pyxfer reads while it runs, and those only the build, the scripts and the
# tests read: any other PYXFER_* name is read by nothing (a typo?), which the environment check says.
RUNTIME_ENV = ("PYXFER_ROUTE", "PYXFER_INJECT_FAULT", "PYXFER_HEALTH_FROM_DOCTOR", "PYXFER_DOCTOR_CACHE",
               "PYXFER_PEER_FUSED_MIB", "PYXFER_PEER_CHUNKS", "PYXFER_ALLOW_UNTESTED")
OTHER_ENV = ("PYXFER_CUDA_ARCHS", "PYXFER_CUDA_ARCH_LIST", "PYXFER_WITH_CUDA", "PYXFER_KERNEL_CHECK", "PYXFER_CXX",
             "PYXFER_TORCH", "PYXFER_VENV", "PYXFER_REBUILD", "PYXFER_CACHE", "PYXFER_CUDA_TORCH", "PYXFER_CUDA_VENV",
             "PYXFER_TE_TORCH", "PYXFER_TE_VENV", "PYXFER_TE_VERSION", "PYXFER_GATHER_SEED", "PYXFER_TE_SEED",
             TEST_FAULT_ENV)
# A number as C's sscanf("%lf") reads it (csrc/cuda/transfer_cuda.cpp reads the peer knobs so; the rest
# of the text is ignored there too)
_SCANF_FLOAT = r"\s*([+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan))"


def _scanf_number(pattern, text):
    m = re.match(pattern, text, re.IGNORECASE)
    return float(m.group(m.lastindex)) if m else math.nan


def _environment_check(env=None):
    """(status, detail) of the PYXFER_* variables the copies of this environment run with: FAIL naming
    each value pyxfer refuses when it reads it (a copy that raises, verdicts not loaded), as it would
    refuse it. PYXFER_INJECT_FAULT has a check of its own."""
    from ..health import HEALTH_ENV, env_problem
    from ..transfer import ROUTES
    from .verdict_cache import cache_path, read_cache

    env = os.environ if env is None else env
    bad, notes = [], []
    route = env.get("PYXFER_ROUTE")
    if route is not None and route not in ROUTES:  # transfer.default_route(): "" is not "auto" either
        bad.append(f"PYXFER_ROUTE={route!r}: expected one of {', '.join(ROUTES)}; every verified_copy without "
                   f"route= raises ValueError")
    fused = env.get("PYXFER_PEER_FUSED_MIB")
    if fused and not 0 <= _scanf_number(_SCANF_FLOAT, fused) < math.inf:
        bad.append(f"PYXFER_PEER_FUSED_MIB={fused!r}: expected a size in MiB such as '64' (0: never); the first "
                   f"peer copy of a CUDA build raises")
    chunks = env.get("PYXFER_PEER_CHUNKS")
    if chunks and not 0 < _scanf_number(r"\s*[+-]?\d+," + _SCANF_FLOAT, chunks) < math.inf:
        bad.append(f"PYXFER_PEER_CHUNKS={chunks!r}: expected '<shrink>,<min chunk MiB>' such as '6,2'; the first "
                   f"peer copy of a CUDA build raises")
    health = env.get(HEALTH_ENV, "")
    if health == "1":  # without a cache yet: this run writes it
        notes.append(f"{HEALTH_ENV}=1 loads {cache_path()}" + ("" if os.path.isfile(cache_path()) else
                                                               " (not there yet)"))
    elif health not in ("", "0"):
        problem = env_problem(health)
        if problem is None:
            try:
                read_cache(health)
                notes.append(f"{HEALTH_ENV} loads {health}")
            except (OSError, ValueError) as e:
                problem = f"{HEALTH_ENV}={health!r}: not a verdict cache ({e})"
        if problem:
            bad.append(f"{problem}; imports load no verdicts")
    unknown = sorted(k for k in env if k.startswith("PYXFER_") and k not in RUNTIME_ENV + OTHER_ENV)
    if unknown:
        notes.append(f"read by nothing in pyxfer: {', '.join(unknown)}")
    if bad:
        return FAIL, "; ".join(bad + notes)
    used = [f"{k}={env[k]!r}" for k in RUNTIME_ENV if k in env and k not in ("PYXFER_INJECT_FAULT", HEALTH_ENV)]
    return OK, "; ".join([(", ".join(used) if used else "none set") + " (valid)"] + notes)


def _device_checks(info, gpu):
    """(name, fn) of the self-checks of one GPU (run in a probe child)."""
    dev = f"cuda:{gpu['index']}"
    return [(f"architecture of {dev}", lambda: _arch_check(info, gpu)),
            (f"checksum vectors on {dev}", lambda: _vector_check(dev)),
            (f"checksum cpu == {dev}", lambda: _agreement_check(dev)),
            (f"formats reference values on {dev}", lambda: _format_vector_check(dev)),
            (f"formats cpu == {dev}", lambda: _format_agreement_check(dev))]


# ---- pair probes (run in a child process)

def _sync(*devices):
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _classify(out, expected_hash, src):
    """("ok" | "corrupt" | "dropped", details): PXH64 of ``out`` on its own device against the source's;
    on a mismatch the bytes are compared on the host for the evidence."""
    diff = compare(out, src, expected_hash)
    if diff is None:
        return "ok", {}
    details = {"first_offset": diff["first_offset"], "wrong_bytes": diff["wrong_bytes"]}
    return ("dropped" if diff["all_zero"] or diff["all_sentinel"] else "corrupt"), details


def _sentinel_out(numel, device):
    """A sentinel-filled destination, and the same block primed for the allocator's next tensor of
    this size (the pyxfer path allocates its own output; on CUDA the caching allocator hands it the
    block just filled, so a dropped write reads back as the sentinel there too)."""
    sentinel_bytes(numel, device)  # filled, then freed at once: the block the next allocation of this size gets
    return sentinel_bytes(numel, device)


def _burst(out, data, src, dst, copies=BURST):
    """GB/s of ``copies`` back-to-back copies of ``data`` into ``out``, from the host's clock between two
    synchronizes."""
    _sync(src, dst)
    start = time.perf_counter()
    for _ in range(copies):
        out.copy_(data, non_blocking=True)
    _sync(src, dst)
    return copies * data.numel() / (time.perf_counter() - start) / 1e9


def _concurrent_probe(src, dst, test_fault, seed):
    """The pair's concurrent exchange (torch.ops.pyxfer.peer_exchange): both GPUs at once writing rounds of
    words into each other's memory and polling each other's flags, as NCCL's kernels do. A wrong word from src to
    dst is "corrupt" (offsets and counts in bytes of whole words; wrong words the other way are named in the
    detail: the reverse pair's own probe judges them), a partner that never answers "hung". Test hooks
    ($PYXFER_DOCTOR_TEST_FAULT): "concurrent-corrupt:SRC->DST" (one wrong word from SRC),
    "concurrent-hang:SRC->DST" (DST's side never runs)."""
    a = torch.empty(EXCHANGE_HEADER_WORDS + EXCHANGE_WORDS, dtype=torch.int64, device=src)
    b = torch.empty_like(a, device=dst)
    corrupt = 3 if test_fault == f"concurrent-corrupt:{src}->{dst}" else -1
    stall = 1 if test_fault == f"concurrent-hang:{src}->{dst}" else -1
    at_src, at_dst = torch.ops.pyxfer.peer_exchange(a, b, EXCHANGE_ROUNDS, seed, EXCHANGE_WAIT_S, corrupt,
                                                    stall).tolist()
    probe = {"path": "concurrent", "bytes": 8 * EXCHANGE_WORDS * EXCHANGE_ROUNDS, "rounds": EXCHANGE_ROUNDS}
    back = (f"; also {at_src[0]} wrong words {dst} -> {src}, the first in round {at_src[1]} at word {at_src[2]}"
            if at_src[0] else "")
    if at_dst[0]:
        return {**probe, "result": "corrupt", "first_offset": 8 * at_dst[2], "wrong_bytes": 8 * at_dst[0],
                "detail": f"{at_dst[0]} wrong words {src} -> {dst}, the first in round {at_dst[1]} at word "
                          f"{at_dst[2]}" + back}
    late = [f"{to} waited more than {EXCHANGE_WAIT_S:g} s for {frm} in round {row[3] + 1}"
            for to, frm, row in ((dst, src, at_dst), (src, dst, at_src)) if row[4]]
    if late:
        return {**probe, "result": "hung", "detail": "; ".join(late) + back}
    return {**probe, "result": "ok", **({"detail": back[2:]} if back else {})}


def _host(numel, device):
    t = torch.empty(numel, dtype=torch.uint8)
    return t.pin_memory() if device.type == "cuda" and torch.cuda.is_available() else t


def _probe_pair(task):
    """Probe one ordered pair: see the module docstring. Returns a pair result (no verdict for
    "slow": the parent compares pairs)."""
    from .. import health, testing
    from ..checksums import checksum
    from ..transfer import verified_copy

    src, dst = (as_device("pyxfer doctor (a probe)", k, task[k]) for k in ("src", "dst"))
    test_fault = os.environ.get(TEST_FAULT_ENV, "")
    if test_fault == f"hang:{task['src']}->{task['dst']}":
        while True:
            time.sleep(60)
    if test_fault == f"crash:{task['src']}->{task['dst']}":
        os.abort()
    peer = src.type == "cuda" and dst.type == "cuda" and src != dst
    direct = not peer or torch.cuda.can_device_access_peer(src.index, dst.index)
    # peer pairs also probe the staged path: pyxfer falls back to it, and it is the rate to beat
    paths = ["ce", "sm", "pyxfer", "staged"] if (peer and direct) else ["ce", "pyxfer"] if direct else ["staged"]
    before = health.status(src, dst)
    probes, gbps, staged_gbps = [], None, None
    # random bytes made on a GPU of the pair when there is one (fast), else on the CPU
    maker = src if src.type == "cuda" else dst
    gen = torch.Generator(device=maker).manual_seed(task.get("seed", 0))

    def random_bytes(n):
        made = torch.randint(0, 256, (n,), dtype=torch.uint8, device=maker, generator=gen)
        return made if src.type == "cuda" else _host(n, dst).copy_(made)

    try:
        for size in task["sizes"]:
            data = random_bytes(size)
            want = checksum(data)
            largest = size == task["sizes"][-1]
            for path in paths:
                if path in ("ce", "sm"):
                    out = _sentinel_out(size, dst) if dst.type == "cuda" else _host(size, src).fill_(SENTINEL)
                    _sync(src, dst)
                    if path == "ce":
                        out.copy_(data)
                    else:  # a pull, as pyxfer's verified peer copies move data
                        torch.ops.pyxfer.sm_copy(data, out, True)
                    _sync(src, dst)
                    seconds = None
                else:
                    _sentinel_out(size, dst)
                    route = "direct" if path == "pyxfer" else "staged"
                    _sync(src, dst)
                    start = time.perf_counter()
                    out = verified_copy(data, dst, route=route, verify="none")
                    _sync(src, dst)
                    seconds = time.perf_counter() - start
                result, details = _classify(out, want, data)
                probes.append({"path": path, "bytes": size, "result": result, **details})
                if largest and result == "ok" and path == "ce":
                    # the link's rate: back-to-back copies (one launch and synchronize amortized over them),
                    # and the destination checked again after them
                    rate = _burst(out, data, src, dst)
                    result, details = _classify(out, want, data)
                    probes.append({"path": "ce-burst", "bytes": size, "copies": BURST, "result": result, **details})
                    if result == "ok":
                        gbps = probes[-1]["gbps"] = round(rate, 3)
                elif largest and result == "ok" and path == "staged" and peer:
                    staged_gbps = probes[-1]["gbps"] = round(size / seconds / 1e9, 3)
        if peer and direct and torch.cuda.can_device_access_peer(dst.index, src.index):  # the op maps both ways
            probes.append(_concurrent_probe(src, dst, test_fault, task.get("seed", 0)))
        # The check itself: a bit flipped on pyxfer's direct path must be caught.
        path = "direct" if direct else "staged"
        data = random_bytes(4096)
        with testing.inject_fault("bitflip", src=src, dst=dst, path=path) as fault:
            out = verified_copy(data, dst, route=path, verify="none")
        result, _ = _classify(out, checksum(data), data)
        caught = fault.used == 1 and result != "ok"
        probes.append({"path": f"{'pyxfer' if direct else 'staged'}+bitflip", "bytes": 4096,
                       "result": "injected-caught" if caught else "injected-missed"})
    finally:
        health.mark(src, dst, before)
    bad = [p for p in probes if p["result"] in ("corrupt", "dropped")]
    missed = [p for p in probes if p["result"] == "injected-missed"]
    hung = [p for p in probes if p["result"] == "hung"]
    if bad:
        verdict = bad[0]["result"]
        evidence = [f"{p['path']} {p['bytes']} B: {p['result']}, first wrong byte at offset {p['first_offset']}, "
                    f"{p['wrong_bytes']} wrong" + (f" ({p['detail']})" if "detail" in p else "") for p in bad]
    elif hung:
        verdict, evidence = "hung", [f"{p['path']}: {p['detail']}" for p in hung]
    elif missed:
        verdict, evidence = "error", ["an injected bit flip was not caught: the probes cannot be trusted"]
    elif not direct:
        verdict = "unsupported"
        evidence = [f"no peer access from {src} to {dst}: copies route staged (staged path probed: ok)"]
    else:
        verdict = "ok"
        evidence = [f"{len(probes) - 1} probes ({', '.join(paths)}; {', '.join(map(str, task['sizes']))} B) exact; "
                    f"injected bit flip caught"]
    return {"src": task["src"], "dst": task["dst"], "verdict": verdict, "evidence": evidence, "gbps": gbps,
            "staged_gbps": staged_gbps, "probes": probes}


def _run_task(task):
    if task["kind"] == "pair":
        return _probe_pair(task)
    from .._build import build_info

    info = build_info()
    gpu = next(g for g in gpus() if g["index"] == task["index"])
    return {"checks": [run_check(name, fn) for name, fn in _device_checks(info, gpu)]}


def _child_main():
    """A probe child: tasks as JSON on stdin, one JSON line per finished task on stdout. After a task
    that raised, it exits (a CUDA error may be sticky): the parent restarts a child for the rest."""
    import pyxfer  # noqa: F401  (registers the ops; installs a fault from $PYXFER_INJECT_FAULT)

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    out.write(json.dumps({"ready": True}) + "\n")  # imports done: from here each task gets --timeout
    out.flush()
    for i, task in json.load(sys.stdin):
        start = time.perf_counter()
        try:
            result, failed = _run_task(task), False
        except Exception as e:  # noqa: BLE001
            result, failed = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}, True
        result["seconds"] = round(time.perf_counter() - start, 3)
        out.write(json.dumps({"task": i, **result}) + "\n")
        out.flush()
        if failed:
            sys.exit(3)


def run_tasks(tasks, timeout):
    """Run tasks in probe children, each task within ``timeout`` seconds of the previous one's end
    (the child's first, of it saying it is ready: STARTUP_S to import torch and pyxfer). Returns [result] in
    task order; a task that ran out of time gets {"hung": True}, one whose child died {"error": message}."""
    results = [None] * len(tasks)
    pending = list(range(len(tasks)))
    code = "import pyxfer.tools.doctor as d; d._child_main()"
    # the children import this very pyxfer (a source tree on PYTHONPATH, an editable install, ...)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    while pending:
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, env=env, start_new_session=True)
            proc.stdin.write(json.dumps([(i, tasks[i]) for i in pending]).encode())
            proc.stdin.close()
            buf, fd, ended = b"", proc.stdout.fileno(), False
            deadline = time.monotonic() + STARTUP_S  # until the child says it is ready
            while pending:
                ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(fd, 1 << 16) if ready else None
                if chunk:
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        msg = json.loads(line)
                        deadline = time.monotonic() + timeout
                        if "ready" in msg:
                            continue
                        results[msg["task"]] = msg
                        pending.remove(msg["task"])
                        ended = "error" in msg  # the child exits after a task that raised
                    continue
                if ended and chunk == b"":
                    break  # a fresh child for the rest
                i = pending.pop(0)
                if chunk is None:  # the watchdog: the task is past its time
                    results[i] = {"hung": True, "seconds": timeout}
                    os.killpg(proc.pid, signal.SIGKILL)
                else:  # the child exited without finishing the task
                    proc.wait()
                    results[i] = {"error": f"probe process died (exit code {proc.returncode}): {last_line(err)}"}
                break
            proc.stdout.close()
            if proc.poll() is None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return results


# ---- the run

SEVERITY = ("ok", "unsupported", "error", "hung", "dropped", "corrupt")  # of one run's verdicts, mildest first


def _pair_class(src, dst):
    if src == "cpu":
        return "host -> GPU" if dst != "cpu" else "host -> host"
    return "GPU -> host" if dst == "cpu" else "GPU -> GPU"


def _index(device):
    return None if device == "cpu" else int(device.split(":")[1])


def pair_path(src, dst, machine):
    """The path a pair's copies take (see pyxfer.tools.advice): memory, host, local, none, or the link
    NVML names (nvlink / pcie), else peer."""
    i, j = _index(src), _index(dst)
    if i is None and j is None:
        return "memory"
    if i is None or j is None:
        return "host"
    if i == j:
        return "local"
    if not machine["peer_access"][i][j]:
        return "none"
    return machine["links"].get((i, j), "peer")


def _combine(runs):
    """One pair's result over its runs: the worst run's verdict, evidence and probes, counts per verdict,
    medians of the GB/s figures."""
    worst = max(runs, key=lambda r: SEVERITY.index(r["verdict"]))
    counts = {v: n for v in SEVERITY if (n := sum(r["verdict"] == v for r in runs))}

    def median(key):
        values = [r[key] for r in runs if r.get(key)]
        return round(statistics.median(values), 3) if values else None

    evidence = list(worst["evidence"])
    if len(runs) > 1:
        evidence.insert(0, f"{len(runs)} runs: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return {"verdict": worst["verdict"], "evidence": evidence, "gbps": median("gbps"),
            "staged_gbps": median("staged_gbps"), "seconds": round(sum(r["seconds"] or 0 for r in runs), 3),
            "runs": len(runs), "counts": counts, "probes": worst["probes"]}


def _mark_slow(pairs, fraction):
    """A verdict of "slow" for ok pairs under ``fraction`` of the median GB/s of their class."""
    classes = {}
    for p in pairs:
        if p["verdict"] == "ok" and p["gbps"]:
            classes.setdefault(_pair_class(p["src"], p["dst"]), []).append(p)
    for cls, members in classes.items():
        if len(members) < 2:
            continue
        median = statistics.median(p["gbps"] for p in members)
        for p in members:
            if p["gbps"] < fraction * median:
                p["verdict"] = "slow"
                p["evidence"].append(f"{p['gbps']:.1f} GB/s is under {fraction:g} x the median {median:.1f} GB/s "
                                     f"of {len(members)} {cls} pairs")


def _apply_floors(pairs, machine, floors, large):
    """Each pair's absolute floor (pyxfer.tools.floors) and a verdict of "slow" for an ok or slow pair
    under it; none below floors.MIN_BYTES (a smaller copy does not reach the link's rate)."""
    names = {g["index"]: g["name"] for g in machine["gpus"]}
    for p in pairs:
        p["floor_gbps"] = p["floor_source"] = None
        gpus_of = [i for i in (_index(p["src"]), _index(p["dst"])) if i is not None]
        if large < MIN_FLOOR_BYTES or p["path"] not in FLOOR_PATHS or not gpus_of:
            continue
        gbps, source = floor_for(p["path"], [names[i] for i in gpus_of],
                                 [machine["pcie"].get(i) for i in gpus_of], floors)
        p["floor_gbps"], p["floor_source"] = gbps, source
        if gbps is not None and p["gbps"] and p["gbps"] < gbps and p["verdict"] in ("ok", "slow"):
            p["verdict"] = "slow"
            p["evidence"].append(f"{p['gbps']:.1f} GB/s is under the floor of {gbps:g} GB/s for {p['path']} "
                                 f"({source})")


def _link_errors(pair, rises):
    """{"cuda:i counter": rise} of the counters that rose on the pair's GPUs and concern its path (NVLink
    counters for NVLink paths, PCIe replays for PCIe and host paths; both where the link is not known). A
    GPU's counters cover all its links, so a rise is reported against every pair of the GPU on that kind."""
    nvlink = pair["path"] in ("nvlink", "peer")
    pcie = pair["path"] in ("pcie", "peer", "host", "none")
    out = {}
    for i in {_index(pair["src"]), _index(pair["dst"])} - {None}:
        for name, rise in rises.get(i, {}).items():
            if (nvlink and name.startswith("nvlink")) or (pcie and name.startswith("pcie")):
                out[f"cuda:{i} {name}"] = rise
    return dict(sorted(out.items()))


def finish_pairs(pairs, machine, *, floors, large, slow_fraction, rises):
    """Complete the pairs' results (src, dst, verdict, evidence, gbps, staged_gbps) with the machine's
    description ``machine`` ({"gpus": [{index, name}], "peer_access", "links": {(i, j): kind},
    "pcie": {i: {gen, width}}}): path, "slow" against the median and the floors, the p2p-vs-staged note,
    the link error counters that rose (``rises``: links.counter_rises) and the advice."""
    for p in pairs:
        p["path"] = pair_path(p["src"], p["dst"], machine)
    _mark_slow(pairs, slow_fraction)
    _apply_floors(pairs, machine, floors, large)
    for p in pairs:
        problems = []
        if p["verdict"] != "ok":
            problems.append("fault" if p["verdict"] in ("corrupt", "dropped") else p["verdict"])
        p["notes"] = []
        if p["path"] in ("nvlink", "pcie", "peer") and p["gbps"] and p["staged_gbps"] \
                and p["gbps"] < p["staged_gbps"]:
            p["notes"].append("p2p slower than staged")
            p["evidence"].append(f"p2p slower than staged: {p['gbps']:.1f} GB/s direct, {p['staged_gbps']:.1f} "
                                 f"GB/s through host memory")
            problems.append("p2p-slower-than-staged")
        p["link_errors"] = _link_errors(p, rises)
        if p["link_errors"]:
            p["evidence"].append("link error counters rose during the probes: "
                                 + ", ".join(f"{k} +{v}" for k, v in p["link_errors"].items()))
            problems.append("link-errors")
        p["advice"] = list(dict.fromkeys(line for problem in problems for line in advice(p["path"], problem)))


def _counters_check(before, after, rises):
    """The report's check of the link error counters read before and after the probes."""
    if not (before["available"] and after["available"]):
        return SKIP, f"unavailable: {before['why'] or after['why']}"
    if rises:
        return FAIL, "rose during the probes: " + "; ".join(
            f"cuda:{i} " + ", ".join(f"{n} +{r}" for n, r in sorted(up.items())) for i, up in sorted(rises.items()))
    names = sorted({n for c in after["gpus"].values() for n in c})
    if not names:
        return OK, f"no GPU reports them ({len(after['gpus'])} GPUs)"
    # the counters no GPU reports are named: a reader must not take "no rise" for NVLink it was never told
    unread = [n for n in COUNTERS if n not in names]
    return OK, (f"no rise on {len(after['gpus'])} GPUs ({', '.join(names)})"
                + (f"; not reported by any GPU here: {', '.join(unread)}" if unread else ""))


def _fault_matches(fault, src, dst):
    """Whether the fault parsed from $PYXFER_INJECT_FAULT can hit copies from src to dst. Its devices
    are read as the probes' pyxfer reads them when it arms the fault ('cuda': the current device)."""
    def same(value, dev):
        if value is None:
            return True
        try:
            return str(as_device("pyxfer doctor", "PYXFER_INJECT_FAULT", value)) == dev
        except (TypeError, ValueError):
            return False  # the probes' pyxfer refuses it (a warning at import): no fault is armed there
    return fault["path"] != "gather" and same(fault["src"], src) and same(fault["dst"], dst)


def _endpoint(text, names):
    """The device ``text`` names ('cuda' is the current device), as in ``names``, or None."""
    try:
        d = str(as_device("pyxfer doctor", "--pairs", text))
    except (TypeError, ValueError):
        return None
    return d if d in names else None


def select_pairs(devices, spec=None):
    """Ordered pairs to probe: host <-> each GPU and every GPU pair (cpu -> cpu without GPUs), or
    those named by ``spec`` ("cpu->cuda:0,cuda:0->cuda:1"). Raises ValueError for a malformed,
    unknown or repeated pair."""
    names = ["cpu"] + [f"cuda:{g['index']}" for g in devices]
    if spec is None:
        if not devices:
            return [("cpu", "cpu")]
        return [(a, b) for a in names for b in names if a != b]
    return parse_pairs(spec, lambda text: _endpoint(text, names),
                       expected=f"SRC->DST[,SRC->DST...] with devices from {names}")


def doctor(report: Report, *, pairs=None, timeout=30.0, large=256 * MIB, slow_fraction=0.5, floors=None,
           repeat=1, duration=0.0):
    """Fill ``report``: facts, self-checks, and a verdict per pair in ``pairs`` (select_pairs), each probed in
    ``repeat`` rounds or more, until ``duration`` seconds have passed. ``floors``: pyxfer.tools.floors
    (default: the built-in ones)."""
    from .. import __version__
    from .._build import build_info

    start = time.perf_counter()
    info = build_info()
    report.section("build", {"pyxfer": __version__, **info})
    report.section("system", {"python": platform.python_version(), "platform": platform.platform(),
                              "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                              "driver": driver_version()})
    devices = gpus()
    uuids = [g["uuid"] for g in devices]
    report.section("gpus", devices)
    peer_access = peer_matrix(len(devices))
    report.section("peer_access", peer_access)
    none = {"available": False, "why": "no GPUs visible", "links": {}, "pcie": {}, "gpus": {}}
    facts = nvml_facts(uuids) if devices else none
    report.section("links", {"nvml": facts["available"], "why": facts["why"],
                             "pcie": {f"cuda:{i}": v for i, v in sorted(facts["pcie"].items())},
                             "kinds": {f"cuda:{i}->cuda:{j}": k for (i, j), k in sorted(facts["links"].items())}})
    result, fault = _env_fault_check()
    report.checks.append(run_check("PYXFER_INJECT_FAULT", lambda: result))
    report.section("injected_fault", fault)
    report.check("PYXFER_* environment", _environment_check)
    report.check("build matches torch", lambda: _torch_match_check(info))
    report.check("CUDA build", lambda: _cuda_build_check(info, devices))
    report.check("checksum vectors on cpu", lambda: _vector_check("cpu"))
    report.check("formats reference values on cpu", lambda: _format_vector_check("cpu"))

    pairs = select_pairs(devices) if pairs is None else pairs
    checks = [{"kind": "checks", "index": g["index"]} for g in devices] if devices and info["cuda"] else []
    before = read_counters(uuids) if devices else none
    runs = {pair: [] for pair in pairs}
    rounds = 0
    while True:
        todo = [pair for pair in pairs if not any(r["verdict"] == "hung" for r in runs[pair])]  # a hang costs
        if not todo or (rounds >= repeat and time.perf_counter() - start >= duration):      # --timeout each
            break
        tasks = list(checks) if rounds == 0 else []
        for src, dst in todo:
            size_large = large if "cuda" in src + dst else min(large, 16 * MIB)
            tasks.append({"kind": "pair", "src": src, "dst": dst, "sizes": sorted({SMALL, 4 * MIB, size_large}),
                          "seed": int.from_bytes(os.urandom(4), "little")})
        for task, res in zip(tasks, run_tasks(tasks, timeout)):
            if task["kind"] == "checks":
                _add_device_checks(report, task, res)
            else:
                runs[(task["src"], task["dst"])].append(_run_result(res, timeout))
        rounds += 1
    check, collective = _collective_probes(devices, pairs, timeout, info)
    if check is not None:
        report.checks.append(run_check("NCCL collective per GPU pair", lambda: check))
    after = read_counters(uuids) if devices else none
    rises = counter_rises(before, after)
    report.checks.append(run_check("link error counters", lambda: _counters_check(before, after, rises)))
    report.section("counters", {"available": before["available"] and after["available"],
                                "why": before["why"] or after["why"],
                                "before": {f"cuda:{i}": c for i, c in before["gpus"].items()},
                                "after": {f"cuda:{i}": c for i, c in after["gpus"].items()},
                                "rises": {f"cuda:{i}": c for i, c in rises.items()}})
    for (src, dst), pair_runs in runs.items():
        report.pairs.append({"src": src, "dst": dst, **_combine(pair_runs),
                             "fault_from_env": fault is not None and _fault_matches(fault, src, dst)})
        _add_collective(report.pairs[-1], collective.get((src, dst)))
    machine = {"gpus": devices, "peer_access": peer_access, "links": facts["links"], "pcie": facts["pcie"]}
    floors = load_floors() if floors is None else floors
    finish_pairs(report.pairs, machine, floors=floors, large=large, slow_fraction=slow_fraction, rises=rises)
    report.section("rounds", rounds)
    could = any(p["path"] in FLOOR_PATHS for p in report.pairs)
    report.section("floors", {"applied": could and large >= MIN_FLOOR_BYTES, "count": len(floors),
                              "note": f"not applied: --large {large} B is under {MIN_FLOOR_BYTES >> 20} MiB"
                              if could and large < MIN_FLOOR_BYTES else None})
    report.section("seconds", round(time.perf_counter() - start, 2))


def _collective_probes(devices, pairs, timeout, info):
    """(the check's (status, detail) or None when no GPU pair is probed, {(src, dst): probe}) of one NCCL
    all-gather per GPU pair (pyxfer.tools.pair_collectives), the transport NCCL's users rely on."""
    from .pair_collectives import BYTES, collectives_unavailable, run_pair_collectives

    gpu_pairs = [(a, b) for a, b in pairs if "cpu" not in (a, b) and a != b]
    if not gpu_pairs:
        return None, {}
    why = collectives_unavailable("nccl") or (None if info["cuda"] else "pyxfer is built without CUDA")
    if why:
        return (SKIP, f"unavailable: {why}"), {}
    labels = [f"cuda:{g['index']}" for g in devices]
    rank = {label: i for i, label in enumerate(labels)}
    probes = run_pair_collectives(labels, [(rank[a], rank[b]) for a, b in gpu_pairs], backend="nccl",
                                  devices=[g["index"] for g in devices], timeout=timeout,
                                  seed=int.from_bytes(os.urandom(4), "little"))
    bad = [f"{a} -> {b} {p['result']}" for (a, b), p in sorted(probes.items()) if p["result"] != "ok"]
    if bad:
        return (FAIL, "; ".join(bad)), probes
    return (OK, f"{len(probes)} directions of GPU pairs exact ({BYTES} B each way, a 2-rank all-gather)"), probes


def _add_collective(pair, probe):
    """Add a pair's collective probe to its result: a wrong or missing result is the pair's verdict when
    it is worse than the copies'."""
    if probe is None:
        return
    pair["probes"].append(probe)
    if probe["result"] == "ok":
        return
    where = (f", first wrong byte at offset {probe['first_offset']}, {probe['wrong_bytes']} wrong"
             if "first_offset" in probe else f": {probe.get('detail', '')}")
    pair["evidence"].append(f"NCCL all-gather of the pair, {probe['bytes']} B each way: {probe['result']}{where}")
    if SEVERITY.index(probe["result"]) > SEVERITY.index(pair["verdict"]):
        pair["verdict"] = probe["result"]


def _add_device_checks(report, task, res):
    if "checks" in res:
        report.checks.extend(res["checks"])
    else:
        why = "did not finish in time (hung)" if res.get("hung") else res["error"]
        report.checks.append({"check": f"self-checks of cuda:{task['index']}", "status": FAIL,
                              "detail": why, "seconds": res["seconds"] if "seconds" in res else None})


def _run_result(res, timeout):
    """One run of a pair as {verdict, evidence, gbps, staged_gbps, seconds, probes}, hangs and errors included."""
    if res.get("hung"):
        return {"verdict": "hung", "gbps": None, "staged_gbps": None, "probes": [], "seconds": res["seconds"],
                "evidence": [f"the probe did not finish in {timeout:g} s; its process was killed"]}
    if "error" in res:
        return {"verdict": "error", "gbps": None, "staged_gbps": None, "probes": [], "seconds": res.get("seconds"),
                "evidence": [res["error"]]}
    return {k: res[k] for k in ("verdict", "evidence", "gbps", "staged_gbps", "seconds", "probes")}


def print_report(report: Report, out=None):
    out = sys.stdout if out is None else out
    b, s = report.sections["build"], report.sections["system"]
    print(f"pyxfer {b['pyxfer']}  (built against torch {b['torch']}, "
          f"CUDA {'on: ' + b['cuda_version'] + ' ' + ','.join(b['cuda_archs']) if b['cuda'] else 'off'})", file=out)
    print(f"python {s['python']}  torch {s['torch']}  torch CUDA {s['torch_cuda'] or '-'}  "
          f"driver {s['driver'] or '-'}  ({s['platform']})", file=out)
    devices = report.sections["gpus"]
    links = report.sections["links"]
    if not devices:
        print("GPUs: none visible", file=out)
    for g in devices:
        pcie = links["pcie"].get(f"cuda:{g['index']}")
        print(f"  cuda:{g['index']}  {g['name']}  sm_{g['capability'].replace('.', '')}  "
              f"{g['memory_gib']} GiB  {g['sms']} SMs  {g['uuid'] or ''}"
              + (f"  PCIe gen {pcie['gen']} x{pcie['width']}" if pcie else ""), file=out)
    if len(devices) > 1:
        print("peer access (row = source, column = destination; NV: NVLink, PCI: PCIe, yes: kind unknown):",
              file=out)
        print("        " + "".join(f"{j:>6}" for j in range(len(devices))), file=out)
        for i, row in enumerate(report.sections["peer_access"]):
            cells = ["-" if v is None else {"nvlink": "NV", "pcie": "PCI"}.get(
                links["kinds"].get(f"cuda:{i}->cuda:{j}"), "yes") if v else "no" for j, v in enumerate(row)]
            print(f"  {i:>6}" + "".join(f"{c:>6}" for c in cells), file=out)
    if devices and not links["nvml"]:
        print(f"link kinds and PCIe links: {links['why']}", file=out)
    print("checks:", file=out)
    for c in report.checks:
        print(f"  [{c['status']:>4}] {c['check']}: {c['detail']}", file=out)
    fault = report.sections.get("injected_fault")
    rounds = report.sections.get("rounds", 1)
    print("pairs:" + (f" ({rounds} rounds of probes)" if rounds > 1 else ""), file=out)
    width = max((len(f"{p['src']} -> {p['dst']}") for p in report.pairs), default=0)
    for p in report.pairs:
        rate = f"{p['gbps']:8.1f} GB/s" if p["gbps"] else " " * 13
        print(f"  {p['src'] + ' -> ' + p['dst']:<{width}}  {p['verdict']:<11} {rate}  {p['path']:<6}  "
              f"{'; '.join(p['evidence'])}", file=out)
        if p["fault_from_env"] and p["verdict"] != "ok":
            print(f"  {'':<{width}}  ^ a fault is armed from PYXFER_INJECT_FAULT={fault['spec']!r}: "
                  f"this verdict can be its doing", file=out)
        for line in p["advice"]:
            print(f"  {'':<{width}}  next: {line}", file=out)
    floors = report.sections.get("floors")
    if floors and floors["note"]:
        print(f"bandwidth floors {floors['note']}", file=out)
    n_fail, n_bad = len(report.failed), len(report.bad_pairs)
    print(f"{len(report.checks) - n_fail} checks passed or skipped, {n_fail} failed; "
          f"{len(report.pairs) - n_bad} of {len(report.pairs)} pairs ok  ({report.sections['seconds']} s)", file=out)
    cache = report.sections.get("cache")
    if cache:
        print(f"verdict cache: {cache['note']}", file=out)


def _save_cache(report, args):
    """The report's "cache" section: the verdicts written to the cache unless --no-cache or a fault armed
    from the environment."""
    from .verdict_cache import save_verdicts

    cache = {"path": None, "written": False, "note": "not written (--no-cache)"}
    if report.sections["injected_fault"] is not None:
        cache["note"] = "not written: a fault is armed from PYXFER_INJECT_FAULT"
    elif not args.no_cache:
        try:
            cache["path"] = save_verdicts(report.pairs, args.cache)
            cache.update(written=True, note=f"written to {cache['path']} (load: pyxfer.health.load_doctor_verdicts() "
                                            f"or PYXFER_HEALTH_FROM_DOCTOR=1)")
        except OSError as e:
            cache["note"] = f"not written: {e}"
    report.section("cache", cache)


def _cached_document(args):
    """The verdict cache's document when --env may use it (not --no-cache; made on this machine), else None
    (why on stderr)."""
    from .verdict_cache import cache_path, key_differences, read_cache

    path = cache_path(args.cache)
    if args.no_cache or not os.path.exists(path):
        return None
    try:
        doc = read_cache(path)
    except (OSError, ValueError) as e:
        print(f"# pyxfer doctor --env: the cache {path} is not a verdict cache ({e}): probing", file=sys.stderr)
        return None
    differs = key_differences(doc)
    if differs:
        print(f"# pyxfer doctor --env: the cache {path} was made under another key ({'; '.join(differs)}): probing",
              file=sys.stderr)
        return None
    return doc


def run(args) -> int:
    """`pyxfer doctor` with parsed ``args`` (see cli.py). Returns the exit code."""
    from .exports import exports
    from .verdict_cache import cache_document, cache_path

    if args.env and args.json:
        print("pyxfer doctor: --env prints shell exports, --json a report: expected one of them", file=sys.stderr)
        return 2
    try:
        floors = load_floors(args.floors)
    except (OSError, ValueError) as e:
        print(f"pyxfer doctor: {e if isinstance(e, ValueError) else f'--floors: {e}'}", file=sys.stderr)
        return 2
    report = Report()
    devices = gpus()
    try:
        pairs = select_pairs(devices, args.pairs)
    except ValueError as e:
        print(f"pyxfer doctor: {e}", file=sys.stderr)
        return 2
    doc = _cached_document(args) if args.env else None
    if doc is not None:
        text, vetoed = exports(doc, cache_path(args.cache), cache_path())
        print(f"# verdicts from the cache {cache_path(args.cache)} (made {time.ctime(doc['created'])})")
        print(text, end="")
        return 1 if vetoed else 0
    doctor(report, pairs=pairs, timeout=args.timeout, large=args.large, slow_fraction=args.slow_fraction,
           floors=floors, repeat=args.repeat, duration=args.duration)
    _save_cache(report, args)
    if args.env:
        n_fail, n_bad = len(report.failed), len(report.bad_pairs)
        print(f"# pyxfer doctor: {n_fail} checks failed, {n_bad} of {len(report.pairs)} pairs not ok "
              f"({report.sections['seconds']} s); verdict cache: {report.sections['cache']['note']}", file=sys.stderr)
        text, vetoed = exports(cache_document(report.pairs), report.sections["cache"]["path"], cache_path())
        print(text, end="")
        return 1 if vetoed or not report.as_json()["ok"] else 0
    if args.json:
        json.dump(report.as_json(), sys.stdout, indent=2)
        print()
    else:
        print_report(report)
    return 0 if report.as_json()["ok"] else 1
