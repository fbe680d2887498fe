"""torch.ops.pyxfer.peer_exchange, `pyxfer doctor`'s concurrent probe of a GPU pair: the protocol of
pyxfer/peer_exchange.h run by two host threads on the CPU (the reference) and by one block on each of two GPUs,
checked against an independent Python model of its words: every round exact, the flags where the protocol
leaves them, a wrong word placed by round and index, a partner that never runs reported as timed out within the
wait limit, and every bad argument refused by name."""
import time

import pytest
import torch

import pyxfer  # noqa: F401  (registers torch.ops.pyxfer)

H = 16  # header words
MASK = (1 << 64) - 1


def word(seed, side, rnd, i):
    """exchange_word (pyxfer/peer_exchange.h): splitmix64, written again here from its definition."""
    z = (seed ^ (side << 62) ^ (rnd << 40) ^ i) & MASK
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def as_signed(u):
    return u - (1 << 64) if u >= 1 << 63 else u


def ends(device_a, device_b, n):
    """Two buffers prefilled with a sentinel (the op zeroes them first)."""
    return (torch.full((H + n,), -7, dtype=torch.int64, device=device_a),
            torch.full((H + n,), -7, dtype=torch.int64, device=device_b))


def pairs_of_devices():
    out = [("cpu", "cpu")]
    if torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1):
        out.append(("cuda:1", "cuda:0"))  # neither on the current device's first GPU order
    return out


def exchange(a, b, rounds, seed, timeout=10.0, corrupt=-1, stall=-1):
    return torch.ops.pyxfer.peer_exchange(a, b, rounds, seed, timeout, corrupt, stall).tolist()


def test_every_round_lands_exact_and_the_flags_end_where_the_protocol_leaves_them():
    for da, db in pairs_of_devices():
        n, rounds, seed = 4099, 6, 0x5EED_1234_ABCD
        a, b = ends(da, db, n)
        assert exchange(a, b, rounds, seed) == [[0, -1, -1, rounds, 0], [0, -1, -1, rounds, 0]]
        a, b = a.cpu(), b.cpu()
        for mine, side in ((a, 0), (b, 1)):
            assert mine[0].item() == rounds and mine[1].item() == rounds  # ready, ack: the partner's last round
            assert torch.equal(mine[2:H], torch.zeros(H - 2, dtype=torch.int64))
            partner = 1 - side
            want = torch.tensor([as_signed(word(seed, partner, rounds, i)) for i in range(n)], dtype=torch.int64)
            assert torch.equal(mine[H:], want), (da, db, side)  # the partner's words of the last round


def test_one_wrong_word_is_placed_by_round_and_index_in_its_direction():
    for da, db in pairs_of_devices():
        n = 1001
        a, b = ends(da, db, n)
        rows = exchange(a, b, 5, 99, corrupt=3)
        assert rows[1] == [1, 3, n // 2, 5, 0]  # b's side found side 0's wrong word
        assert rows[0] == [0, -1, -1, 5, 0]


def test_a_partner_that_never_runs_is_a_timeout_within_the_wait_limit():
    for da, db in pairs_of_devices():
        for stall in (0, 1):
            a, b = ends(da, db, 257)
            start = time.monotonic()
            rows = exchange(a, b, 4, 1, timeout=0.5, stall=stall)
            took = time.monotonic() - start
            waiting = 1 - stall
            assert rows[waiting] == [0, -1, -1, 0, 1] and rows[stall] == [0, -1, -1, 0, 0], (da, db, stall)
            assert 0.4 < took < 30, took  # it waited its limit, and did not hang


def test_words_are_the_reference_words():
    assert word(0, 0, 0, 0) == 0xE220A8397B1DCDAF  # splitmix64's first output for state 0
    assert len({word(7, s, r, i) for s in (0, 1) for r in (1, 2) for i in range(500)}) == 2000


@pytest.mark.parametrize("change,message", [
    (lambda a, b: (a.float(), b, {}), "a must be an int64 tensor"),
    (lambda a, b: (a, b[:H], {}), "b must be a 1-D contiguous tensor of more than 16 words"),
    (lambda a, b: (a, b[:-1], {}), "a and b must have the same length"),
    (lambda a, b: (a[::2], b, {}), "(non-contiguous)"),
    (lambda a, b: (a[:20], a[20:40], {}), "two separate buffers"),
    (lambda a, b: (a, b, {"rounds": 0}), "rounds must be in [1, 1000000]"),
    (lambda a, b: (a, b, {"timeout": 0.0}), "timeout_s must be in (0, 3600]"),
    (lambda a, b: (a, b, {"timeout": float("nan")}), "timeout_s must be in (0, 3600]"),
    (lambda a, b: (a, b, {"corrupt": 9}), "corrupt_round must be -1 (none) or a round in [1, rounds]"),
    (lambda a, b: (a, b, {"stall": 2}), "stall_side must be -1 (none), 0 or 1"),
])
def test_bad_arguments_are_refused_by_name(change, message):
    a, b = ends("cpu", "cpu", 40)
    a, b, kw = change(a, b)
    opts = {"rounds": 3, "timeout": 5.0, "corrupt": -1, "stall": -1, **kw}
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
        torch.ops.pyxfer.peer_exchange(a, b, opts["rounds"], 1, opts["timeout"], opts["corrupt"], opts["stall"])
    assert str(e.value).startswith("pyxfer.peer_exchange: ") and message in str(e.value), str(e.value)


@pytest.mark.gpu
def test_on_one_gpu_both_ends_are_refused():
    a, b = ends("cuda:0", "cuda:0", 40)
    with pytest.raises(ValueError, match="two different GPUs"):
        exchange(a, b, 1, 1)
    with pytest.raises(ValueError, match="both be CUDA tensors"):
        exchange(a, b.cpu(), 1, 1)


@pytest.mark.parametrize("hook,result", [("", "ok"), ("concurrent-corrupt:cpu->cpu", "corrupt"),
                                         ("concurrent-hang:cpu->cpu", "hung")])
def test_the_doctors_concurrent_probe_reads_the_rows(hook, result):
    """pyxfer doctor's use of the op (GPU pairs with peer access), run here on the CPU reference: its hooks
    reach the exchange, and a wrong word or a missing partner becomes the probe's result with its evidence."""
    from pyxfer.tools import doctor

    cpu = torch.device("cpu")
    probe = doctor._concurrent_probe(cpu, cpu, hook, 1234)
    n, rounds = doctor.EXCHANGE_WORDS, doctor.EXCHANGE_ROUNDS
    assert (probe["path"], probe["bytes"], probe["rounds"], probe["result"]) == ("concurrent", 8 * n * rounds,
                                                                                 rounds, result)
    if result == "corrupt":
        assert (probe["first_offset"], probe["wrong_bytes"]) == (8 * (n // 2), 8)
        assert probe["detail"] == f"1 wrong words cpu -> cpu, the first in round 3 at word {n // 2}"
    elif result == "hung":
        assert probe["detail"] == f"cpu waited more than {doctor.EXCHANGE_WAIT_S:g} s for cpu in round 1"
    else:
        assert set(probe) == {"path", "bytes", "rounds", "result"}
