"""Short summary of a gpu_check.sh run (reads the JSON and JUnit files it wrote)."""
import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

_ap = argparse.ArgumentParser(description=__doc__)
_ap.add_argument("out", type=Path, help="the directory gpu_check.sh wrote ($OUT)")
out = _ap.parse_args().out
rows = []
for xml in sorted(out.glob("tests*.xml")):  # tests.xml, or tests_<shard>.xml per shard
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    rows.append((xml.stem, f"{n - f - e - s} passed, {f + e} failed, {s} skipped"))
if (out / "doctor.json").exists():
    try:
        d = json.loads((out / "doctor.json").read_text())
        bad = [c["check"] for c in d["checks"] if c["status"] == "FAIL"]
        rows.append(("doctor", "ok" if not bad else "FAIL: " + ", ".join(bad)))
    except json.JSONDecodeError:
        rows.append(("doctor", "no JSON"))
b = out / "bench_checksum.json"
if b.exists():
    r = json.loads(b.read_text())
    for row in r.get("gpu_rows", []):
        if row["bytes"] >= 1 << 30:
            rows.append((f"checksum {row['bytes'] >> 30} GiB", f"{row['pyxfer_gbps']:.0f} GB/s = "
                         f"{row['pyxfer_gbps'] / row['baseline_gbps']:.1%} of int64.sum "
                         f"({row['baseline_gbps']:.0f} GB/s); target >= 90%"))
    for row in r.get("cpu_rows", []):
        rows.append((f"checksum cpu {row['bytes'] >> 20} MiB",
                     f"{row['pyxfer_gbps']:.1f} GB/s ({r['threads']} threads)"))
b = out / "bench_transfer.json"
if b.exists():
    for t in json.loads(b.read_text()).get("targets", []):
        rows.append((f"transfer: {t['target']}", f"{t['measured']}  {t['result']}"))
b = out / "bench_buffers.json"
if b.exists():
    for row in json.loads(b.read_text()).get("gpu_rows", []):
        if row["bytes"] >= 256 << 20:
            ratio = row["offload_gbps"] / row["d2h_copy_gbps"]
            rows.append((f"buffers offload {row['bytes'] >> 20} MiB", f"{row['offload_gbps']:.1f} GB/s = {ratio:.0%} "
                         f"of one D2H copy_ ({row['d2h_copy_gbps']:.1f} GB/s); target >= 80%"))
b = out / "bench_formats.json"
if b.exists():
    r = json.loads(b.read_text())
    for t in r.get("targets", []):
        rows.append((f"formats: {t['target']}", f"{t['measured']}  {t['result']}"))
for name in ("gather", "scale"):
    b = out / f"bench_{name}.json"
    if b.exists():
        for t in json.loads(b.read_text()).get("targets", []):
            if name == "scale" and t["target"].startswith("W=2:") and (out / "bench_gather.json").exists():
                continue  # scale.py (issue 6) repeats gather.py's 2-rank measurement; its W=4, W=8 rows stay
            rows.append((f"{name}: {t['target']}", f"{t['measured']}  {t['result']}"))
width = max(len(k) for k, _ in rows) if rows else 0
print("SUMMARY")
for k, v in rows:
    print(f"  {k.ljust(width)}  {v}")
