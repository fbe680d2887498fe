"""`pyxfer bench` without a GPU as a new user runs it: the default run's peak memory (measured in a child
process), the plausibility warnings on host memcpy figures that cannot be the machine's, the threads the
measurement runs on, the spread (CV) of every point, the CPU rows' latency figures and the pointer-chase
op behind them; and the PNG's cell text at every matrix size."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from pyxfer.tools import bench
from pyxfer.tools.cli import main
from pyxfer.tools.timing import Samples, cpu_samples, spread

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode runs where no GPU is visible")
MiB = 1 << 20


@cpu_only
def test_default_cpu_run_peaks_below_2_gb(tmp_path):
    """The default run (no options) in a child process: its peak RSS (getrusage) stays below 2 GB, its
    sizes stop at CPU_MAX_BYTES and it measures on one torch thread (run Q peaked at 14 GB on a 24 GiB
    machine: the full preset's 1 GiB buffers)."""
    code = textwrap.dedent(f"""
        import resource, sys
        from pyxfer.tools.cli import main
        rc = main(["bench", "--no-progress", "--json", {str(tmp_path / "b.json")!r}])
        print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "RC", rc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("MAXRSS_KIB")]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    peak_kib, rc = int(line[0].split()[1]), int(line[0].split()[3])
    doc = json.loads((tmp_path / "b.json").read_text())
    print(f"default CPU run: peak RSS {peak_kib / 1024:.0f} MiB, sizes {doc['config']['sizes']}")
    assert rc in (0, 1), r.stderr[-3000:]
    assert peak_kib * 1024 <= 2 * 10**9, f"the default CPU run peaked at {peak_kib / 1024:.0f} MiB, above 2 GB"
    assert max(doc["config"]["sizes"]) == bench.CPU_MAX_BYTES and doc["config"]["threads"] == 1
    assert "sizes up to 64 MiB" in r.stderr and "on 1 torch thread" in r.stderr


def _result(mode, n, gbps, cv=0.01, src="cpu", dst="cpu"):
    return {"src": src, "dst": dst, "mode": mode, "bytes": n, "gbps": gbps, "cv": cv, "check": "ok", "detail": ""}


def test_plausibility_warns_on_ce_below_staged_or_the_floor():
    ok = [_result("ce", MiB, 8.0), _result("staged", MiB, 3.0), _result("ce", 64 << 10, 0.01),
          _result("staged", 64 << 10, None)]
    assert bench.plausibility(ok) == []  # a slow small copy alone is no proof: the floor starts at 1 MiB
    below_staged = [_result("ce", 64 << 10, 0.01), _result("staged", 64 << 10, 0.05)]  # run Q's figures
    (w,) = bench.plausibility(below_staged)
    assert w.startswith("implausible: cpu -> cpu ce 0.01 GB/s below staged 0.05 GB/s at 64 KiB")
    assert "CPU threads contended" in w and "--threads 1" in w
    (w,) = bench.plausibility([_result("ce", MiB, 0.13), _result("staged", MiB, 0.1)])
    assert w.startswith("implausible: cpu -> cpu ce 0.13 GB/s at 1 MiB, below 1.0 GB/s") and "contended" in w
    gpu_rows = [_result("ce", MiB, 0.1, src="pinned", dst="cuda:0"), _result("staged", MiB, 5.0, "pinned", "cuda:0")]
    assert bench.plausibility(gpu_rows) == []  # GPU rows have their own method check


def test_warnings_are_printed(capsys):
    doc = {"config": {"matrix_size": MiB, "rows": [["cpu", "cpu"]], "modes": ["ce"], "sizes": [MiB]},
           "method": {"reps": 3}, "gpu": False, "results": [_result("ce", MiB, 0.13, cv=0.2)], "ratios": [],
           "latency": [], "checksum": [], "method_check": [], "corrupt": [],
           "warnings": bench.plausibility([_result("ce", MiB, 0.13)]) + bench.spread_warnings(
               [_result("ce", MiB, 0.13, cv=0.2)], [])}
    bench.print_results(doc)
    out = capsys.readouterr().out
    assert "WARNING implausible: cpu -> cpu ce 0.13 GB/s at 1 MiB" in out
    assert "WARNING spread: cpu -> cpu ce 1 MiB: CV 20.0% (above 5%)" in out
    assert "0.13 20.0%" in out  # the CV beside the median in the matrix


def test_spread_is_the_coefficient_of_variation():
    assert spread([1.0, 2.0, 3.0]) == pytest.approx(0.5) and spread([4.0]) == 0.0 and spread([]) == 0.0
    assert Samples.of([1.0, 2.0, 3.0], [], False).cv == pytest.approx(0.5)
    s = cpu_samples(lambda _: None, None, warmup=0, reps=4)
    assert s.cv >= 0 and s.reps == 4
    lat = [{"src": "cpu", "dst": "cpu", "kind": "chase", "cv": 0.051}, {"src": "cpu", "dst": "cpu", "kind": "x",
                                                                        "cv": 0.05}]
    assert bench.spread_warnings([_result("ce", 4096, 1.0, cv=0.05)], lat) == [
        "spread: latency chase cpu -> cpu: CV 5.1% (above 5%)"]


@cpu_only
def test_threads_are_set_for_the_measurement_and_restored(capsys, tmp_path):
    before = torch.get_num_threads()
    path = tmp_path / "b.json"
    assert main(["bench", "--sizes", "4099", "--reps", "2", "--warmup", "0", "--modes", "ce", "--threads", "3",
                 "--no-progress", "--json", str(path)]) in (0, 1)
    doc = json.loads(path.read_text())
    assert doc["config"]["threads"] == 3 and torch.get_num_threads() == before
    r = [x for x in doc["results"] if x["mode"] == "ce"][0]
    assert r["cv"] >= 0 and r["reps"] == 2
    kinds = {x["kind"]: x for x in doc["latency"]}
    assert set(kinds) == {"chase", "host_call"}  # the GPU's-view kinds need a GPU
    assert kinds["chase"]["median_us"] > 0 and kinds["chase"]["bytes"] == bench.CHASE_BYTES
    assert kinds["host_call"]["median_us"] > 0 and kinds["host_call"]["bytes"] == 8
    out = capsys.readouterr().out
    assert "host round trip of one call, us" in out and "latency of one load, us" in out


def test_bad_threads_exit_2(capsys):
    assert main(["bench", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


# ---- the pointer chase (torch.ops.pyxfer.pointer_chase) on the CPU: the result the GPU kernel must match

def test_pointer_chase_walks_the_ring_exactly():
    ring, order = bench.chase_ring(1001, torch.Generator().manual_seed(7))
    assert sorted(ring.tolist()) == list(range(1001))  # a permutation ...
    node, seen = 0, set()
    for _ in range(1001):
        seen.add(node)
        node = int(ring[node])
    assert node == 0 and len(seen) == 1001  # ... that is one cycle through every node
    for hops in (0, 1, 7, 1000, 1001, 2503):
        out = torch.ops.pyxfer.pointer_chase(ring, hops)
        assert out.dim() == 0 and out.dtype == torch.int64 and int(out) == int(order[hops % 1001]), hops
    broken = ring.clone()
    broken[int(order[5])] = -3  # the 6th hop leads outside the ring: the walk stops there
    assert int(torch.ops.pyxfer.pointer_chase(broken, 100)) == -3
    broken[int(order[5])] = 1001
    assert int(torch.ops.pyxfer.pointer_chase(broken, 100, torch.device("cpu"))) == 1001


@pytest.mark.parametrize("ring, hops, device, exc, message", [
    (torch.zeros(4, dtype=torch.int32), 1, None, TypeError, "ring must be an int64 tensor"),
    (torch.zeros(2, 2, dtype=torch.int64), 1, None, ValueError, "ring must be a 1-D contiguous tensor"),
    (torch.zeros(8, dtype=torch.int64)[::2], 1, None, ValueError, "(non-contiguous)"),
    (torch.zeros(0, dtype=torch.int64), 1, None, ValueError, "with at least one node"),
    (torch.zeros(4, dtype=torch.int64), -1, None, ValueError, "num_hops must be >= 0, got -1"),
    (torch.zeros(4, dtype=torch.int64), 1, torch.device("meta"), ValueError, "device must be cpu"),
])
def test_pointer_chase_rejects_bad_arguments(ring, hops, device, exc, message):
    with pytest.raises(exc, match="pyxfer.pointer_chase") as e:
        torch.ops.pyxfer.pointer_chase(ring, hops, device)
    assert message in str(e.value)


# ---- the PNG

def test_text_color_follows_the_cell():
    matplotlib = pytest.importorskip("matplotlib")
    cmap = matplotlib.colormaps["viridis"]
    assert bench._text_color(cmap(1.0)) == "black"  # yellow: white digits were unreadable on it (run Q)
    assert bench._text_color(cmap(0.85)) == "black"
    assert bench._text_color(cmap(0.0)) == "white"  # dark purple
    assert bench._text_color(cmap(0.3)) == "white"


def fake_doc(k, sizes=(4096, MiB, 64 * MiB)):
    """A bench document of k x k GPU rows with made-up figures (fake: the plot's layout is under test)."""
    rows = [[f"cuda:{i}", f"cuda:{j}"] for i in range(k) for j in range(k)] if k > 1 else [["cpu", "cpu"]]
    results = []
    for s, d in rows:
        for m, base in (("ce", 390.0), ("ce_bidir", 780.0), ("sm_push", 370.0)):
            for z in sizes:
                scale = z / (z + 2 * MiB)
                results.append({"src": s, "dst": d, "mode": m, "bytes": z, "gbps": round(base * scale * (1 + 0.01 * (
                    hash((s, d)) % 7)), 2), "check": "ok"})
    ratios = [{"src": s, "dst": d, "bytes": max(sizes), "ratio": "verified/ce", "value": 0.9} for s, d in rows]
    return {"config": {"matrix_size": max(sizes), "rows": rows, "modes": ["ce", "ce_bidir", "sm_push"],
                       "sizes": list(sizes)},
            "results": results, "ratios": ratios, "created": "2026-11-27T09:30:00+00:00",
            "machine": {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}] * k if k > 1 else []}}


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_png_at_every_matrix_size(tmp_path, k):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"bench_{k}x{k}.png"
    bench.plot(fake_doc(k), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 3 * 360 and height >= 2 * 360  # 4 matrix panels, the sweep panel: 3 columns, 2 rows


def test_a_chase_that_ends_on_the_wrong_node_is_an_error():
    ring, order = bench.chase_ring(257, torch.Generator().manual_seed(3))
    t = bench.chase("cpu", "cpu", ring, order, 1000, 0, 2)
    assert t.reps == 2 and t.median_ms > 0
    broken = ring.clone()
    broken[int(order[10])] = int(order[12])  # skips a node: the walk ends elsewhere (still inside the ring)
    with pytest.raises(RuntimeError, match=r"pointer chase cpu -> cpu: 3 of 3 walks ended on node \d+, expected "
                                           rf"{int(order[1000 % 257])}: the ring's memory read back wrong"):
        bench.chase("cpu", "cpu", broken, order, 1000, 1, 2)
