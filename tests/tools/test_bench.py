"""`pyxfer bench` on the CPU, end to end: matrices, the --json schema, the PNG, --compare, a corrupting
path reported without stopping the bench; the shared timing helpers; the CLI's arguments. Then the
paths that run does not take, through the CLI and the public functions (a deferred-verification row
that corrupts, corrupt rows in the report and the exit code, the ratios of a partial mode list,
progress without tqdm, --plot without matplotlib, the report of a GPU document, validate's
messages); and the options, checked before anything is measured (exit 2, one line naming the option
and what was expected, no traceback), with a finished run never lost (an output that cannot be
written after the measurement is reported and the run saved elsewhere)."""
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import pyxfer
from pyxfer.testing import inject_fault
from pyxfer.tools import bench
from pyxfer.tools.cli import _size, main
from pyxfer.tools.timing import Samples, cpu_samples, cpu_time_ms, fmt_gbps, fmt_size

from support.tool_schemas import check_bench_schema

SIZES = [4096, 65536 + 3]  # an odd size too
N = 4099  # odd, one size: fast on a shared CPU
# Where a GPU is visible the bench measures GPU rows instead (test_bench_gpu.py covers those runs).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rows run where no GPU is visible")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU bench run through the CLI: (exit code, stdout, stderr, JSON document, PNG path)."""
    d = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "pyxfer", "bench", "--sizes", ",".join(map(str, SIZES)), "--reps", "3",
           "--warmup", "1", "--json", str(d / "b.json")]
    if importlib.util.find_spec("matplotlib") is not None:  # --plot is an optional extra: see test_cpu_run_png
        cmd += ["--plot", str(d / "b.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    doc = json.loads((d / "b.json").read_text()) if (d / "b.json").exists() else None
    return r.returncode, r.stdout, r.stderr, doc, d / "b.png"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rows run where no GPU is visible")
def test_cpu_run_end_to_end(cpu_run):
    code, out, err, doc, png = cpu_run
    assert code == 0, out + err
    assert "no CUDA GPU visible: measuring host memcpy, checksum and CPU verified / staged copies only" in err
    check_bench_schema(doc)
    assert not doc["gpu"] and doc["config"]["rows"] == [["cpu", "cpu"]]
    assert doc["config"]["sizes"] == SIZES and doc["config"]["matrix_size"] == SIZES[-1]
    got = {(r["mode"], r["bytes"]) for r in doc["results"]}
    assert got == {(m, n) for m in ("ce", "staged", "verified", "verified_deferred") for n in SIZES}
    assert all(r["check"] == "ok" and not r["held"] for r in doc["results"])  # every destination checked
    assert {r["ratio"] for r in doc["ratios"]} == {"verified/ce", "staged/ce"}
    by = {(r["mode"]): r["gbps"] for r in doc["results"] if r["bytes"] == SIZES[-1]}
    ratio = {r["ratio"]: r["value"] for r in doc["ratios"]}
    assert ratio["verified/ce"] == pytest.approx(by["verified"] / by["ce"], rel=1e-3)
    assert {c["device"] for c in doc["checksum"]} == {"cpu"} and doc["method_check"] == [] and doc["corrupt"] == []
    for title in ("ce GB/s at 64.0029 KiB", "verified/ce at 64.0029 KiB", "staged/ce at 64.0029 KiB", "latency, us",
                  "size sweep"):
        assert title in out
    assert "checksum (PXH64) GB/s: cpu " in out
    assert "pyxfer bench" in err  # progress on stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rows run where no GPU is visible")
def test_cpu_run_png(cpu_run):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test and bench extras bring it)")
    data = cpu_run[4].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # matplotlib drew the heatmaps


@pytest.mark.skipif(torch.cuda.is_available(), reason="compares the CPU-only run")
def test_compare_flags_an_injected_slowdown(cpu_run, tmp_path):
    doc = cpu_run[3]
    old = json.loads(json.dumps(doc))
    slowed = next(r for r in old["results"] if r["mode"] == "verified" and r["bytes"] == SIZES[-1])
    slowed["gbps"] *= 100  # the old run was 100x faster on this point: the new one is a slowdown
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert bench.compare(doc, old, 0.10) == [{"src": "cpu", "dst": "cpu", "mode": "verified", "bytes": SIZES[-1],
                                              "old_gbps": slowed["gbps"],
                                              "new_gbps": pytest.approx(slowed["gbps"] / 100),
                                              "ratio": pytest.approx(0.01, rel=1e-3)}]
    assert bench.compare(doc, doc, 0.10) == []  # the same figures: nothing slower
    cmd = [sys.executable, "-m", "pyxfer", "bench", "--sizes", str(SIZES[-1]), "--modes", "verified", "--reps", "2",
           "--warmup", "1", "--no-progress", "--compare", str(tmp_path / "old.json"),
           "--json", str(tmp_path / "n.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "points slower by more than 10%" in r.stdout
    assert "SLOWER cpu -> cpu verified 64.0029 KiB" in r.stdout
    new = json.loads((tmp_path / "n.json").read_text())
    check_bench_schema(new)
    assert [s["mode"] for s in new["compare"]["slower"]] == ["verified"] and new["compare"]["threshold"] == 0.10


def test_compare_rejects_what_is_not_a_bench_document(tmp_path, capsys):
    (tmp_path / "doctor.json").write_text(json.dumps({"schema": "pyxfer.doctor", "schema_version": 2}))
    assert main(["bench", "--compare", str(tmp_path / "doctor.json")]) == 2
    assert "not a pyxfer.bench document (schema 'pyxfer.doctor')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="schema_version 0, expected 2$"):
        bench.validate({"schema": "pyxfer.bench", "schema_version": 0})
    with pytest.raises(ValueError, match="schema_version 1, expected 2$"):  # a run's own document: this version
        bench.validate({"schema": "pyxfer.bench", "schema_version": 1})
    with pytest.raises(ValueError, match="schema_version 0, expected 2 or 1$"):
        bench.validate({"schema": "pyxfer.bench", "schema_version": 0}, older=True)


def test_compare_reads_a_version_1_document(cpu_run):
    """--compare reads the previous schema: its modes are checked against that version's (its "sm",
    torch's push kernel, is a mode of version 1 only and matches no point of a version 2 run)."""
    doc = cpu_run[3]
    old = json.loads(json.dumps(doc))
    old["schema_version"] = 1
    point = dict(old["results"][0], mode="sm", gbps=1e6)
    old["results"].append(point)
    bench.validate(old, older=True)
    assert bench.compare(doc, old, 0.10) == []
    old["results"].append(dict(point, mode="sm_pull"))  # a version 2 mode in a version 1 document
    with pytest.raises(ValueError, match="malformed result"):
        bench.validate(old, older=True)


def test_a_corrupting_path_is_reported_and_the_bench_carries_on():
    # every staged copy writes one wrong bit: each point's destination check must catch it
    with inject_fault("bitflip", path="staged", times=10**6):
        results, latency, sums, _ = bench.measure_all([("cpu", "cpu")], ["ce", "staged", "verified"], [4099],
                                                      reps=2, warmup=0, progress=False)
    by = {r["mode"]: r for r in results}
    assert by["staged"]["check"] == "corrupt" and by["staged"]["gbps"] > 0
    detail = by["staged"]["detail"]
    assert detail.startswith("cpu: PXH64 0x") and "1 wrong bytes, the first at offset" in detail
    assert by["ce"]["check"] == "ok" and by["verified"]["check"] == "ok"  # the rest measured and right
    assert len(latency) == 1 and len(sums) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a row whose buffers cannot be made: pinned memory "
                                                   "without CUDA")
def test_a_row_whose_setup_raises_is_reported_and_the_bench_carries_on():
    # pinned host memory needs CUDA: on this machine the pinned row's _Point cannot be built at all
    try:
        torch.empty(1, pin_memory=True)
        pytest.skip("this torch pins host memory without CUDA")
    except RuntimeError as e:
        why = f"RuntimeError: {e}".splitlines()[0][:300]
    results, latency, sums, _ = bench.measure_all([("pinned", "cpu"), ("cpu", "cpu")], ["ce", "staged"], [4099],
                                                  reps=2, warmup=0, progress=False)
    by = {(r["src"], r["mode"]): r for r in results}
    assert sorted(by) == [("cpu", "ce"), ("cpu", "staged"), ("pinned", "ce"), ("pinned", "staged")]
    for mode in ("ce", "staged"):
        failed = by["pinned", mode]
        assert (failed["check"], failed["detail"], failed["gbps"], failed["reps"]) == ("error", why, None, 0)
        assert by["cpu", mode]["check"] == "ok" and by["cpu", mode]["gbps"] > 0  # the next row still measured
    lat = {r["src"]: r for r in latency}
    assert (lat["pinned"]["median_us"], lat["pinned"]["detail"]) == (None, why)
    assert lat["cpu"]["median_us"] > 0 and lat["cpu"]["detail"] == ""
    assert [r["device"] for r in sums] == ["cpu"]


def test_rows_and_modes():
    assert bench.default_rows(0) == [("cpu", "cpu")]
    rows = bench.default_rows(2)
    assert len(rows) == 2 * 5 + 2 and ("pageable", "cuda:1") in rows and ("cuda:1", "cuda:0") in rows
    assert bench.modes_of("cuda:0", "cuda:1", True) == ["ce", "ce_bidir", "sm_pull", "sm_push", "staged", "verified",
                                                        "verified_deferred"]
    no_peer = bench.modes_of("cuda:0", "cuda:1", False)  # no peer access: no kernel through it
    assert "sm_pull" not in no_peer and "sm_push" not in no_peer
    assert bench.modes_of("cuda:0", "cuda:0", False)[:2] == ["ce", "sm_push"]  # GPU-local: no two-way, one kernel
    assert "ce_bidir" in bench.modes_of("pinned", "cuda:0", False)
    assert "ce_bidir" not in bench.modes_of("pageable", "cuda:0", False)
    assert bench.parse_rows("pinned->cuda:1, cuda:0->cuda:0", 2) == [("pinned", "cuda:1"), ("cuda:0", "cuda:0")]
    for bad in ("pinned->pageable", "cpu->cuda:0", "cuda:2->cuda:0", "cuda:0"):
        with pytest.raises(ValueError, match=f"--pairs: expected SRC->DST.*got '{bad}'"):
            bench.parse_rows(bad, 2)


def test_bad_arguments_exit_2_naming_them(capsys):
    assert main(["bench", "--modes", "ce,warp"]) == 2
    assert "--modes: expected names from ce,ce_bidir,sm_pull,sm_push,staged,verified,verified_deferred, got warp" in \
        capsys.readouterr().err
    assert main(["bench", "--reps", "0"]) == 2
    assert "--reps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--sizes", "4K,lots"])
    assert e.value.code == 2 and "expected a size like 4096, 4K, 64MiB or 1G, got 'lots'" in capsys.readouterr().err


def test_sizes_parse():
    assert [_size(s) for s in ("4096", "4K", "4KiB", "64M", "64 MiB", "1G", "1gib")] == \
        [4096, 4096, 4096, 64 << 20, 64 << 20, 1 << 30, 1 << 30]
    for bad in ("0", "4X", "M", "-1", "1.5M"):
        with pytest.raises(Exception, match="expected a size"):
            _size(bad)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith(f"pyxfer {pyxfer.__version__} (built against torch ")
    assert f"running torch {torch.__version__}" in out


def test_module_entry_point_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "pyxfer", "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(f"pyxfer {pyxfer.__version__} ")


# ---- the measurement helpers shared with benchmarks/

def test_cpu_samples_spread_and_rate():
    calls = []
    s = cpu_samples(calls.append, "x", warmup=2, reps=5, inner=3)
    assert len(calls) == 2 + 5 * 3 and s.reps == 5 and not s.held
    assert s.min_ms <= s.median_ms <= s.max_ms
    t = Samples(median_ms=2.0, min_ms=1.0, max_ms=3.0, reps=3, host_ms=0.0, held=True)
    assert t.gbps(4_000_000) == pytest.approx(2.0)  # 4e6 bytes in 2 ms = 2 GB/s
    assert math.isinf(Samples(0.0, 0.0, 0.0, 1, 0.0, False).gbps(1))


def test_formatting():
    assert [fmt_size(n) for n in (7, 4096, 65539, 3 << 29)] == ["7 B", "4 KiB", "64.0029 KiB", "1.5 GiB"]
    assert [fmt_gbps(v) for v in (None, 123.4, 1.234)] == ["-", "123", "1.23"]


def test_benchmarks_use_the_package_helpers():
    """One measurement method: benchmarks/common.py keeps no timing code of its own."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    common = (root / "common.py").read_text()
    assert "def cuda_time" not in common and "def cpu_time" not in common and "_sleep" not in common
    for script in ("checksum.py", "transfer.py", "formats.py", "buffers.py"):
        assert "from pyxfer.tools.timing import " in (root / script).read_text(), script


# ---- paths the end-to-end CPU run does not take --------------------------------------------------

N_TEXT = "4.00293 KiB"  # fmt_size(N)


@pytest.fixture(autouse=True)
def healthy():
    """A verified copy that fails marks cpu -> cpu corrupt (then route="auto" goes staged): undo it."""
    pyxfer.health.reset()
    yield
    pyxfer.health.reset()


def run_bench(capsys, tmp_path, *args):
    """(exit code, stdout, stderr, JSON document) of `pyxfer bench --sizes N ... --json` run in-process."""
    path = tmp_path / "b.json"
    code = main(["bench", "--sizes", str(N), "--reps", "2", "--warmup", "0", "--json", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err, json.loads(path.read_text())


@cpu_only
def test_deferred_verification_failure_is_a_corrupt_row():
    # every direct copy flips a bit; deferred mode returns the wrong bytes and queues the mismatch:
    # the point's check must take it from check_transfers (reps x loop calls, no warm-up)
    with inject_fault("bitflip", path="direct", times=10**6):
        results, _, _, _ = bench.measure_all([("cpu", "cpu")], ["verified_deferred"], [N], reps=2, warmup=0,
                                             progress=False)
    (r,) = results
    calls = 2 * bench._loop(N)
    assert r["check"] == "corrupt" and r["gbps"] > 0 and r["reps"] == 2
    assert r["detail"].startswith(f"{calls} deferred verified copies failed verification; the first: copy "
                                  f"cpu -> cpu of {N} bytes: source PXH64 0x")
    pyxfer.check_transfers()  # the check took every queued mismatch: none is left for the next caller


@cpu_only
def test_corrupt_rows_are_printed_and_exit_1(capsys, tmp_path):
    with inject_fault("bitflip", path="staged", times=10**6):
        code, out, err, doc = run_bench(capsys, tmp_path, "--modes", "ce,staged", "--no-progress")
    assert code == 1
    assert [(r["mode"], r["check"]) for r in doc["results"]] == [("ce", "ok"), ("staged", "corrupt")]
    (bad,) = doc["corrupt"]
    assert (bad["src"], bad["dst"], bad["mode"], bad["bytes"]) == ("cpu", "cpu", "staged", N)
    assert f"CORRUPT cpu -> cpu staged {N_TEXT}: {bad['detail']}" in out.splitlines()
    assert bad["detail"].startswith("cpu: PXH64 0x") and "1 wrong bytes" in bad["detail"]
    assert f"wrote {tmp_path / 'b.json'}" in out and err.startswith("pyxfer bench: no CUDA GPU visible")
    # only staged/ce: there is no verified row to divide
    staged, ce = (next(r["gbps"] for r in doc["results"] if r["mode"] == m) for m in ("staged", "ce"))
    assert doc["ratios"] == [{"src": "cpu", "dst": "cpu", "bytes": N, "ratio": "staged/ce",
                              "value": round(staged / ce, 4)}]


@cpu_only
def test_progress_lines_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as where tqdm is not installed: import raises
    bench.measure_all([("cpu", "cpu")], ["ce"], [N], reps=1, warmup=0, progress=True)
    assert capsys.readouterr().err.splitlines() == [f"[1/3] cpu->cpu ce {N_TEXT}", f"[2/3] checksum cpu {N_TEXT}",
                                                    "[3/3] latency cpu->cpu"]
    bench.measure_all([("cpu", "cpu")], ["ce"], [N], reps=1, warmup=0, progress=False)
    assert capsys.readouterr().err == ""


@cpu_only
def test_plot_without_matplotlib_exits_2_before_measuring(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["bench", "--sizes", str(N), "--reps", "2", "--warmup", "0", "--modes", "ce", "--json",
                 str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # nothing measured: the missing extra is said first
    assert err == "pyxfer bench: --plot needs matplotlib: pip install 'pyxfer[plot]' (or matplotlib)\n"
    assert list(tmp_path.iterdir()) == []
    doc = {"config": {"matrix_size": N, "rows": [], "modes": []}}
    with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
        bench.plot(doc, tmp_path / "c.png")


@cpu_only
def test_plot_with_missing_ratios_and_spare_axes(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test and bench extras bring it)")
    # three modes and the staged/ce ratio: four panels on a 2 x 3 grid (no verified/ce panel, two spare axes)
    code, out, _, _ = run_bench(capsys, tmp_path, "--modes", "ce,staged,verified_deferred", "--no-progress",
                                "--plot", str(tmp_path / "b.png"))
    assert code == 0 and f"wrote {tmp_path / 'b.png'}" in out
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@cpu_only
def test_without_json_nothing_is_written(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--sizes", str(N), "--reps", "1", "--warmup", "0", "--modes", "ce", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "ce GB/s at" in out and "wrote" not in out and list(tmp_path.iterdir()) == []


@pytest.fixture
def cpu_doc(capsys, tmp_path):
    """A real CPU run's document (ce and verified at N)."""
    code, _, _, doc = run_bench(capsys, tmp_path, "--modes", "ce,verified", "--no-progress")
    assert code == 0
    return doc


@cpu_only
def test_report_of_a_gpu_document(cpu_doc, capsys):
    # the parts of the report only a GPU run fills: no "no CUDA GPU" line, the method check, a failed
    # row, a compare section with a slower point
    doc = copy.deepcopy(cpu_doc)
    doc["gpu"] = True
    doc["method_check"] = [{"src": "pinned", "dst": "cuda:0", "bytes": 64 << 20, "bench_gbps": 24.56,
                            "torch_gbps": 24.41, "ratio": 1.00614}]
    failed = dict(doc["results"][0], check="error", detail="RuntimeError: CUDA error: out of memory", gbps=None)
    doc["results"][0] = failed
    doc["compare"] = {"old": "old.json", "threshold": 0.1,
                      "slower": [{"src": "cpu", "dst": "cpu", "mode": "verified", "bytes": N, "old_gbps": 2.5,
                                  "new_gbps": 1.25, "ratio": 0.5}]}
    bench.print_results(doc)
    lines = capsys.readouterr().out.splitlines()
    assert not any("no CUDA GPU visible" in ln for ln in lines)
    assert "method check pinned -> cuda:0 at 64 MiB: bench ce 24.6 GB/s, torch copy_ (20 copies between events) " \
           "24.4 GB/s, ratio 1.006" in lines
    assert f"error cpu -> cpu ce {N_TEXT}: RuntimeError: CUDA error: out of memory" in lines
    assert "compared with old.json: 1 points slower by more than 10%" in lines
    assert f"  SLOWER cpu -> cpu verified {N_TEXT}: 2.50 -> 1.25 GB/s (0.50x)" in lines
    # the failed ce point has no figure: its matrix is not printed at all, verified's is
    assert not any(ln.startswith("ce GB/s") for ln in lines) and f"verified GB/s at {N_TEXT}" in lines


@cpu_only
def test_validate_names_what_is_wrong(cpu_doc):
    bench.validate(cpu_doc)
    doc = copy.deepcopy(cpu_doc)
    del doc["latency"]
    with pytest.raises(ValueError, match="^pyxfer.bench document without 'latency'$"):
        bench.validate(doc)
    for bad in ({"mode": "warp"}, {"check": "maybe"}):
        doc = copy.deepcopy(cpu_doc)
        doc["results"][1] = {**doc["results"][1], **bad}
        with pytest.raises(ValueError, match="^pyxfer.bench: malformed result"):
            bench.validate(doc)
    doc = copy.deepcopy(cpu_doc)
    del doc["results"][0]["check"]
    with pytest.raises(ValueError, match="malformed result"):
        bench.validate(doc)
    with pytest.raises(ValueError, match=r"not a pyxfer.bench document \(schema None\)"):
        bench.validate([cpu_doc])


@cpu_only
def test_samples_as_dict_and_cpu_time_ms():
    s = Samples.of([3.0, 1.0, 2.0, 9.0], [0.5, 0.25], True)
    assert s.as_dict() == {"median_ms": 2.5, "min_ms": 1.0, "max_ms": 9.0, "reps": 4, "host_ms": 0.375, "held": True}
    assert Samples.of([4.0], [], False).as_dict()["host_ms"] == 0.0
    calls = []
    ms = cpu_time_ms(calls.append, "x", warmup=2, reps=3)
    assert calls == ["x"] * 5 and isinstance(ms, float) and ms >= 0
    assert cpu_samples(calls.append, "y", warmup=0, reps=1).reps == 1 and calls[-1] == "y"


# ---- options checked before anything is measured; a finished run is never lost -------------------

QUICK = ["--sizes", str(N), "--reps", "1", "--warmup", "0", "--no-progress"]


def bench_exit(capsys, *args):
    """(exit code, stdout, stderr) of `pyxfer bench QUICK ARGS` run in-process; argparse's own exit too."""
    try:
        code = main(["bench", *QUICK, *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,option,expected", [
    (["--json", "{d}/no/b.json"], "--json", "expected a file in an existing directory, got '{d}/no/b.json' "
                                            "({d}/no is not a directory)"),
    (["--json", "{d}"], "--json", "expected a file to write, got the directory '{d}'"),
    (["--plot", "out.txt"], "--plot", "expected a path ending in .png, got 'out.txt'"),
    (["--plot", "heatmap"], "--plot", "expected a path ending in .png, got 'heatmap'"),
    (["--plot", "{d}/no/b.png"], "--plot", "expected a file in an existing directory, got '{d}/no/b.png' "
                                           "({d}/no is not a directory)"),
    (["--sizes", "9223372036854775808"], "--sizes", "expected a size of at most 2^63 - 1 bytes (int64), "
                                                    "got '9223372036854775808'"),
    (["--sizes", "4K,99999999999G"], "--sizes", "expected a size of at most 2^63 - 1 bytes (int64), "
                                                "got '99999999999G'"),
    (["--threshold", "1"], "--threshold", "expected a fraction in (0, 1), got '1'"),
])
def test_outputs_and_sizes_are_checked_when_parsed(capsys, tmp_path, monkeypatch, args, option, expected):
    monkeypatch.chdir(tmp_path)
    args = [a.format(d=tmp_path) for a in args]
    code, out, err = bench_exit(capsys, *args)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == f"pyxfer bench: error: argument {option}: {expected.format(d=tmp_path)}"
    assert "Traceback" not in err and "no CUDA GPU visible" not in err  # nothing measured
    assert list(tmp_path.iterdir()) == []


@cpu_only
@pytest.mark.parametrize("args,expected", [
    (["--modes", ""], "--modes: expected names from ce,ce_bidir,sm_pull,sm_push,staged,verified,verified_deferred "
                      "separated by commas, got an empty name in ''"),
    (["--modes", "ce,"], "--modes: expected names from ce,ce_bidir,sm_pull,sm_push,staged,verified,"
                         "verified_deferred separated by commas, got an empty name in 'ce,'"),
    (["--modes", "ce,staged,ce"], "--modes: expected each mode once, got ce twice in 'ce,staged,ce'"),
    (["--modes", "ce,sm_pull"], "--modes: expected modes the rows support (cpu->cpu: ce,staged,verified,"
                                "verified_deferred), got sm_pull, which no row supports"),
    (["--pairs", ""], "--pairs: expected SRC->DST[,...] with endpoints from ['cpu'] (not host -> host where GPUs "
                      "are visible), got ''"),
    (["--pairs", "cpu->cpu, cpu -> cpu"], "--pairs: expected each row once, got cpu->cpu twice in "
                                          "'cpu->cpu, cpu -> cpu'"),
    (["--json", "b.png", "--plot", "b.png"], "--json and --plot: expected two files, got 'b.png' twice"),
    (["--sizes", "1000000G"], "--sizes: expected sizes whose buffers fit: 1e+06 GiB needs about 3 x 1e+06 GiB on "
                              "cpu, which has "),
])
def test_lists_and_sizes_that_would_measure_something_else_exit_2(capsys, tmp_path, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    code, out, err = bench_exit(capsys, *args)
    assert code == 2 and out == "" and list(tmp_path.iterdir()) == []  # nothing measured, nothing written
    assert err.startswith(f"pyxfer bench: {expected}") and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def small_doc(tmp_path_factory):
    """A real run's document (ce at N) for --compare."""
    path = tmp_path_factory.mktemp("old") / "old.json"
    assert main(["bench", *QUICK, "--modes", "ce", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def typed(doc, **fields):
    doc = json.loads(json.dumps(doc))
    doc["results"][0].update(fields)
    return json.dumps(doc).encode()


@cpu_only
@pytest.mark.parametrize("case", ["missing", "truncated", "binary", "bytes as text", "negative gbps", "gbps as text",
                                  "bytes as bool", "results not a list"])
def test_compare_document_problems_name_the_file_before_measuring(capsys, tmp_path, small_doc, case):
    path = tmp_path / "old.json"
    text = json.dumps(small_doc).encode()
    content = {"truncated": text[:len(text) // 2], "binary": bytes(range(256)) * 4,
               "bytes as text": typed(small_doc, bytes=str(N)), "negative gbps": typed(small_doc, gbps=-5),
               "gbps as text": typed(small_doc, gbps="fast"), "bytes as bool": typed(small_doc, bytes=True),
               "results not a list": json.dumps({**small_doc, "results": 5}).encode()}.get(case)
    if content is not None:
        path.write_bytes(content)
    why = {"missing": "cannot read it (No such file or directory)", "truncated": "not a JSON document (",
           "binary": "not a JSON document (", "results not a list": "pyxfer.bench: 'results' must be a list, got int"
           }.get(case, "pyxfer.bench: malformed result {")
    code, out, err = bench_exit(capsys, "--modes", "ce", "--compare", str(path), "--json", str(tmp_path / "n.json"))
    assert code == 2 and out == "" and not (tmp_path / "n.json").exists()  # said before measuring
    assert err.startswith(f"pyxfer bench: --compare {path}: {why}") and err.count("\n") == 1, err


@cpu_only
def test_a_size_that_cannot_be_allocated_is_reported_and_the_run_carries_on():
    # passes the options' check when called directly: the allocation itself fails, after a size was measured
    huge = 1 << 50
    results, latency, sums, _ = bench.measure_all([("cpu", "cpu")], ["ce", "staged"], [N, huge], reps=1, warmup=0,
                                                  progress=False)
    by = {(r["mode"], r["bytes"]): r for r in results}
    assert sorted(by) == [("ce", N), ("ce", huge), ("staged", N), ("staged", huge)]
    assert by["ce", N]["check"] == "ok" and by["staged", N]["check"] == "ok"
    for mode in ("ce", "staged"):
        r = by[mode, huge]
        assert (r["check"], r["gbps"], r["reps"]) == ("error", None, 0)
        assert r["detail"].startswith("RuntimeError: ") and "can't allocate memory" in r["detail"]
    assert [s["bytes"] for s in sums] == [N] and latency[0]["median_us"] > 0


@cpu_only
def test_a_json_that_cannot_be_written_after_the_run_is_saved_elsewhere(capsys, tmp_path, monkeypatch):
    # a full disk, for real: a link to /dev/full passes the options' check and fails the write
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    link = tmp_path / "b.json"
    link.symlink_to("/dev/full")
    spare_dir = tmp_path / "tmp"
    spare_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare_dir))  # where the run goes instead
    code, out, err = bench_exit(capsys, "--modes", "ce", "--json", str(link))
    assert code == 2 and f"ce GB/s at {bench.fmt_size(N)}" in out and "wrote" not in out  # the report is printed
    (spare,) = spare_dir.iterdir()
    assert err.splitlines()[-1] == (f"pyxfer bench: --json: could not write {link} ([Errno 28] No space left on "
                                    f"device); the run is saved in {spare}")
    doc = json.loads(spare.read_text())
    bench.validate(doc)
    assert [(r["mode"], r["bytes"], r["check"]) for r in doc["results"]] == [("ce", N, "ok")]
    assert os.readlink(link) == "/dev/full" and sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "tmp"]


@cpu_only
def test_a_plot_that_cannot_be_written_after_the_run_is_reported(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test and bench extras bring it)")
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    png = tmp_path / "b.png"
    png.symlink_to("/dev/full")
    code, out, err = bench_exit(capsys, "--modes", "ce", "--json", str(tmp_path / "b.json"), "--plot", str(png))
    assert code == 2 and f"wrote {tmp_path / 'b.json'}" in out.splitlines() and f"wrote {png}" not in out
    assert err.splitlines()[-1] == (f"pyxfer bench: --plot: could not write {png} (OSError: [Errno 28] No space "
                                    f"left on device)")
    bench.validate(json.loads((tmp_path / "b.json").read_text()))  # the run itself is saved
