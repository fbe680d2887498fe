"""`pyxfer bench` paths the end-to-end CPU run in test_bench.py does not take, through the CLI and the
public functions: a deferred-verification row that corrupts, corrupt rows in the report and the exit
code, the ratios of a partial mode list, progress without tqdm, --plot without matplotlib, the report
of a GPU document (method check, failed rows, compare), and validate's messages."""
import copy
import json
import sys

import pytest
import torch

import pyxfer
from pyxfer import bench
from pyxfer._timing import Samples, cpu_samples, cpu_time_ms
from pyxfer.cli import main
from pyxfer.testing import inject_fault

# Where a GPU is visible the bench measures GPU rows instead (test_bench_gpu.py covers those runs).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rows run where no GPU is visible")

N = 4099  # odd, one size: fast on a shared CPU
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


def test_progress_lines_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as where tqdm is not installed: import raises
    bench.measure_all([("cpu", "cpu")], ["ce"], [N], reps=1, warmup=0, progress=True)
    assert capsys.readouterr().err.splitlines() == [f"[1/3] cpu->cpu ce {N_TEXT}", f"[2/3] checksum cpu {N_TEXT}",
                                                    "[3/3] latency cpu->cpu"]
    bench.measure_all([("cpu", "cpu")], ["ce"], [N], reps=1, warmup=0, progress=False)
    assert capsys.readouterr().err == ""


def test_plot_without_matplotlib_exits_2_before_measuring(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["bench", "--sizes", str(N), "--reps", "2", "--warmup", "0", "--modes", "ce", "--json",
                 str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # nothing measured: the missing extra is said first
    assert err == "pyxfer bench: --plot needs matplotlib: pip install 'pyxfer[bench]' (or matplotlib)\n"
    assert list(tmp_path.iterdir()) == []
    doc = {"config": {"matrix_size": N, "rows": [], "modes": []}}
    with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
        bench.plot(doc, tmp_path / "c.png")


def test_plot_with_missing_ratios_and_spare_axes(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test and bench extras bring it)")
    # three modes and the staged/ce ratio: four panels on a 2 x 3 grid (no verified/ce panel, two spare axes)
    code, out, _, _ = run_bench(capsys, tmp_path, "--modes", "ce,staged,verified_deferred", "--no-progress",
                                "--plot", str(tmp_path / "b.png"))
    assert code == 0 and f"wrote {tmp_path / 'b.png'}" in out
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_samples_as_dict_and_cpu_time_ms():
    s = Samples.of([3.0, 1.0, 2.0, 9.0], [0.5, 0.25], True)
    assert s.as_dict() == {"median_ms": 2.5, "min_ms": 1.0, "max_ms": 9.0, "reps": 4, "host_ms": 0.375, "held": True}
    assert Samples.of([4.0], [], False).as_dict()["host_ms"] == 0.0
    calls = []
    ms = cpu_time_ms(calls.append, "x", warmup=2, reps=3)
    assert calls == ["x"] * 5 and isinstance(ms, float) and ms >= 0
    assert cpu_samples(calls.append, "y", warmup=0, reps=1).reps == 1 and calls[-1] == "y"
