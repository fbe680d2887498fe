"""Command line: `pyxfer doctor` (also `python -m pyxfer doctor`).

doctor prints the build facts, the torch/CUDA/driver versions, the GPUs, the peer-access matrix, a
checksum self-test (spec vectors on the CPU and on every GPU, CPU == GPU on random data) and a
transfer check for every ordered GPU pair (and CPU <-> each GPU): a verified copy, then one with a bit
flipped on the direct path that must be detected and repaired. Every check
is run even when an earlier one fails; the exit code is 1 when any check failed. --json prints one
JSON document instead of the report.
"""
import argparse
import ctypes
import json
import platform
import sys
import time

import torch

OK, FAIL, SKIP = "ok", "FAIL", "skip"


class Report:
    def __init__(self):
        self.sections = {}
        self.checks = []

    def section(self, name, value):
        self.sections[name] = value

    def check(self, name, fn):
        """Run fn() -> (status, detail); any exception is a failed check, never a crash."""
        start = time.perf_counter()
        try:
            status, detail = fn()
        except Exception as e:  # noqa: BLE001  (a doctor reports what broke and carries on)
            status, detail = FAIL, f"{type(e).__name__}: {e}"
        self.checks.append({"check": name, "status": status, "detail": detail,
                            "seconds": round(time.perf_counter() - start, 3)})

    @property
    def failed(self):
        return [c for c in self.checks if c["status"] == FAIL]


def driver_version():
    """CUDA driver version as 'major.minor' (from libcuda), or None where there is no driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
        return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        return None


def gpus():
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count})
    return out


def peer_matrix(n):
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
            for i in range(n)]


def _verdict(bad, ok_detail):
    """A self-check's result: FAIL listing what went wrong, else OK with ``ok_detail``."""
    return (FAIL, "; ".join(bad)) if bad else (OK, ok_detail)


def _vector_check(device):
    from ._selftest import check_vectors

    results = check_vectors(device)
    bad = [f"{name}: got {got:016x}, expected {exp:016x}" for name, ok, got, exp in results if not ok]
    return _verdict(bad, f"{len(results)} spec vectors match")


def _agreement_check(device):
    from ._selftest import check_agreement

    results = check_agreement(device)
    bad = [f"{name}: cpu {a:016x} != {device} {b:016x}" for name, ok, a, b in results if not ok]
    return _verdict(bad[:5], f"{len(results)} random buffers (every alignment mod 16) agree")


def _format_vector_check(device):
    from ._selftest import check_format_vectors

    results = check_format_vectors(device)
    bad = [f"{name}: got {got}, expected {exp}" for name, ok, got, exp in results if not ok]
    return _verdict(bad, f"{len(results)} worked examples of the spec match")


def _format_agreement_check(device):
    from ._selftest import check_format_agreement

    results = check_format_agreement(device)
    bad = [f"{fmt}: {detail} differ" for fmt, ok, detail in results if not ok]
    return _verdict(bad, f"{len(results)} formats x both usages bit-identical")


def _transfer_check(src, dst, num_bytes=16 << 20):
    """A verified copy src -> dst on fresh data, then one with a bit flipped on the direct path:
    the flip must be detected and repaired through the staged path. The pair's health is restored."""
    from . import health, testing
    from .transfer import verified_copy

    before = health.status(src, dst)
    try:
        health.mark(src, dst, "unknown")
        gen = torch.Generator().manual_seed(int(time.time()))
        data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen).to(src)
        verified_copy(data, dst)  # warm-up: peer access, streams, pools
        health.mark(src, dst, "unknown")
        start = time.perf_counter()
        out = verified_copy(data, dst)
        seconds = time.perf_counter() - start
        if health.status(src, dst) == "corrupt":
            return FAIL, (f"corrupt: the direct path wrote wrong bytes ({num_bytes >> 20} MiB); pyxfer repaired it "
                          f"through the staged path, but plain copies of this pair are not safe")
        if not torch.equal(out.cpu(), data.cpu()):
            return FAIL, "a verified copy returned wrong bytes"
        route = "direct" if health.status(src, dst) == "healthy" else "staged"
        with testing.inject_fault("bitflip", src=src, dst=dst, path="direct") as fault:
            repaired = verified_copy(data, dst)
        detected = fault.used == 1 and health.status(src, dst) == "corrupt"
        if not (detected and torch.equal(repaired.cpu(), data.cpu())) and route == "direct":
            return FAIL, "an injected bit flip on the direct path was not detected and repaired"
        note = "injected bit flip detected, repaired via staged" if route == "direct" else "no direct path (staged)"
        return OK, f"{num_bytes >> 20} MiB verified {route} in {seconds * 1e3:.2f} ms ({num_bytes / seconds / 1e9:.1f} GB/s); {note}"
    finally:
        health.mark(src, dst, before)


def _arch_check(info, gpu):
    archs = [int(a[3:]) for a in info["cuda_archs"]]
    cc = int(gpu["capability"].replace(".", ""))
    if cc in archs:
        return OK, f"sm_{cc} machine code in the build"
    if archs and max(archs) < cc:
        return OK, f"no sm_{cc} machine code; runs from sm_{max(archs)} PTX (JIT at first use)"
    return FAIL, f"built for {info['cuda_archs']}, which cannot run on sm_{cc}: rebuild with PYXFER_CUDA_ARCHS={cc}"


def doctor(report: Report):
    from . import __version__
    from ._build import build_info

    info = build_info()
    report.section("build", {"pyxfer": __version__, **info})
    report.section("system", {"python": platform.python_version(), "platform": platform.platform(),
                              "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                              "driver": driver_version()})
    devices = gpus()
    report.section("gpus", devices)
    report.section("peer_access", peer_matrix(len(devices)) if devices else [])

    def torch_match():
        built, runtime = info["torch"], torch.__version__.split("+")[0]
        if built != runtime:
            return FAIL, f"built against torch {built}, running torch {runtime}: rebuild pyxfer"
        return OK, f"built against torch {built}"

    report.check("build matches torch", torch_match)

    def cuda_build():
        if not devices:
            return SKIP, "no CUDA GPU visible: GPU checks skipped, CPU checks run"
        if not info["cuda"]:
            return FAIL, "GPUs are visible but pyxfer was built without CUDA (CPU torch or no nvcc at build time)"
        return OK, f"CUDA {info['cuda_version']} build for {', '.join(info['cuda_archs'])}"

    report.check("CUDA build", cuda_build)
    report.check("checksum vectors on cpu", lambda: _vector_check("cpu"))
    report.check("formats reference values on cpu", lambda: _format_vector_check("cpu"))
    report.check("transfer cpu -> cpu", lambda: _transfer_check("cpu", "cpu", 4 << 20))
    if devices and info["cuda"]:
        for gpu in devices:
            dev = f"cuda:{gpu['index']}"
            report.check(f"architecture of {dev}", lambda gpu=gpu: _arch_check(info, gpu))
            report.check(f"checksum vectors on {dev}", lambda dev=dev: _vector_check(dev))
            report.check(f"checksum cpu == {dev}", lambda dev=dev: _agreement_check(dev))
            report.check(f"formats reference values on {dev}", lambda dev=dev: _format_vector_check(dev))
            report.check(f"formats cpu == {dev}", lambda dev=dev: _format_agreement_check(dev))
            report.check(f"transfer cpu -> {dev}", lambda dev=dev: _transfer_check("cpu", dev))
            report.check(f"transfer {dev} -> cpu", lambda dev=dev: _transfer_check(dev, "cpu"))
        for a in devices:
            for b in devices:
                if a is not b:
                    src, dst = f"cuda:{a['index']}", f"cuda:{b['index']}"
                    report.check(f"transfer {src} -> {dst}", lambda src=src, dst=dst: _transfer_check(src, dst))


def print_report(report: Report, out=sys.stdout):
    b, s = report.sections["build"], report.sections["system"]
    print(f"pyxfer {b['pyxfer']}  (built against torch {b['torch']}, "
          f"CUDA {'on: ' + b['cuda_version'] + ' ' + ','.join(b['cuda_archs']) if b['cuda'] else 'off'})", file=out)
    print(f"python {s['python']}  torch {s['torch']}  torch CUDA {s['torch_cuda'] or '-'}  "
          f"driver {s['driver'] or '-'}  ({s['platform']})", file=out)
    devices = report.sections["gpus"]
    if not devices:
        print("GPUs: none visible", file=out)
    for g in devices:
        print(f"  cuda:{g['index']}  {g['name']}  sm_{g['capability'].replace('.', '')}  "
              f"{g['memory_gib']} GiB  {g['sms']} SMs", file=out)
    if len(devices) > 1:
        print("peer access (row = source, column = destination):", file=out)
        print("        " + "".join(f"{j:>6}" for j in range(len(devices))), file=out)
        for i, row in enumerate(report.sections["peer_access"]):
            print(f"  {i:>6}" + "".join(f"{'-' if v is None else ('yes' if v else 'no'):>6}" for v in row), file=out)
    print("checks:", file=out)
    for c in report.checks:
        print(f"  [{c['status']:>4}] {c['check']}: {c['detail']}", file=out)
    n_fail = len(report.failed)
    print(f"{len(report.checks) - n_fail} passed, {n_fail} failed" if n_fail else
          f"all {len(report.checks)} checks passed or skipped", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="pyxfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_doctor = sub.add_parser("doctor", help="check the build, the GPUs and pyxfer's ops on them")
    p_doctor.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    report = Report()
    doctor(report)
    if args.json:
        json.dump({**report.sections, "checks": report.checks, "ok": not report.failed}, sys.stdout, indent=2)
        print()
    else:
        print_report(report)
    return 1 if report.failed else 0
