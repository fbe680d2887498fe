"""The --json documents of `pyxfer bench` and `pyxfer doctor` as their modules' docstrings document
them (pyxfer/tools/bench.py, pyxfer/tools/doctor.py), checked by the CPU and the GPU tests alike."""
import torch

import pyxfer
from pyxfer.tools import bench

VERDICTS = {"ok", "corrupt", "dropped", "slow", "unsupported", "hung", "error"}


def check_bench_schema(doc):
    """The --json document as pyxfer/tools/bench.py's docstring documents it (schema pyxfer.bench, 1)."""
    bench.validate(doc)
    assert doc["schema"] == "pyxfer.bench" and doc["schema_version"] == 2
    assert isinstance(doc["gpu"], bool) and isinstance(doc["argv"], list) and doc["created"].endswith("+00:00")
    m = doc["machine"]
    assert {"host", "platform", "python", "torch", "torch_cuda", "driver", "nvidia_driver", "gpus", "peer_access",
            "pyxfer", "build", "threads", "env"} <= set(m)
    assert m["nvidia_driver"] is None or isinstance(m["nvidia_driver"], str)
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


def check_doctor_schema(doc):
    """The --json document as pyxfer/tools/doctor.py's docstring documents it (schema pyxfer.doctor, 2)."""
    assert doc["schema"] == "pyxfer.doctor" and doc["schema_version"] == 2
    assert isinstance(doc["ok"], bool) and isinstance(doc["seconds"], float)
    assert {"pyxfer", "torch", "cuda", "cuda_archs"} <= set(doc["build"])
    assert set(doc["system"]) == {"python", "platform", "torch", "torch_cuda", "driver"}
    for g in doc["gpus"]:
        assert set(g) == {"index", "name", "uuid", "capability", "memory_gib", "sms"}
    assert len(doc["peer_access"]) == len(doc["gpus"])
    fault = doc["injected_fault"]
    assert fault is None or set(fault) == {"spec", "kind", "path", "src", "dst", "times"}
    for c in doc["checks"]:
        assert set(c) == {"check", "status", "detail", "seconds"} and c["status"] in ("ok", "FAIL", "skip")
        assert isinstance(c["detail"], str) and c["detail"]
    for p in doc["pairs"]:
        assert set(p) == {"src", "dst", "verdict", "evidence", "gbps", "seconds", "fault_from_env", "probes"}
        assert p["verdict"] in VERDICTS and p["evidence"] and all(isinstance(e, str) for e in p["evidence"])
        assert isinstance(p["fault_from_env"], bool)
        for probe in p["probes"]:
            assert {"path", "bytes", "result"} <= set(probe)
            assert probe["result"] in ("ok", "corrupt", "dropped", "injected-caught", "injected-missed")
            if probe["result"] in ("corrupt", "dropped"):
                assert isinstance(probe["first_offset"], int) and probe["wrong_bytes"] > 0
    assert set(doc["cache"]) == {"path", "written", "note"}
