"""benchmarks/nvbandwidth_compare.py's parser of nvbandwidth's plain-text output, on a sample built from
nvbandwidth v0.8's format (output.cpp, inline_common.h: "Running <key>.", the description, column labels
and cells in setw(10), "N/A", the SUM line naming each matrix; bidirectional tests print three matrices),
and the side-by-side pairing with a bench document."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("nvbandwidth_compare", ROOT / "benchmarks" / "nvbandwidth_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _matrix(rows, cols, values, row_label_width=2):
    """One matrix as nvbandwidth's operator<< prints it."""
    out = [" " * row_label_width + "".join(f"{c:>10}" for c in cols)]
    for r in rows:
        out.append(f"{r:>{row_label_width}}" + "".join(f"{'N/A' if v is None else f'{v:.2f}':>10}"
                                                         for v in values[r]))
    return out


def sample():
    lines = ["nvbandwidth Version: v0.8", "Built from Git version: 66746a3", "",
             "NOTE: The reported results may not reflect the full capabilities of the platform.",
             "Performance can vary with software drivers, hardware clocks, and system topology.", "",
             "CUDA Runtime Version: 12080", "CUDA Driver Version: 12080", "Driver Version: 570.86.15", "",
             "host", "Device 0: NVIDIA H100 80GB HBM3 (00000000:19:00)",
             "Device 1: NVIDIA H100 80GB HBM3 (00000000:3b:00)", ""]
    lines += ["Running device_to_device_memcpy_write_ce.", "memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)"]
    lines += _matrix([0, 1], [0, 1], {0: [None, 397.42], 1: [396.81, None]})
    lines += ["", "SUM device_to_device_memcpy_write_ce 794.23", ""]
    lines += ["Running device_to_device_bidirectional_memcpy_write_ce."]
    for part, vals in (("Write1", (390.5, 391.25)), ("Write2", (390.04, 389.75)), ("Total", (780.54, 781.0))):
        key = "device_to_device_bidirectional_memcpy_write_ce_" + part.lower()
        lines += [f"memcpy CE GPU(row) <-> GPU(column) {part} bandwidth (GB/s)"]
        lines += _matrix([0, 1], [0, 1], {0: [None, vals[0]], 1: [vals[1], None]})
        lines += ["", f"SUM {key} {vals[0] + vals[1]:.2f}", ""]
    lines += ["Running host_to_device_memcpy_ce.", "memcpy CE CPU(row) -> GPU(column) bandwidth (GB/s)"]
    lines += _matrix([0], [0, 1], {0: [55.13, 55.2]})
    lines += ["", "SUM host_to_device_memcpy_ce 110.33", ""]
    lines += ["Running host_to_device_bidirectional_memcpy_ce.", "memcpy CE CPU(row) <-> GPU(column) bandwidth (GB/s)"]
    lines += _matrix([0], [0, 1], {0: [52.5, 52.75]})
    lines += ["", "SUM host_to_device_bidirectional_memcpy_ce 105.25", ""]
    lines += ["Running device_to_host_bidirectional_memcpy_ce.", "memcpy CE CPU(row) <-> GPU(column) bandwidth (GB/s)"]
    lines += _matrix([0], [0, 1], {0: [50.0, 51.5]})
    lines += ["", "SUM device_to_host_bidirectional_memcpy_ce 101.50", ""]
    lines += ["Running device_to_device_latency_sm.", "Device to Device Latency SM GPU(row) <-> GPU(column) (ns)"]
    lines += _matrix([0, 1], [0, 1], {0: [None, 829.37], 1: [831.06, None]})
    lines += ["", "&&&& PERF device_to_device_latency_sm 1660.43 -ns", ""]
    lines += ["Running device_to_device_memcpy_read_sm.", "Waived: ", ""]
    lines += ["Running device_local_copy.", "Error: out of memory", ""]
    return "\n".join(lines) + "\n"


def test_parse_every_matrix_by_its_key(compare):
    matrices, status = compare.parse(sample())
    assert set(matrices) == {"device_to_device_memcpy_write_ce", "host_to_device_memcpy_ce",
                             "host_to_device_bidirectional_memcpy_ce", "device_to_host_bidirectional_memcpy_ce",
                             "device_to_device_latency_sm"} | {
        f"device_to_device_bidirectional_memcpy_write_ce_{p}" for p in ("write1", "write2", "total")}
    w = matrices["device_to_device_memcpy_write_ce"]
    assert w["testcase"] == "device_to_device_memcpy_write_ce" and w["columns"] == ["0", "1"]
    assert w["rows"] == {"0": [None, 397.42], "1": [396.81, None]} and w["sum"] == 794.23
    assert w["description"] == "memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)"
    total = matrices["device_to_device_bidirectional_memcpy_write_ce_total"]
    assert total["testcase"] == "device_to_device_bidirectional_memcpy_write_ce"
    assert total["rows"]["0"] == [None, 780.54]
    assert matrices["host_to_device_memcpy_ce"]["rows"] == {"0": [55.13, 55.2]}
    assert matrices["device_to_device_latency_sm"]["rows"]["1"] == [831.06, None]
    assert compare.cell(matrices, "device_to_device_latency_sm", 0, 1) == 829.37
    assert compare.cell(matrices, "device_to_device_latency_sm", 0, 5) is None  # no such column
    assert status == {"device_to_device_memcpy_read_sm": "Waived:", "device_local_copy": "Error: out of memory"}


def test_side_by_side_rows_ratio_and_flag(compare):
    matrices, _ = compare.parse(sample())
    n = 512 << 20

    def r(src, dst, mode, gbps):
        return {"src": src, "dst": dst, "mode": mode, "bytes": n, "gbps": gbps}
    doc = {"config": {"matrix_size": n},
           "results": [r("cuda:0", "cuda:1", "ce", 395.0), r("cuda:0", "cuda:1", "ce_bidir", 700.0),
                       r("pinned", "cuda:1", "ce", 55.0), r("pinned", "cuda:1", "ce_bidir", 103.0),
                       r("cuda:0", "cuda:1", "ce", 395.0) | {"bytes": 4096, "gbps": 1.0}],  # another size: ignored
           "latency": [{"src": "cuda:0", "dst": "cuda:1", "kind": "chase", "median_us": 0.85},
                       {"src": "cuda:0", "dst": "cuda:1", "kind": "host_call", "median_us": 36.0}]}
    rows = {(row, fig): (nvb, mine, unit) for row, fig, nvb, mine, unit in compare.pairs(matrices, doc, [0, 1])}
    assert rows[("cuda:0 -> cuda:1", "CE one way (write)")] == (397.42, 395.0, "GB/s")
    assert rows[("cuda:0 <-> cuda:1", "CE both ways (total)")] == (780.54, 700.0, "GB/s")
    assert rows[("pinned -> cuda:1", "CE host -> GPU")] == (55.2, 55.0, "GB/s")
    assert rows[("pinned <-> cuda:1", "CE both ways (total)")] == (52.75 + 51.5, 103.0, "GB/s")
    assert rows[("cuda:0 -> cuda:1", "SM latency (pointer chase)")] == (829.37, 850.0, "ns")
    lines, entries = compare.table(compare.pairs(matrices, doc, [0, 1]))
    by = {(e["row"], e["figure"]): e for e in entries}
    assert by[("cuda:0 -> cuda:1", "CE one way (write)")]["within_5pct"] is True
    assert by[("cuda:0 <-> cuda:1", "CE both ways (total)")]["within_5pct"] is False  # 0.897
    assert by[("cuda:0 <-> cuda:1", "CE both ways (total)")]["ratio"] == round(700.0 / 780.54, 4)
    assert by[("cuda:1 -> cuda:0", "CE one way (write)")]["pyxfer"] is None  # nvbandwidth only: shown, no ratio
    assert by[("cuda:1 -> cuda:0", "CE one way (write)")]["within_5pct"] is None
    assert any(" NO " in line and "both ways" in line for line in lines)
