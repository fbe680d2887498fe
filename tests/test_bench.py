"""`pyxfer bench` on the CPU, end to end: matrices, the --json schema, the PNG, --compare, a corrupting
path reported without stopping the bench; the shared timing helpers; the CLI's arguments."""
import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

import pyxfer
from pyxfer import bench
from pyxfer._timing import Samples, cpu_samples, fmt_gbps, fmt_size
from pyxfer.cli import _size, main
from pyxfer.testing import inject_fault

SIZES = [4096, 65536 + 3]  # an odd size too


def check_schema(doc):
    """The --json document as pyxfer/bench.py's docstring documents it (schema pyxfer.bench, 1)."""
    bench.validate(doc)
    assert doc["schema"] == "pyxfer.bench" and doc["schema_version"] == 2
    assert isinstance(doc["gpu"], bool) and isinstance(doc["argv"], list) and doc["created"].endswith("+00:00")
    m = doc["machine"]
    assert {"host", "platform", "python", "torch", "torch_cuda", "driver", "gpus", "peer_access", "pyxfer",
            "build", "threads", "env"} <= set(m)
    assert m["pyxfer"] == pyxfer.__version__ and m["torch"] == torch.__version__
    assert "spin kernel" in doc["method"]["description"] and doc["method"]["reps"] >= 1
    cfg = doc["config"]
    assert cfg["matrix_size"] == max(cfg["sizes"]) and all(isinstance(r, list) and len(r) == 2 for r in cfg["rows"])
    for r in doc["results"]:
        assert set(r) == {"src", "dst", "mode", "bytes", "gbps", "median_ms", "min_ms", "max_ms", "reps", "loop",
                          "held", "check", "detail"}
        if r["check"] != "error":
            assert r["gbps"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["reps"] == doc["method"]["reps"]
    for r in doc["ratios"]:
        assert set(r) == {"src", "dst", "bytes", "ratio", "value"} and r["ratio"] in ("verified/ce", "staged/ce")
    for r in doc["latency"]:
        assert set(r) == {"src", "dst", "bytes", "median_us", "min_us", "max_us", "detail"}
        assert r["median_us"] > 0 if r["detail"] == "" else r["median_us"] is None
    for r in doc["checksum"]:
        assert set(r) == {"device", "bytes", "gbps", "median_ms", "min_ms", "max_ms"} and r["gbps"] > 0
    for r in doc["method_check"]:
        assert set(r) == {"src", "dst", "bytes", "bench_gbps", "torch_gbps", "ratio"}
    for r in doc["corrupt"]:
        assert set(r) == {"src", "dst", "mode", "bytes", "detail"}
    assert doc["compare"] is None or set(doc["compare"]) == {"old", "threshold", "slower"}


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
    check_schema(doc)
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
    check_schema(new)
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
    root = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    common = (root / "common.py").read_text()
    assert "def cuda_time" not in common and "def cpu_time" not in common and "_sleep" not in common
    for script in ("checksum.py", "transfer.py", "formats.py", "buffers.py"):
        assert "from pyxfer._timing import " in (root / script).read_text(), script
