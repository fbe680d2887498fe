"""`pyxfer doctor` on the CPU, end to end: the report, the --json schema, exit codes, verdicts from
real probes with injected faults, the watchdog, the verdict cache, and each self-check failing when
its worked value is wrong."""
import json
import time
import warnings

import pytest
import torch

import pyxfer
from pyxfer import _devices
from pyxfer.testing import inject_fault, parse_env_fault
from pyxfer.tools import doctor, selftest
from pyxfer.tools.cli import main
from pyxfer.tools.verdict_cache import save_verdicts

from support.processes import run_python
from support.tool_schemas import check_doctor_schema


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No fault from the environment, the cache in a temporary directory, health restored."""
    for name in ("PYXFER_INJECT_FAULT", doctor.TEST_FAULT_ENV, "PYXFER_ROUTE", "PYXFER_HEALTH_FROM_DOCTOR",
                 "PYXFER_PEER_FUSED_MIB", "PYXFER_PEER_CHUNKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYXFER_DOCTOR_CACHE", str(tmp_path / "verdicts.json"))
    pyxfer.health.reset()
    yield
    pyxfer.health.reset()


def run_doctor(capsys, *args):
    """(exit code, stdout) of `pyxfer doctor ARGS` run through the CLI's entry point. Where GPUs are
    visible the probes stay on the pair a CPU-only machine has (cpu -> cpu) unless ARGS name pairs:
    these tests are about the doctor's logic; its GPU pairs are tests/tools/test_doctor_gpu.py's."""
    if torch.cuda.is_available() and "--pairs" not in args:
        args = (*args, "--pairs", "cpu->cpu")
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def run_json(capsys, *args):
    code, out = run_doctor(capsys, "--json", *args)
    doc = json.loads(out)
    check_doctor_schema(doc)
    assert doc["ok"] == (code == 0)
    return code, doc


def test_healthy_cpu_run_report_and_exit_code(capsys):
    code, out = run_doctor(capsys, "--no-cache")
    assert code == 0, out
    assert "GPUs: none visible" in out
    assert "[  ok] checksum vectors on cpu: 9 spec vectors match" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("cpu -> cpu"))
    assert line.split()[3] == "ok" and "injected bit flip caught" in line
    assert "0 failed; 1 of 1 pairs ok" in out


def test_json_schema_probes_and_cache_written(capsys, tmp_path):
    code, doc = run_json(capsys)
    assert code == 0
    (pair,) = doc["pairs"]
    assert (pair["src"], pair["dst"], pair["verdict"]) == ("cpu", "cpu", "ok") and pair["gbps"] > 0
    sizes = sorted({p["bytes"] for p in pair["probes"] if p["path"] == "ce"})
    assert sizes == [4093, 4 << 20, 16 << 20]  # 4 MiB and a large one (capped for cpu -> cpu)
    assert {p["path"] for p in pair["probes"]} == {"ce", "pyxfer", "pyxfer+bitflip"}
    assert [p["result"] for p in pair["probes"] if p["path"] == "pyxfer+bitflip"] == ["injected-caught"]
    assert doc["cache"]["written"] and doc["cache"]["path"] == str(tmp_path / "verdicts.json")
    cached = json.loads((tmp_path / "verdicts.json").read_text())
    assert cached["pairs"] == [{"src": "cpu", "dst": "cpu", "verdict": "ok"}]
    assert cached["key"]["torch"] == torch.__version__ and cached["key"]["pyxfer"] == pyxfer.__version__


@pytest.mark.parametrize("kind,verdict", [("zeros", "dropped"), ("bitflip", "corrupt")])
def test_fault_from_the_environment_gives_the_verdict(capsys, monkeypatch, tmp_path, kind, verdict):
    monkeypatch.setenv("PYXFER_INJECT_FAULT", f"{kind},src=cpu,dst=cpu,times=1000")
    code, doc = run_json(capsys, "--large", "1M")
    assert code == 1
    (pair,) = doc["pairs"]
    assert pair["verdict"] == verdict and pair["fault_from_env"]
    assert doc["injected_fault"] == {"spec": f"{kind},src=cpu,dst=cpu,times=1000", "kind": kind, "path": "direct",
                                     "src": "cpu", "dst": "cpu", "times": 1000}
    hit = [p for p in pair["probes"] if p["path"] == "pyxfer"]
    assert [p["result"] for p in hit] == [verdict] * 3  # the fault hits pyxfer's direct path ...
    assert all(p["result"] == "ok" for p in pair["probes"] if p["path"] == "ce")  # ... not torch's copy
    if kind == "bitflip":
        assert [p["wrong_bytes"] for p in hit] == [1, 1, 1]
    else:
        assert all(p["first_offset"] == 0 for p in hit)  # random data is rarely zero at byte 0... or the sentinel
    assert not doc["cache"]["written"] and "PYXFER_INJECT_FAULT" in doc["cache"]["note"]
    assert not (tmp_path / "verdicts.json").exists()
    if kind == "bitflip":
        return  # the text report once is enough
    code, out = run_doctor(capsys, "--large", "1M")
    assert code == 1
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("cpu -> cpu"))
    assert lines[i].split()[3] == verdict
    assert "fault is armed from PYXFER_INJECT_FAULT='" in lines[i + 1]  # said next to the verdict


@pytest.mark.parametrize("spec,why", [(",", "unknown fault kind ''"),
                                      ("zeros,times=abc", "times must be an integer >= 1"),
                                      ("melt", "unknown fault kind 'melt'"), ("bitflip,times=0", "times must be"),
                                      ("zeros,when=now", "'when=now' is not one of path=, src=, dst=, times=")])
def test_malformed_fault_variable_is_named_with_the_expected_form(spec, why):
    with pytest.raises(ValueError) as e:
        parse_env_fault(spec)
    assert str(e.value).startswith(f"PYXFER_INJECT_FAULT: {why}")
    assert "expected kind[,path=P][,src=D][,dst=D][,times=N]" in str(e.value) and str(e.value).endswith(repr(spec))
    assert parse_env_fault(" bitflip , dst=cuda:1, times=3") == {"kind": "bitflip", "path": "direct", "src": None,
                                                                  "dst": "cuda:1", "times": 3}
    assert parse_env_fault("zeros,src=1,path=gather")["src"] == 1  # ranks of the gather path are ints


def test_malformed_fault_variable_is_a_failed_check_not_a_crash(capsys, monkeypatch):
    spec = "zeros,times=abc"
    monkeypatch.setenv("PYXFER_INJECT_FAULT", spec)
    code, doc = run_json(capsys, "--no-cache", "--large", "1M")
    assert code == 1
    (check,) = [c for c in doc["checks"] if c["check"] == "PYXFER_INJECT_FAULT"]
    assert check["status"] == "FAIL"
    assert check["detail"].startswith("PYXFER_INJECT_FAULT: ") and "kind[,path=P]" in check["detail"]
    assert repr(spec) in check["detail"]
    assert doc["injected_fault"] is None and [p["verdict"] for p in doc["pairs"]] == ["ok"]  # carried on


@pytest.mark.parametrize("spec", [",", "zeros,times=abc"])
def test_malformed_fault_variable_does_not_break_import(spec):
    r = run_python("import pyxfer, torch; print(len(pyxfer.verified_copy(torch.arange(5), 'cpu')))",
                   env={"PYXFER_INJECT_FAULT": spec})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "5"
    assert "RuntimeWarning: PYXFER_INJECT_FAULT: " in r.stderr and "no fault installed" in r.stderr


def test_watchdog_reports_a_probe_that_never_finishes(capsys, monkeypatch):
    monkeypatch.setenv(doctor.TEST_FAULT_ENV, "hang:cpu->cpu")  # test-only knob: the probe child sleeps forever
    start = time.monotonic()
    code, doc = run_json(capsys, "--timeout", "2", "--no-cache")
    assert code == 1 and time.monotonic() - start < doctor.STARTUP_S
    (pair,) = doc["pairs"]
    assert pair["verdict"] == "hung" and "did not finish in 2 s" in pair["evidence"][0]


def test_a_probe_process_that_dies_is_reported(capsys, monkeypatch):
    monkeypatch.setenv(doctor.TEST_FAULT_ENV, "crash:cpu->cpu")  # test-only knob: the child aborts
    code, doc = run_json(capsys, "--no-cache")
    assert code == 1
    (pair,) = doc["pairs"]
    assert pair["verdict"] == "error" and pair["evidence"][0].startswith("probe process died (exit code -6)")


def test_a_task_that_raises_does_not_stop_the_rest():
    tasks = [{"kind": "pair", "src": "cpu", "dst": "cpu", "sizes": [4093], "seed": 1},
             {"kind": "pair", "src": "cpu", "dst": "meta", "sizes": [4093], "seed": 2},  # raises in the child
             {"kind": "pair", "src": "cpu", "dst": "cpu", "sizes": [1 << 20], "seed": 3}]
    first, broken, last = doctor.run_tasks(tasks, timeout=60)
    assert first["verdict"] == "ok" and last["verdict"] == "ok"  # the last ran in a fresh child
    assert "error" in broken and "meta" in broken["error"]


def test_classification_of_a_destination(gen):
    src = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=gen)
    src[0] = 7  # neither zero nor the sentinel at the first offset
    want = pyxfer.checksum(src)
    assert doctor._classify(src.clone(), want, src) == ("ok", {})
    sentinel = torch.full_like(src, doctor.SENTINEL)
    assert doctor._classify(sentinel, want, src) == ("dropped", {"first_offset": 0,
                                                                 "wrong_bytes": int((src != doctor.SENTINEL).sum())})
    assert doctor._classify(torch.zeros_like(src), want, src)[0] == "dropped"
    flipped = src.clone()
    flipped[4097] ^= 0x10
    assert doctor._classify(flipped, want, src) == ("corrupt", {"first_offset": 4097, "wrong_bytes": 1})


def test_a_blind_check_makes_the_pair_an_error(monkeypatch):
    """The injected bit flip proves the check works: if it goes unseen, no verdict can be trusted."""
    monkeypatch.setattr(doctor, "_classify", lambda out, expected_hash, src: ("ok", {}))
    result = doctor._probe_pair({"kind": "pair", "src": "cpu", "dst": "cpu", "sizes": [4093], "seed": 5})
    assert result["verdict"] == "error" and "injected bit flip was not caught" in result["evidence"][0]
    assert result["probes"][-1] == {"path": "pyxfer+bitflip", "bytes": 4096, "result": "injected-missed"}


def test_pair_selection(monkeypatch):
    monkeypatch.setattr(_devices, "_num_cuda_devices", 8)  # the doctor's devices exist for pyxfer's parser too
    eight = [{"index": i} for i in range(8)]
    pairs = doctor.select_pairs(eight)
    assert len(pairs) == 72 and len(set(pairs)) == 72  # 56 GPU pairs + 16 host <-> GPU
    assert ("cpu", "cuda:7") in pairs and ("cuda:7", "cpu") in pairs and ("cuda:3", "cuda:3") not in pairs
    assert doctor.select_pairs([]) == [("cpu", "cpu")]
    assert doctor.select_pairs(eight, "cpu->cuda:0, cuda:1->cuda:0") == [("cpu", "cuda:0"), ("cuda:1", "cuda:0")]
    for bad in ("cpu-cuda:0", "cpu->cuda:8", "cuda:0->"):
        with pytest.raises(ValueError, match=f"--pairs: expected SRC->DST.*got '{bad}'"):
            doctor.select_pairs(eight, bad)


def test_pairs_and_faults_are_read_by_the_one_device_parser(gpus):
    """--pairs and PYXFER_INJECT_FAULT's devices are read as every pyxfer entry point reads them
    (pyxfer._devices): 'cuda' is the current device; a device that does not exist is no pair, and a
    fault naming one hits nothing (the probes' pyxfer refuses to arm it)."""
    four = [{"index": i} for i in range(4)]
    gpus.set(2)
    assert doctor.select_pairs(four, "cpu->cuda, cuda->cuda:0") == [("cpu", "cuda:2"), ("cuda:2", "cuda:0")]
    for bad in ("cpu->cuda:4", "cpu->cuda:-1", "cpu->gpu:0", "cuda:1->cuda:1.5"):
        with pytest.raises(ValueError, match=f"--pairs: expected SRC->DST.*got '{bad}'"):
            doctor.select_pairs(four, bad)
    fault = parse_env_fault("zeros,src=cuda,dst=1")
    assert doctor._fault_matches(fault, "cuda:2", "cuda:1")
    assert not doctor._fault_matches(fault, "cuda:0", "cuda:1") and not doctor._fault_matches(fault, "cuda:2", "cpu")
    assert doctor._fault_matches(parse_env_fault("zeros"), "cuda:3", "cpu")  # no devices named: every pair
    for missing in ("src=cuda:4", "dst=9", "src=npu:0"):
        assert not doctor._fault_matches(parse_env_fault(f"zeros,{missing}"), "cuda:0", "cuda:1"), missing


def test_bad_pairs_option_exits_2(capsys):
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"  # one past the last GPU
    assert main(["doctor", "--pairs", f"cpu->{missing}"]) == 2
    assert "--pairs: expected SRC->DST" in capsys.readouterr().err


def test_slow_verdict_against_comparable_pairs():
    def pair(src, dst, gbps):
        return {"src": src, "dst": dst, "verdict": "ok", "gbps": gbps, "evidence": []}

    pairs = [pair("cuda:0", "cuda:1", 100.0), pair("cuda:1", "cuda:0", 98.0), pair("cuda:0", "cuda:2", 45.0),
             pair("cpu", "cuda:0", 20.0), pair("cpu", "cuda:1", 9.0), pair("cuda:0", "cpu", 2.0)]
    doctor._mark_slow(pairs, 0.5)
    assert [p["verdict"] for p in pairs] == ["ok", "ok", "slow", "ok", "ok", "ok"]
    assert "45.0 GB/s is under 0.5 x the median 98.0 GB/s of 3 GPU -> GPU pairs" in pairs[2]["evidence"][0]
    # two host -> GPU pairs: the median is 14.5, and 9 is not under half of it; a lone class is never slow


# ---- the verdict cache and pyxfer.health

def test_cache_round_trip_routes_a_known_bad_pair_staged(capsys, tmp_path, gen):
    assert run_doctor(capsys)[0] == 0
    path = tmp_path / "verdicts.json"
    assert pyxfer.health.load_doctor_verdicts(path) == {("cpu", "cpu"): "ok"}
    assert pyxfer.health.status("cpu", "cpu") == "healthy"
    doc = json.loads(path.read_text())
    doc["pairs"][0]["verdict"] = "corrupt"  # as a doctor run on a broken host would have written it
    path.write_text(json.dumps(doc))
    pyxfer.health.reset()
    assert pyxfer.health.load_doctor_verdicts() == {("cpu", "cpu"): "corrupt"}  # the default path: the env var
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"
    src = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=gen)
    with inject_fault("zeros", path="direct") as fault:
        out = pyxfer.verified_copy(src, "cpu")
    assert fault.used == 0 and torch.equal(out, src)  # the first copy already went staged


def test_cache_from_the_environment_at_import(tmp_path):
    path = save_verdicts([{"src": "cpu", "dst": "cpu", "verdict": "dropped"}], tmp_path / "v.json")
    code = "import pyxfer; print(pyxfer.health.status('cpu', 'cpu'))"
    assert run_python(code, env={"PYXFER_HEALTH_FROM_DOCTOR": path}).stdout.strip() == "corrupt"
    assert run_python(code, env={"PYXFER_HEALTH_FROM_DOCTOR": "1", "PYXFER_DOCTOR_CACHE": path}).stdout.strip() \
        == "corrupt"
    assert run_python(code, env={"PYXFER_HEALTH_FROM_DOCTOR": "0", "PYXFER_DOCTOR_CACHE": path}).stdout.strip() \
        == "unknown"  # opt-in only


@pytest.mark.parametrize("field,value", [("torch", "1.0.0"), ("pyxfer", "0.0.1"), ("driver", "999.9"),
                                         ("gpus", [])])
def test_cache_with_another_key_is_ignored_with_a_message(tmp_path, field, value):
    path = save_verdicts([{"src": "cpu", "dst": "cpu", "verdict": "corrupt"}], tmp_path / "v.json")
    doc = json.loads(open(path).read())
    if field == "gpus":  # a cache made on other GPUs: this process sees one the cache does not name
        value = ["GPU-00000000-0000-0000-0000-000000000000"]
        doc["key"]["gpus"] = value
        pytest.skip("needs a GPU the cache does not list") if not torch.cuda.is_available() else None
    doc["key"][field] = value
    open(path, "w").write(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match=f"ignored: made under another key \\({field}: cache"):
        assert pyxfer.health.load_doctor_verdicts(path) == {}
    assert pyxfer.health.status("cpu", "cpu") == "unknown"


def test_cache_that_is_not_a_verdict_cache_is_ignored(tmp_path):
    (tmp_path / "v.json").write_text('{"schema": "pyxfer.bench", "schema_version": 1}')
    with pytest.warns(RuntimeWarning, match="not a verdict cache"):
        assert pyxfer.health.load_doctor_verdicts(tmp_path / "v.json") == {}
    assert pyxfer.health.load_doctor_verdicts(tmp_path / "absent.json") == {}


# ---- each self-check fails when its worked value is wrong

def test_checksum_vector_check_fails_on_a_wrong_value(monkeypatch, capsys):
    name, data, seed, expected = selftest.TEST_VECTORS[4]
    vectors = list(selftest.TEST_VECTORS)
    vectors[4] = (name, data, seed, expected ^ 1)
    monkeypatch.setattr(selftest, "TEST_VECTORS", vectors)
    status, detail = doctor._vector_check("cpu")
    assert status == "FAIL" and detail == f"{name}: got {expected:016x}, expected {expected ^ 1:016x}"
    code, out = run_doctor(capsys, "--no-cache", "--large", "1M")
    assert code == 1 and f"[FAIL] checksum vectors on cpu: {name}" in out


def test_format_vector_check_fails_on_a_wrong_value(monkeypatch):
    name, fmt, build, options, expected = selftest.FORMAT_VECTORS[0]
    wrong = {**expected, "rowwise_scale_inv": [expected["rowwise_scale_inv"][0] + 1]}
    monkeypatch.setattr(selftest, "FORMAT_VECTORS",
                        [(name, fmt, build, options, wrong)] + selftest.FORMAT_VECTORS[1:])
    status, detail = doctor._format_vector_check("cpu")
    assert status == "FAIL" and detail.startswith(f"{name}: got ") and "rowwise_scale_inv" in detail
    monkeypatch.undo()
    assert doctor._format_vector_check("cpu") == ("ok", "5 worked examples of the spec match")


def test_agreement_checks_fail_when_the_sides_differ(monkeypatch):
    assert doctor._agreement_check("cpu")[0] == "ok"
    real = selftest.checksum
    calls = iter(range(10**6))
    monkeypatch.setattr(selftest, "checksum", lambda t, seed=0: real(t, seed) ^ (next(calls) % 2))
    status, detail = doctor._agreement_check("cpu")
    assert status == "FAIL" and detail.startswith("offset 0, 0 B: cpu ") and detail.count(";") == 4  # 5 shown
    assert doctor._format_agreement_check("cpu")[0] == "ok"
    real_q = selftest.__dict__.get("quantize")
    assert real_q is None  # the check imports quantize at call time: patch it in pyxfer.formats
    from pyxfer import formats
    q = formats.quantize
    flip = iter(range(10**6))

    def skewed(x, fmt, **kw):
        out = q(x, fmt, **kw)
        if next(flip) % 2:
            out.rowwise_data.view(torch.uint8).reshape(-1)[0] ^= 1
        return out
    monkeypatch.setattr(formats, "quantize", skewed)
    status, detail = doctor._format_agreement_check("cpu")
    assert status == "FAIL" and "rowwise_data" in detail


def test_build_checks_fail_on_a_mismatch(monkeypatch, capsys):
    info = pyxfer.build_info()
    assert doctor._torch_match_check(info)[0] == "ok"
    status, detail = doctor._torch_match_check({**info, "torch": "2.0.0"})
    assert status == "FAIL" and detail.startswith("built against torch 2.0.0, running torch ")
    gpu = {"index": 0, "capability": "9.0"}
    assert doctor._cuda_build_check({**info, "cuda": False}, [gpu])[0] == "FAIL"
    assert doctor._cuda_build_check({**info, "cuda": False}, [])[0] == "skip"
    assert doctor._cuda_build_check({**info, "cuda": True, "cuda_version": "13.0", "cuda_archs": ["sm_90"]},
                                    [gpu]) == ("ok", "CUDA 13.0 build for sm_90")
    assert doctor._arch_check({"cuda_archs": ["sm_90"]}, gpu) == ("ok", "sm_90 machine code in the build")
    assert doctor._arch_check({"cuda_archs": ["sm_80"]}, gpu)[1].startswith(
        "no sm_90 machine code; runs from sm_80 PTX")
    assert doctor._arch_check({"cuda_archs": ["sm_100"]}, gpu)[0] == "FAIL"
    monkeypatch.setattr(pyxfer._build, "build_info", lambda: {**info, "torch": "2.0.0"})
    code, out = run_doctor(capsys, "--no-cache", "--large", "1M")
    assert code == 1 and "[FAIL] build matches torch: built against torch 2.0.0" in out


def test_a_check_that_raises_is_a_failed_check():
    def broken():
        raise RuntimeError("no such device")
    r = doctor.run_check("x", broken)
    assert (r["status"], r["detail"]) == ("FAIL", "RuntimeError: no such device")


# ---- paths the runs above do not take: the fault's reach, an unwritable cache, a multi-GPU report

def test_which_pairs_an_environment_fault_can_hit(gpus):
    def hits(spec, src="cpu", dst="cpu"):
        return doctor._fault_matches(parse_env_fault(spec), src, dst)

    assert hits("zeros")  # no src / dst: any pair
    assert hits("zeros,src=cpu,dst=cpu") and not hits("zeros,dst=cuda:1") and not hits("zeros,src=cuda:0")
    assert hits("bitflip,dst=1", "cuda:0", "cuda:1") and not hits("bitflip,dst=1", "cuda:1", "cuda:0")  # an index
    assert hits("zeros,dst=cuda", "cpu", "cuda:0")  # 'cuda': the current device, where pyxfer arms it
    assert not hits("zeros,src=gpu7")  # not a device: the probes' pyxfer refuses to arm it (a warning)
    assert not hits("zeros,path=gather")  # the gather path never touches a pair's copies


def test_a_fault_for_any_pair_is_said_next_to_the_verdict(capsys, monkeypatch):
    monkeypatch.setenv("PYXFER_INJECT_FAULT", "zeros,times=1000")
    code, doc = run_json(capsys, "--large", "1M", "--pairs", "cpu->cpu")
    (pair,) = doc["pairs"]
    assert code == 1 and pair["verdict"] == "dropped" and pair["fault_from_env"]
    assert doc["injected_fault"]["src"] is None and doc["injected_fault"]["dst"] is None


def test_an_unwritable_cache_is_reported_not_fatal(capsys, tmp_path, monkeypatch):
    # the default cache ($PYXFER_DOCTOR_CACHE here) cannot be written: said, the verdicts stand (an
    # unwritable --cache is a bad option instead: test_cache_option_is_checked_before_any_probe)
    (tmp_path / "file").write_text("a file where the cache's directory should be")
    monkeypatch.setenv("PYXFER_DOCTOR_CACHE", str(tmp_path / "file" / "v.json"))
    code, doc = run_json(capsys, "--large", "1M", "--pairs", "cpu->cpu")
    assert code == 0 and [p["verdict"] for p in doc["pairs"]] == ["ok"]
    assert doc["cache"]["written"] is False and doc["cache"]["path"] is None
    assert doc["cache"]["note"].startswith("not written: [Errno ") and str(tmp_path / "file") in doc["cache"]["note"]


def test_report_lists_gpus_and_the_peer_matrix():
    import io
    report = doctor.Report()
    doctor.doctor(report, pairs=[])  # the facts and host self-checks, no probe
    report.section("gpus", [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0a", "capability": "9.0", "memory_gib": 79.1,
         "sms": 132},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "uuid": None, "capability": "9.0", "memory_gib": 79.1,
         "sms": 132}])
    report.section("peer_access", [[None, True], [False, None]])
    out = io.StringIO()
    doctor.print_report(report, out)
    lines = out.getvalue().splitlines()
    assert "GPUs: none visible" not in lines
    i = lines.index("  cuda:0  NVIDIA H100 80GB HBM3  sm_90  79.1 GiB  132 SMs  GPU-0a")
    assert lines[i + 1] == "  cuda:1  NVIDIA H100 80GB HBM3  sm_90  79.1 GiB  132 SMs  "
    assert lines[i + 2:i + 6] == ["peer access (row = source, column = destination):",
                                  "             0     1", "       0     -   yes", "       1    no     -"]
    assert lines[-1].startswith(f"{len(report.checks)} checks passed or skipped, 0 failed; 0 of 0 pairs ok  (")
    assert not report.failed  # and no "verdict cache:" line: this report has no cache section


def test_cache_path_defaults(monkeypatch, tmp_path):
    from pyxfer.tools.verdict_cache import cache_path
    monkeypatch.delenv("PYXFER_DOCTOR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == str(tmp_path / "xdg" / "pyxfer" / "doctor-verdicts.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_path() == str(tmp_path / ".cache" / "pyxfer" / "doctor-verdicts.json")
    monkeypatch.setenv("PYXFER_DOCTOR_CACHE", str(tmp_path / "env.json"))
    assert cache_path() == str(tmp_path / "env.json")
    assert cache_path(tmp_path / "arg.json") == str(tmp_path / "arg.json")


def test_cache_applies_only_bad_and_ok_verdicts_of_visible_devices(tmp_path):
    path = save_verdicts([{"src": "cpu", "dst": "cpu", "verdict": "slow"}], tmp_path / "v.json")
    doc = json.loads(open(path).read())
    unseen = "GPU-00000000-0000-0000-0000-00000000beef"  # a GPU the doctor saw and this process does not
    doc["pairs"] += [{"src": "cpu", "dst": unseen, "verdict": "corrupt"},
                     {"src": unseen, "dst": "cpu", "verdict": "ok"}]
    open(path, "w").write(json.dumps(doc))
    assert pyxfer.health.load_doctor_verdicts(path) == {}  # slow: the data was right; the GPU pairs: not here
    assert pyxfer.health.status("cpu", "cpu") == "unknown"
    doc["pairs"].append({"src": "cpu", "dst": "cpu", "verdict": "hung"})
    open(path, "w").write(json.dumps(doc))
    assert pyxfer.health.load_doctor_verdicts(path) == {("cpu", "cpu"): "hung"}
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"


@pytest.mark.parametrize("option,expected", [("--timeout", "a positive number of seconds up to 604800 (a week)"),
                                             ("--slow-fraction", "a fraction in (0, 1]")])
@pytest.mark.parametrize("value", ["abc", "0", "-2", "nan"])
def test_options_that_must_be_positive(capsys, option, expected, value):
    with pytest.raises(SystemExit) as e:
        main(["doctor", option, value])
    assert e.value.code == 2 and f"argument {option}: expected {expected}, got {value!r}" in capsys.readouterr().err


# ---- the environment the user's copies run with; options checked before any probe

def environment_check(doc):
    (check,) = [c for c in doc["checks"] if c["check"] == "PYXFER_* environment"]
    return check["status"], check["detail"]


def test_an_invalid_route_in_the_environment_fails_the_doctor(capsys, monkeypatch):
    """PYXFER_ROUTE=fast makes every default-route verified_copy raise: the doctor's probes name their
    routes, so only a check of the environment itself can say so."""
    monkeypatch.setenv("PYXFER_ROUTE", "fast")
    code, doc = run_json(capsys, "--no-cache", "--large", "1M")
    assert code == 1 and not doc["ok"]
    status, detail = environment_check(doc)
    assert status == "FAIL" and detail == ("PYXFER_ROUTE='fast': expected one of auto, direct, staged; every "
                                           "verified_copy without route= raises ValueError")
    assert [p["verdict"] for p in doc["pairs"]] == ["ok"]  # the pairs themselves are fine
    assert doctor._environment_check({"PYXFER_ROUTE": "staged"}) == ("ok", "PYXFER_ROUTE='staged' (valid)")


@pytest.mark.parametrize("env,why", [
    ({"PYXFER_ROUTE": ""}, "PYXFER_ROUTE='': expected one of auto, direct, staged"),
    ({"PYXFER_PEER_FUSED_MIB": "-1"}, "PYXFER_PEER_FUSED_MIB='-1': expected a size in MiB such as '64'"),
    ({"PYXFER_PEER_FUSED_MIB": "lots"}, "PYXFER_PEER_FUSED_MIB='lots': expected a size in MiB"),
    ({"PYXFER_PEER_CHUNKS": "2"}, "PYXFER_PEER_CHUNKS='2': expected '<shrink>,<min chunk MiB>' such as '6,2'"),
    ({"PYXFER_PEER_CHUNKS": "2,0"}, "PYXFER_PEER_CHUNKS='2,0': expected '<shrink>,<min chunk MiB>'"),
    ({"PYXFER_HEALTH_FROM_DOCTOR": "yes"}, "PYXFER_HEALTH_FROM_DOCTOR='yes': expected 1 (the cache at "),
])
def test_environment_values_pyxfer_refuses_fail_the_check(env, why):
    status, detail = doctor._environment_check(env)
    assert status == "FAIL" and detail.startswith(why), detail


def test_environment_values_pyxfer_accepts_pass_the_check(tmp_path):
    # as the native knobs read them (sscanf: the number first, the rest ignored)
    env = {"PYXFER_PEER_FUSED_MIB": "0", "PYXFER_PEER_CHUNKS": " 2, 8.5", "PYXFER_ROUTE": "auto",
           "PYXFER_ROUT": "staged"}
    status, detail = doctor._environment_check(env)
    assert status == "ok" and detail.startswith("PYXFER_ROUTE='auto', PYXFER_PEER_FUSED_MIB='0', PYXFER_PEER_CHUNKS=")
    assert detail.endswith("read by nothing in pyxfer: PYXFER_ROUT")  # a typo is said, not failed
    assert doctor._environment_check({}) == ("ok", "none set (valid)")
    path = save_verdicts([{"src": "cpu", "dst": "cpu", "verdict": "ok"}], tmp_path / "v.json")
    assert doctor._environment_check({"PYXFER_HEALTH_FROM_DOCTOR": path})[0] == "ok"
    (tmp_path / "bad.json").write_text('{"schema": "pyxfer.doctor.verdicts", "schema_version": 1, "key": 5, '
                                       '"pairs": []}')
    status, detail = doctor._environment_check({"PYXFER_HEALTH_FROM_DOCTOR": str(tmp_path / "bad.json")})
    assert status == "FAIL" and detail.startswith(f"PYXFER_HEALTH_FROM_DOCTOR={str(tmp_path / 'bad.json')!r}: not a "
                                                  f"verdict cache ('key' must be an object")


@pytest.mark.parametrize("value", ["inf", "1e300", "1e10"])
def test_timeout_too_large_for_the_watchdog_is_a_bad_option(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--timeout", value, "--no-cache"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1] == (
        f"pyxfer doctor: error: argument --timeout: expected a positive number of seconds up to 604800 (a week), "
        f"got {value!r}")


def test_slow_verdict_of_a_two_pair_class():
    """A 2-GPU machine has two pairs per class: the median of two is their mean, and a pair under half
    of it is slow (30 < 0.5 x 65); the faster one is not."""
    def pair(src, dst, gbps):
        return {"src": src, "dst": dst, "verdict": "ok", "gbps": gbps, "evidence": []}

    pairs = [pair("cuda:0", "cuda:1", 100.0), pair("cuda:1", "cuda:0", 30.0)]
    doctor._mark_slow(pairs, 0.5)
    assert [p["verdict"] for p in pairs] == ["ok", "slow"]
    assert pairs[1]["evidence"] == ["30.0 GB/s is under 0.5 x the median 65.0 GB/s of 2 GPU -> GPU pairs"]
    assert pairs[0]["evidence"] == []


def test_a_pair_given_twice_is_a_bad_option(capsys):
    with pytest.raises(ValueError, match=r"^--pairs: expected each pair once, got cpu->cpu twice in "
                                         r"'cpu->cpu, cpu -> cpu'$"):
        doctor.select_pairs([], "cpu->cpu, cpu -> cpu")
    assert main(["doctor", "--pairs", "cpu->cpu,cpu->cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "pyxfer doctor: --pairs: expected each pair once, got cpu->cpu twice in " \
                                "'cpu->cpu,cpu->cpu'\n"


@pytest.mark.parametrize("where", ["directory", "missing directory", "under a file"])
def test_cache_option_is_checked_before_any_probe(capsys, tmp_path, where):
    (tmp_path / "file").write_text("x")
    path = {"directory": tmp_path, "missing directory": tmp_path / "no" / "v.json",
            "under a file": tmp_path / "file" / "v.json"}[where]
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--cache", str(path), "--large", "1M"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""  # nothing probed, nothing printed but the error
    expected = f"expected a file to write, got the directory {str(path)!r}" if where == "directory" else \
        f"expected a file in an existing directory, got {str(path)!r} ({path.parent} is not a directory)"
    assert err.splitlines()[-1] == f"pyxfer doctor: error: argument --cache: {expected}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no temporary file left behind


def test_a_cache_that_cannot_be_written_leaves_no_temporary_file(capsys, tmp_path, monkeypatch):
    (tmp_path / "v.json").mkdir()  # a directory where the cache file should be
    with pytest.raises(IsADirectoryError):
        save_verdicts([{"src": "cpu", "dst": "cpu", "verdict": "ok"}], tmp_path / "v.json")
    assert [p.name for p in tmp_path.iterdir()] == ["v.json"]
    monkeypatch.setenv("PYXFER_DOCTOR_CACHE", str(tmp_path / "v.json"))  # the default path: said, not fatal
    code, doc = run_json(capsys, "--large", "1M")
    assert code == 0 and doc["cache"]["note"].startswith("not written: [Errno 21] Is a directory")
    assert [p.name for p in tmp_path.iterdir()] == ["v.json"]


def malformed_cache(tmp_path, field, value):
    path = save_verdicts([{"src": "cpu", "dst": "cpu", "verdict": "corrupt"}], tmp_path / "v.json")
    doc = json.loads(open(path).read())
    doc[field] = value
    open(path, "w").write(json.dumps(doc))
    return path


@pytest.mark.parametrize("field,value,why", [
    ("key", 5, "'key' must be an object"), ("key", None, "'key' must be an object"),
    ("key", ["a", "b"], "'key' must be an object"), ("pairs", 5, "'pairs' must be a list"),
    ("pairs", None, "'pairs' must be a list"), ("pairs", ["cpu", "cpu"], "'pairs' must be a list"),
    ("pairs", [{"src": "cpu", "dst": "cpu", "verdict": 5}], "'pairs' must be a list"),
])
def test_a_malformed_key_or_pairs_is_ignored_with_a_warning(tmp_path, field, value, why):
    path = malformed_cache(tmp_path, field, value)
    with pytest.warns(RuntimeWarning, match=f"ignored: not a verdict cache \\({why}"):
        assert pyxfer.health.load_doctor_verdicts(path) == {}
    assert pyxfer.health.status("cpu", "cpu") == "unknown"  # nothing of it applied


def test_a_malformed_cache_from_the_environment_does_not_break_import_or_the_doctor(tmp_path, capsys,
                                                                                     monkeypatch):
    path = malformed_cache(tmp_path, "pairs", ["cpu", "cpu"])
    r = run_python("import pyxfer; print(pyxfer.health.status('cpu', 'cpu'))", env={"PYXFER_HEALTH_FROM_DOCTOR": path})
    assert r.returncode == 0 and r.stdout.strip() == "unknown", r.stderr
    assert f"RuntimeWarning: pyxfer: doctor verdict cache {path} ignored: not a verdict cache ('pairs' must be" \
        in r.stderr
    # the probe children import pyxfer under the same variable: their pairs are probed, the check says why
    monkeypatch.setenv("PYXFER_HEALTH_FROM_DOCTOR", path)
    code, doc = run_json(capsys, "--no-cache", "--large", "1M")
    assert code == 1 and [p["verdict"] for p in doc["pairs"]] == ["ok"]
    status, detail = environment_check(doc)
    assert status == "FAIL" and detail.startswith(f"PYXFER_HEALTH_FROM_DOCTOR={path!r}: not a verdict cache "
                                                  f"('pairs' must be a list")
    assert detail.endswith("; imports load no verdicts")


def test_the_verdict_cache_returns_verdicts_and_health_applies_them():
    """No import circle: pyxfer.tools.verdict_cache never imports pyxfer.health (health imports the
    cache, lazily), and ``import pyxfer`` imports nothing of the tools unless
    $PYXFER_HEALTH_FROM_DOCTOR asks for the doctor's verdicts."""
    import ast
    import inspect

    from pyxfer.tools import verdict_cache
    tree = ast.parse(inspect.getsource(verdict_cache))
    imported = {f"{n.module or ''}:{a.name}" if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not [i for i in imported if "health" in i], imported
    code = "import sys, pyxfer; print(sorted(m for m in sys.modules if m.startswith('pyxfer.tools')))"
    for value, loaded in (("", "[]"), ("0", "[]"), ("1", "['pyxfer.tools', 'pyxfer.tools.verdict_cache']")):
        r = run_python(code, env={"PYXFER_HEALTH_FROM_DOCTOR": value})
        assert r.returncode == 0 and r.stdout.split("\n")[-2] == loaded, (value, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("value", ["true", "yes", "missing.json", "1"])
def test_health_from_doctor_that_loads_nothing_says_so(tmp_path, monkeypatch, value):
    from pyxfer.health import load_from_env
    monkeypatch.chdir(tmp_path)  # "missing.json" and friends: no such file here
    monkeypatch.setenv("PYXFER_HEALTH_FROM_DOCTOR", value)  # "1": the default cache, absent in tmp_path
    expected = (f"PYXFER_HEALTH_FROM_DOCTOR=1: there is no verdict cache at {tmp_path / 'verdicts.json'} "
                f"(run `pyxfer doctor`)") if value == "1" else (
        f"PYXFER_HEALTH_FROM_DOCTOR={value!r}: expected 1 (the cache at {tmp_path / 'verdicts.json'}), 0, or the "
        f"path of a verdict cache file, and there is no file {value!r}")
    with pytest.warns(RuntimeWarning) as record:
        assert load_from_env() == {}
    assert [str(w.message) for w in record] == [f"pyxfer: {expected}: no doctor verdicts loaded"]
    monkeypatch.setenv("PYXFER_HEALTH_FROM_DOCTOR", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_from_env() == {}  # off: nothing to say
