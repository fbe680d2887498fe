"""`pyxfer doctor`'s third version on the CPU: the advice by path, the absolute floors (on a machine description
as the doctor builds it, of GPUs this machine does not have), the link error counters (unavailable here; their
rise on a described machine), --repeat / --duration, and --env's exports from a verdict cache."""
import itertools
import json
import os
import subprocess
import time

import pytest

import pyxfer
from pyxfer.tools import advice, doctor, exports, floors, links
from pyxfer.tools.verdict_cache import cache_key

from support.doctor_cli import isolated, run_doctor, run_doctor_err, run_json  # noqa: F401  (isolated: an autouse fixture)

H100 = "NVIDIA H100 80GB HBM3"


def machine(n=2, name=H100, kind="nvlink", pcie=None, peer=True):
    """A machine description as the doctor builds it: n GPUs of one model, every pair with peer access over
    ``kind`` (None: NVML did not say), each GPU's PCIe link ``pcie``."""
    return {"gpus": [{"index": i, "name": name} for i in range(n)],
            "peer_access": [[None if i == j else peer for j in range(n)] for i in range(n)],
            "links": {} if kind is None else {(i, j): kind for i in range(n) for j in range(n) if i != j},
            "pcie": {} if pcie is None else {i: dict(pcie) for i in range(n)}}


def pair(src, dst, gbps, verdict="ok", staged=None):
    return {"src": src, "dst": dst, "verdict": verdict, "evidence": ["probes exact"], "gbps": gbps,
            "staged_gbps": staged}


def finish(pairs, desc, *, large=256 << 20, rises=None, table=None, fraction=0.5):
    doctor.finish_pairs(pairs, desc, floors=floors.load_floors() if table is None else table, large=large,
                        slow_fraction=fraction, rises=rises or {})
    return {(p["src"], p["dst"]): p for p in pairs}


# ---- advice

def test_every_path_and_problem_has_advice_and_each_path_its_own():
    for path, problem in itertools.product(advice.PATHS, advice.PROBLEMS):
        lines = advice.advice(path, problem)
        assert lines and all(isinstance(x, str) and len(x) > 20 for x in lines), (path, problem)
    nvlink, pcie = advice.advice("nvlink", "fault"), advice.advice("pcie", "fault")
    assert any("nvidia-smi topo -p2p n" in x for x in nvlink) and any("fabricmanager" in x for x in nvlink)
    assert any("ACSCtl" in x for x in pcie) and any("IOMMU" in x for x in pcie) and any("BAR1" in x for x in pcie)
    assert not any("ACS" in x for x in nvlink) and not any("fabricmanager" in x for x in pcie)
    assert any("topo -p2p r" in x for x in advice.advice("none", "unsupported"))
    assert any("--env" in x for x in nvlink)  # what keeps other software off the pair meanwhile
    assert any("Xid" in x for x in advice.advice("host", "hung"))


@pytest.mark.parametrize("path,problem,bad", [("wormhole", "fault", "path"), ("nvlink", "melted", "problem")])
def test_advice_names_the_argument_it_refuses(path, problem, bad):
    with pytest.raises(ValueError, match=f"advice: {bad} must be one of"):
        advice.advice(path, problem)


def test_a_bad_pair_carries_its_paths_advice_and_an_ok_pair_none():
    out = finish([pair("cuda:0", "cuda:1", 380.0, "corrupt"), pair("cuda:1", "cuda:0", 381.0),
                  pair("cpu", "cuda:0", None, "hung"), pair("cuda:0", "cpu", 53.0)], machine(kind="pcie"))
    assert out[("cuda:0", "cuda:1")]["path"] == "pcie"
    assert out[("cuda:0", "cuda:1")]["advice"] == advice.advice("pcie", "fault")
    host = out[("cpu", "cuda:0")]
    assert host["path"] == "host" and host["advice"] == advice.advice("host", "hung")
    assert out[("cuda:1", "cuda:0")]["advice"] == [] and out[("cuda:0", "cpu")]["advice"] == []


def test_paths_follow_peer_access_and_what_nvml_says():
    out = finish([pair("cuda:0", "cuda:1", 50.0, "unsupported"), pair("cuda:0", "cuda:0", 1500.0)],
                 machine(peer=False))
    assert out[("cuda:0", "cuda:1")]["path"] == "none" and out[("cuda:0", "cuda:0")]["path"] == "local"
    assert "topo -p2p r" in out[("cuda:0", "cuda:1")]["advice"][0]
    assert finish([pair("cuda:0", "cuda:1", 380.0)], machine(kind=None))[("cuda:0", "cuda:1")]["path"] == "peer"
    assert finish([pair("cpu", "cpu", 9.0)], machine(0))[("cpu", "cpu")]["path"] == "memory"


# ---- floors

def test_a_uniformly_slow_machine_is_slow_by_its_floor_not_its_median():
    """Both directions of an H100 NVLink pair at 300 GB/s: the median check passes them, the floor does not."""
    out = finish([pair("cuda:0", "cuda:1", 300.0), pair("cuda:1", "cuda:0", 301.0), pair("cpu", "cuda:0", 54.9),
                  pair("cpu", "cuda:1", 47.0)], machine(pcie={"gen": 5, "width": 16}))
    fwd = out[("cuda:0", "cuda:1")]
    assert fwd["verdict"] == "slow" and fwd["floor_gbps"] == 335.0 and "Azure" in fwd["floor_source"]
    assert "300.0 GB/s is under the floor of 335 GB/s for nvlink" in fwd["evidence"][-1]
    assert fwd["advice"] == advice.advice("nvlink", "slow")
    assert out[("cpu", "cuda:0")]["verdict"] == "ok" and out[("cpu", "cuda:0")]["floor_gbps"] == 48.0
    assert out[("cpu", "cuda:1")]["verdict"] == "slow"  # 47 < 48, though 0.86 of the host pairs' median


def test_floors_by_pcie_generation_and_width_and_none_for_a_small_probe():
    desc = machine(name="NVIDIA A40", kind="pcie", pcie={"gen": 4, "width": 8})
    out = finish([pair("cpu", "cuda:0", 11.0), pair("cuda:0", "cuda:1", 5.0)], desc)
    host = out[("cpu", "cuda:0")]
    assert host["floor_gbps"] == 12.0 and host["floor_source"].endswith(", x8") and host["verdict"] == "slow"
    assert out[("cuda:0", "cuda:1")]["floor_gbps"] is None  # no built-in floor for PCIe peer paths
    assert out[("cuda:0", "cuda:1")]["verdict"] == "ok"
    small = finish([pair("cuda:0", "cuda:1", 300.0)], machine(), large=64 << 20)[("cuda:0", "cuda:1")]
    assert small["verdict"] == "ok" and small["floor_gbps"] is None  # under floors.MIN_BYTES: not comparable
    unknown = finish([pair("cpu", "cuda:0", 1.0)], machine(name="NVIDIA A40"))[("cpu", "cuda:0")]
    assert unknown["floor_gbps"] is None and unknown["verdict"] == "ok"  # no NVML: PCIe generation unknown


def test_the_median_check_stays_beside_the_floor():
    out = finish([pair("cuda:0", "cuda:1", 390.0), pair("cuda:1", "cuda:0", 150.0)] +
                 [pair(f"cuda:{i}", f"cuda:{j}", 385.0) for i, j in ((0, 2), (2, 0), (1, 2), (2, 1))],
                 machine(3))
    slow = out[("cuda:1", "cuda:0")]
    assert slow["verdict"] == "slow" and any("median" in e for e in slow["evidence"])
    assert all(p["verdict"] == "ok" for k, p in out.items() if k != ("cuda:1", "cuda:0"))


def test_a_floors_file_comes_before_the_built_in_floors(tmp_path):
    f = tmp_path / "floors.json"
    f.write_text(json.dumps({"floors": [{"gpu": "H100", "path": "nvlink", "gbps": 390, "source": "our racks"},
                                        {"path": "host", "pcie_gen": 5, "gbps": 50}]}))
    table = floors.load_floors(str(f))
    assert table[2:] == list(floors.BUILTIN)
    out = finish([pair("cuda:0", "cuda:1", 380.0), pair("cpu", "cuda:0", 49.0)],
                 machine(name="NVIDIA A100-SXM4-80GB", pcie={"gen": 5, "width": 16}), table=table)
    assert out[("cuda:0", "cuda:1")]["floor_gbps"] is None  # "H100" does not match an A100
    assert out[("cpu", "cuda:0")]["floor_gbps"] == 50.0 and out[("cpu", "cuda:0")]["verdict"] == "slow"
    h100 = finish([pair("cuda:0", "cuda:1", 380.0)], machine(), table=table)[("cuda:0", "cuda:1")]
    assert (h100["floor_gbps"], h100["floor_source"], h100["verdict"]) == (390.0, "our racks", "slow")


@pytest.mark.parametrize("content,why", [
    ("[]", "expected an object {\"floors\": [...]}"),
    ("{\"floors\": [{\"path\": \"nvlink\"}]}", "floors[0]: 'gbps' must be a number > 0, got None"),
    ("{\"floors\": [{\"path\": \"wire\", \"gbps\": 3}]}", "floors[0]: 'path' must be one of"),
    ("{\"floors\": [{\"path\": \"host\", \"gbps\": 3, \"pcie_gen\": \"5\"}]}", "'pcie_gen' must be an integer"),
    ("{\"floors\": [{\"path\": \"host\", \"gbps\": 3, \"gpu\": \"H1[\"}]}", "'gpu' is not a regular expression"),
    ("{\"floors\": [{\"path\": \"host\", \"gbps\": 3, \"speed\": 1}]}", "unknown keys ['speed']"),
    ("{\"floors\": [1]}", "floors[0]: expected an object"),
    ("not json", "not JSON")])
def test_a_malformed_floors_file_is_refused_before_any_probe(capsys, tmp_path, content, why):
    f = tmp_path / "floors.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=r"^--floors "):
        floors.load_floors(str(f))
    code, out, err = run_doctor_err(capsys, "--floors", str(f))
    assert code == 2 and out == "" and err.startswith(f"pyxfer doctor: --floors {f}") and why in err
    code, _, err = run_doctor_err(capsys, "--floors", str(tmp_path / "missing.json"))
    assert code == 2 and "No such file" in err


# ---- p2p against staged, link error counters

def test_p2p_slower_than_staged_is_noted_with_its_advice():
    out = finish([pair("cuda:0", "cuda:1", 9.0, staged=11.5), pair("cuda:1", "cuda:0", 25.0, staged=11.0)],
                 machine(name="NVIDIA L40S", kind="pcie"))
    slow = out[("cuda:0", "cuda:1")]
    assert slow["notes"] == ["p2p slower than staged"] and slow["verdict"] == "ok"
    assert "9.0 GB/s direct, 11.5 GB/s through host memory" in slow["evidence"][-1]
    assert slow["advice"] == advice.advice("pcie", "p2p-slower-than-staged")
    assert out[("cuda:1", "cuda:0")]["notes"] == [] and out[("cuda:1", "cuda:0")]["advice"] == []


def test_counters_are_unavailable_here_and_say_why():
    for got in (links.read_counters(["GPU-00000000-0000-0000-0000-000000000000"]), links.nvml_facts(["GPU-0"])):
        assert got["available"] is False and got["why"].startswith("NVML unavailable: ")
    try:
        import pynvml  # noqa: F401
        assert "nvidia-ml-py is not installed" not in links.read_counters([])["why"]
    except ImportError:
        assert "nvidia-ml-py is not installed" in links.read_counters([])["why"]


def test_a_counter_rise_is_reported_against_the_pairs_of_its_gpu_and_kind():
    before = {"available": True, "why": None,
              "gpus": {0: {"nvlink_replay": 5, "pcie_replay": 0}, 1: {"nvlink_replay": 0}}}
    after = {"available": True, "why": None,
             "gpus": {0: {"nvlink_replay": 8, "pcie_replay": 2}, 1: {"nvlink_replay": 0}}}
    rises = links.counter_rises(before, after)
    assert rises == {0: {"nvlink_replay": 3, "pcie_replay": 2}}
    out = finish([pair("cuda:0", "cuda:1", 380.0), pair("cuda:1", "cuda:2", 380.0), pair("cpu", "cuda:0", 54.0),
                  pair("cpu", "cuda:1", 54.0)], machine(3, pcie={"gen": 5, "width": 16}), rises=rises)
    link = out[("cuda:0", "cuda:1")]
    assert link["link_errors"] == {"cuda:0 nvlink_replay": 3} and link["verdict"] == "ok"
    assert link["advice"] == advice.advice("nvlink", "link-errors")
    assert out[("cpu", "cuda:0")]["link_errors"] == {"cuda:0 pcie_replay": 2}
    assert out[("cuda:1", "cuda:2")]["link_errors"] == {} and out[("cpu", "cuda:1")]["advice"] == []
    status, detail = doctor._counters_check(before, after, rises)
    assert status == "FAIL" and detail == "rose during the probes: cuda:0 nvlink_replay +3, pcie_replay +2"
    assert doctor._counters_check(before, before, {}) == (
        "ok", "no rise on 2 GPUs (nvlink_replay, pcie_replay); not reported by any GPU here: nvlink_crc_flit, "
              "nvlink_crc_data, nvlink_recovery")
    pcie_only = {"available": True, "why": None, "gpus": {0: {"pcie_replay": 0}}}  # what 4 H200s reported (run S)
    assert doctor._counters_check(pcie_only, pcie_only, {})[1].endswith(
        "not reported by any GPU here: nvlink_crc_flit, nvlink_crc_data, nvlink_replay, nvlink_recovery")
    gone = {"available": False, "why": "NVML unavailable: x", "gpus": {}}
    assert doctor._counters_check(gone, gone, {}) == ("skip", "unavailable: NVML unavailable: x")


# ---- --repeat, --duration

def test_repeat_probes_every_pair_again_with_counts(capsys):
    code, doc = run_json(capsys, "--repeat", "3", "--large", "1M", "--no-cache")
    (p,) = doc["pairs"]
    assert code == 0 and doc["rounds"] == 3 and (p["runs"], p["counts"]) == (3, {"ok": 3})
    assert p["evidence"][0] == "3 runs: 3 ok"


def test_the_worst_run_decides_and_the_counts_show_how_often():
    ok = {"verdict": "ok", "evidence": ["exact"], "gbps": 10.0, "staged_gbps": None, "seconds": 1.0, "probes": []}
    bad = {**ok, "verdict": "corrupt", "evidence": ["ce 4093 B: corrupt"], "gbps": None, "probes": [{"path": "ce"}]}
    got = doctor._combine([ok, bad, {**ok, "gbps": 14.0}, ok])
    assert (got["verdict"], got["counts"], got["runs"], got["gbps"]) == ("corrupt", {"ok": 3, "corrupt": 1}, 4, 10.0)
    assert got["evidence"] == ["4 runs: 3 ok, 1 corrupt", "ce 4093 B: corrupt"] and got["probes"] == bad["probes"]


def test_a_hung_pair_is_not_probed_again(capsys, monkeypatch):
    monkeypatch.setenv(doctor.TEST_FAULT_ENV, "hang:cpu->cpu")
    code, doc = run_json(capsys, "--repeat", "3", "--timeout", "2", "--large", "1M", "--no-cache")
    (p,) = doc["pairs"]
    assert code == 1 and (p["verdict"], p["runs"], p["counts"]) == ("hung", 1, {"hung": 1}) and doc["rounds"] == 1
    assert p["advice"] == advice.advice("memory", "hung")


def test_duration_keeps_probing_rounds_until_it_has_passed(capsys):
    # The duration is set from one round measured here: on a loaded 2-core CI box one round took more than
    # the fixed 6 s this test used to ask for, and a single round was (rightly) all the doctor ran.
    code, one = run_json(capsys, "--large", "1M", "--no-cache")
    assert code == 0 and one["rounds"] == 1
    duration = round(2 * one["seconds"] + 2, 1)
    start = time.monotonic()
    code, doc = run_json(capsys, "--duration", str(duration), "--large", "1M", "--no-cache")
    assert code == 0 and time.monotonic() - start >= duration and doc["seconds"] >= duration
    assert doc["rounds"] >= 2 and doc["pairs"][0]["runs"] == doc["rounds"]


@pytest.mark.parametrize("option,value", [("--repeat", "0"), ("--repeat", "x"), ("--duration", "-1"),
                                          ("--duration", "nan")])
def test_bad_repeat_or_duration_is_refused(capsys, option, value):
    with pytest.raises(SystemExit) as e:
        run_doctor(capsys, option, value)
    assert e.value.code == 2 and option in capsys.readouterr().err


# ---- --env

UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}" for i in range(4)]


def cache_doc(bad=(), gpus=UUIDS):
    """A verdict cache of this machine's key with 4 GPUs: every pair ok but ``bad`` {(src, dst): verdict}."""
    names = ["cpu"] + list(gpus)
    pairs = [{"src": a, "dst": b, "verdict": dict(bad).get((a, b), "ok")} for a in names for b in names if a != b]
    return {"schema": "pyxfer.doctor.verdicts", "schema_version": 1, "key": {**cache_key(), "gpus": list(gpus)},
            "created": int(time.time()), "pairs": pairs}


def shell_env(text):
    """The variables ``text`` exports, as bash sees them after eval."""
    script = 'eval "$1"; for v in NCCL_P2P_DISABLE CUDA_VISIBLE_DEVICES PYXFER_HEALTH_FROM_DOCTOR ' \
             'PYXFER_DOCTOR_CACHE; do [ -n "${!v+x}" ] && echo "$v=${!v}"; done; true'
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_P2P_DISABLE", "CUDA_VISIBLE_DEVICES",
                                                            "PYXFER_HEALTH_FROM_DOCTOR", "PYXFER_DOCTOR_CACHE")}
    out = subprocess.run(["bash", "-c", script, "bash", text], capture_output=True, text=True, env=env, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_env_of_a_corrupt_gpu_pair_disables_p2p_and_offers_the_clean_subset():
    text, vetoed = exports.exports(cache_doc({(UUIDS[1], UUIDS[2]): "corrupt"}), "/c.json", "/c.json")
    assert vetoed == 1
    assert shell_env(text) == {"NCCL_P2P_DISABLE": "1", "PYXFER_HEALTH_FROM_DOCTOR": "1"}
    alt = next(ln for ln in text.splitlines() if "instead of NCCL_P2P_DISABLE" in ln)
    assert alt.endswith(f"export CUDA_VISIBLE_DEVICES={UUIDS[0]},{UUIDS[1]},{UUIDS[3]}")
    assert "--disable-custom-all-reduce" in text and f"{UUIDS[1]} -> {UUIDS[2]} corrupt" in text.splitlines()[0]


def test_env_leaves_out_a_gpu_whose_host_copies_are_vetoed_and_names_a_moved_cache():
    doc = cache_doc({("cpu", UUIDS[3]): "dropped", (UUIDS[0], UUIDS[1]): "hung", (UUIDS[2], UUIDS[3]): "corrupt"})
    text, vetoed = exports.exports(doc, "/elsewhere/v.json", "/home/u/.cache/pyxfer/doctor-verdicts.json")
    assert vetoed == 3
    assert shell_env(text) == {"CUDA_VISIBLE_DEVICES": ",".join(UUIDS[:3]), "NCCL_P2P_DISABLE": "1",
                               "PYXFER_HEALTH_FROM_DOCTOR": "1", "PYXFER_DOCTOR_CACHE": "/elsewhere/v.json"}
    assert f"{UUIDS[2]} <-> {UUIDS[3]}" not in text  # GPU 3 is out already: its peer veto needs nothing more


def test_env_vetoes_only_what_health_routes_around():
    assert exports.VETO == pyxfer.health.BAD_VERDICTS
    doc = cache_doc({(UUIDS[0], UUIDS[1]): "slow", (UUIDS[2], UUIDS[3]): "unsupported", ("cpu", UUIDS[0]): "error"})
    text, vetoed = exports.exports(doc, "/c.json", "/c.json")
    assert vetoed == 0 and shell_env(text) == {"PYXFER_HEALTH_FROM_DOCTOR": "1"}
    assert "nothing to keep off" in text


def test_env_largest_clean_set_is_exhaustive_up_to_16_gpus_and_greedy_beyond():
    ring = {frozenset((i, (i + 1) % 5)) for i in range(5)}  # a 5-cycle of bad pairs: at most 2 GPUs stay clean
    assert exports._largest_clean_set(list(range(5)), ring) == [0, 2]
    many = list(range(20))
    assert exports._largest_clean_set(many, {frozenset((3, 7))}) == [g for g in many if g != 3]


def test_doctor_env_reads_a_cache_of_this_machine(capsys, tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps(cache_doc({(UUIDS[0], UUIDS[2]): "corrupt"})))
    code, out = run_doctor(capsys, "--env", "--cache", str(path))
    assert code == 1 and out.startswith(f"# verdicts from the cache {path}")
    assert shell_env(out) == {"NCCL_P2P_DISABLE": "1", "PYXFER_HEALTH_FROM_DOCTOR": "1",
                              "PYXFER_DOCTOR_CACHE": str(path)}
    path.write_text(json.dumps(cache_doc()))
    code, out = run_doctor(capsys, "--env", "--cache", str(path))
    assert code == 0 and "nothing to keep off" in out and "NCCL_P2P_DISABLE" not in shell_env(out)


def test_doctor_env_probes_first_when_the_cache_is_of_another_machine(capsys, tmp_path):
    path = tmp_path / "v.json"
    stale = cache_doc({(UUIDS[0], UUIDS[2]): "corrupt"})
    stale["key"]["torch"] = "1.0"
    path.write_text(json.dumps(stale))
    code, out, err = run_doctor_err(capsys, "--env", "--cache", str(path), "--large", "1M")
    assert "made under another key (torch: cache '1.0'" in err and "0 of 1 pairs not ok" in err
    assert code == 0 and "1 pairs, 0 vetoed" in out and shell_env(out)["PYXFER_DOCTOR_CACHE"] == str(path)
    assert json.loads(path.read_text())["key"]["torch"] != "1.0"  # the fresh verdicts replaced it


def test_doctor_env_with_an_armed_fault_exports_its_verdicts_but_writes_no_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PYXFER_INJECT_FAULT", "bitflip,src=cpu,dst=cpu,times=1000")
    code, out = run_doctor(capsys, "--env", "--cache", str(tmp_path / "v.json"), "--large", "1M")
    assert code == 1 and "cpu -> cpu corrupt" in out and "host memory -> host memory failed" in out
    assert "no verdict cache was written" in out and shell_env(out) == {}
    assert not (tmp_path / "v.json").exists()


def test_env_and_json_together_are_refused(capsys):
    code, out, err = run_doctor_err(capsys, "--env", "--json")
    assert code == 2 and out == "" and "expected one of them" in err
