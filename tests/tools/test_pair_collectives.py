"""The doctor's collective per GPU pair (pyxfer.tools.pair_collectives), run for real on gloo with CPU ranks:
every direction of every pair checked, a wrong byte caught and placed, a rank that hangs or dies reported
against the pairs it left without a result, and the result folded into a pair's verdict."""
import pytest

from pyxfer.tools import doctor
from pyxfer.tools.pair_collectives import BYTES, collectives_unavailable, run_pair_collectives

LABELS = ["r0", "r1", "r2"]  # three ranks: every rank is in two pairs and out of one
ALL = [(a, b) for a in range(3) for b in range(3) if a != b]


@pytest.fixture(autouse=True)
def no_fault(monkeypatch):
    monkeypatch.delenv(doctor.TEST_FAULT_ENV, raising=False)


def run(pairs=ALL, timeout=20.0):
    return run_pair_collectives(LABELS, pairs, backend="gloo", timeout=timeout, seed=11)


def test_every_direction_of_every_pair_is_exact():
    got = run()
    assert set(got) == {(LABELS[a], LABELS[b]) for a, b in ALL}
    assert all(p == {"path": "collective", "bytes": BYTES, "result": "ok"} for p in got.values())


def test_only_the_pairs_asked_for_are_reported():
    assert set(run([(2, 0)])) == {("r2", "r0")}


def test_a_wrong_byte_is_caught_in_its_direction_only(monkeypatch):
    monkeypatch.setenv(doctor.TEST_FAULT_ENV, "collective-corrupt:r2->r1")
    got = run()
    assert got[("r2", "r1")] == {"path": "collective", "bytes": BYTES, "result": "corrupt", "first_offset": 4097,
                                 "wrong_bytes": 1}
    assert all(p["result"] == "ok" for k, p in got.items() if k != ("r2", "r1"))


def test_a_rank_that_hangs_leaves_its_pair_hung_and_the_rest_reported(monkeypatch):
    monkeypatch.setenv(doctor.TEST_FAULT_ENV, "collective-hang:r1->r2")  # (1, 2) is the last pair in order
    got = run(timeout=5.0)
    assert got[("r1", "r2")] == {"path": "collective", "bytes": BYTES, "result": "hung",
                                 "detail": "no result within 5 s; killed: r1, r2"}
    assert got[("r0", "r1")]["result"] == got[("r1", "r0")]["result"] == "ok"
    assert got[("r0", "r2")]["result"] == got[("r2", "r0")]["result"] == "ok"


def test_a_rank_that_dies_is_an_error_with_its_message(monkeypatch):
    monkeypatch.setenv(doctor.TEST_FAULT_ENV, "collective-crash:r1->r2")
    got = run(timeout=10.0)
    for edge in (("r1", "r2"), ("r2", "r1")):  # r1, left waiting, is killed by the watchdog: r2 is the cause
        assert got[edge]["result"] == "error"
        assert got[edge]["detail"].startswith("the process of r2 ended without a result: ")
    assert got[("r0", "r2")]["result"] == "ok" and got[("r0", "r1")]["result"] == "ok"


def test_the_collective_result_joins_the_pairs_verdict():
    pair = {"verdict": "ok", "evidence": ["copies exact"], "probes": []}
    doctor._add_collective(pair, {"path": "collective", "bytes": BYTES, "result": "ok"})
    assert pair["verdict"] == "ok" and pair["probes"][-1]["result"] == "ok" and pair["evidence"] == ["copies exact"]
    doctor._add_collective(pair, {"path": "collective", "bytes": BYTES, "result": "corrupt", "first_offset": 9,
                                  "wrong_bytes": 2})
    assert pair["verdict"] == "corrupt"
    assert pair["evidence"][-1] == (f"NCCL all-gather of the pair, {BYTES} B each way: corrupt, first wrong byte at "
                                    "offset 9, 2 wrong")
    hung = {"verdict": "dropped", "evidence": ["x"], "probes": []}
    doctor._add_collective(hung, {"path": "collective", "bytes": BYTES, "result": "hung", "detail": "no result"})
    assert hung["verdict"] == "dropped" and hung["evidence"][-1].endswith("hung: no result")  # the worse stays


def test_no_gpu_pair_means_no_collective_and_no_nccl_says_why():
    assert doctor._collective_probes([], [("cpu", "cpu")], 5.0, {"cuda": False}) == (None, {})
    why = collectives_unavailable("nccl")
    assert why in ("fewer than 2 GPUs visible", "NCCL is not available in this torch build")
    status, detail = doctor._collective_probes([{"index": 0}, {"index": 1}], [("cuda:0", "cuda:1")], 5.0,
                                               {"cuda": True})[0]
    assert (status, detail) == ("skip", f"unavailable: {why}")
    assert collectives_unavailable("gloo") is None
