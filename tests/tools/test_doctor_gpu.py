"""`pyxfer doctor` on a GPU: cpu <-> cuda:0 verdicts from real probes, faults injected in the probe
child through PYXFER_INJECT_FAULT, and the time of a doctor run. Each run is a child process."""
import json
import os
import subprocess
import sys

import pytest

from support.tool_schemas import check_doctor_schema

pytestmark = pytest.mark.gpu


def doctor_json(*args, env=None):
    cmd = [sys.executable, "-m", "pyxfer", "doctor", "--json", "--no-cache", *args]
    environ = {k: v for k, v in os.environ.items() if k != "PYXFER_INJECT_FAULT"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**environ, **(env or {})})
    doc = json.loads(r.stdout)
    check_doctor_schema(doc)
    return r.returncode, doc


def verdicts(doc):
    return {(p["src"], p["dst"]): p["verdict"] for p in doc["pairs"]}


def test_host_gpu_pairs_ok_with_gpu_self_checks():
    code, doc = doctor_json("--pairs", "cpu->cuda:0,cuda:0->cpu")
    assert code == 0, [c for c in doc["checks"] if c["status"] == "FAIL"] + doc["pairs"]
    assert verdicts(doc) == {("cpu", "cuda:0"): "ok", ("cuda:0", "cpu"): "ok"}
    for pair in doc["pairs"]:
        sizes = {p["bytes"] for p in pair["probes"] if p["path"] == "ce"}
        assert sizes == {4093, 4 << 20, 64 << 20} and pair["gbps"] > 1
        assert {p["path"] for p in pair["probes"]} == {"ce", "pyxfer", "pyxfer+bitflip"}
    names = {c["check"]: c["status"] for c in doc["checks"]}
    for check in ("checksum vectors on cuda:0", "checksum cpu == cuda:0", "formats reference values on cuda:0",
                  "formats cpu == cuda:0", "architecture of cuda:0"):
        assert names[check] == "ok", check
    print(f"doctor cpu <-> cuda:0: {doc['seconds']} s")


@pytest.mark.parametrize("spec,bad_pair,verdict", [
    ("zeros,dst=cuda:0,times=1000", ("cpu", "cuda:0"), "dropped"),
    ("bitflip,src=cuda:0,dst=cpu,times=1000", ("cuda:0", "cpu"), "corrupt"),
])
def test_fault_injected_in_the_probe_child(spec, bad_pair, verdict):
    code, doc = doctor_json("--pairs", "cpu->cuda:0,cuda:0->cpu", env={"PYXFER_INJECT_FAULT": spec})
    assert code == 1
    other = ("cuda:0", "cpu") if bad_pair == ("cpu", "cuda:0") else ("cpu", "cuda:0")
    assert verdicts(doc) == {bad_pair: verdict, other: "ok"}  # the fault names one direction only
    flags = {(p["src"], p["dst"]): p["fault_from_env"] for p in doc["pairs"]}
    assert flags == {bad_pair: True, other: False}
    (pair,) = [p for p in doc["pairs"] if (p["src"], p["dst"]) == bad_pair]
    hit = [p for p in pair["probes"] if p["path"] == "pyxfer"]
    assert [p["result"] for p in hit] == [verdict] * 3
    if verdict == "corrupt":
        assert [p["wrong_bytes"] for p in hit] == [1, 1, 1]


def test_a_full_doctor_run_and_its_time():
    code, doc = doctor_json()
    n = len(doc["gpus"])
    assert len(doc["pairs"]) == 2 * n + n * (n - 1)
    print(f"doctor on {n} GPU(s), {len(doc['pairs'])} pairs: {doc['seconds']} s; verdicts {verdicts(doc)}")
    assert doc["seconds"] < 120  # the design bound (8 GPUs, 72 pairs); one GPU takes a fraction of it
    assert code == (0 if doc["ok"] else 1)
