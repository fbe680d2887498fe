"""The pure parts of verified GPU copies (issue 34, device legs), on any machine: the copy-engine schedule
of a peer copy from the pair's rates (torch.ops.pyxfer.plan_peer_chunks), the checker that decides
whether the published words prove a copy (torch.ops.pyxfer.judge_verify_words: prefill, run token,
device canary), the protocol limits and knobs, and the "skip_kernel" fault's validation. Each is
checked against an independent reference written from the documented formulas
(csrc/include/pyxfer/peer_schedule.h, verify_words.h)."""
import math
import re

import pytest
import torch

import pyxfer
from pyxfer.testing import KERNEL_FAULT_KINDS, inject_fault

from support.processes import run_python
from support.pxh64_reference import M2, MASK, K, mix
from support.tensors import random_tensor

MIB = 1 << 20
PREFILL_SRC = 0x50524546494C4C53
PREFILL_DST = ~PREFILL_SRC & MASK


# ---- the schedule of the copy-engine pipeline ---------------------------------------------------

def ref_schedule(link, hash_, wave):
    """schedule_from_rates, from its comment: (shrink, min_chunk, hash_blocks, src_blocks)."""
    ratio = hash_ / link
    shrink = min(16, max(2, math.floor(0.5 * ratio / 1.25)))

    def blocks(fraction):
        return min(wave, max(1, math.ceil(wave * fraction)))
    return shrink, 4 * MIB, blocks(1.25 * shrink / ratio), blocks(2 * 1.25 / ratio)


def ref_ends(n, shrink, min_chunk):
    ends, begin = [], 0
    while begin < n:
        left = n - begin
        chunk = n - begin if shrink <= 1 else max(min_chunk, (left - left // shrink + 7) // 8 * 8)
        if left - chunk < min_chunk:
            chunk = left
        begin += chunk
        ends.append(begin)
    return ends


RATES = [(395.0, 3000.0, 528), (395.0, 4266.0, 528), (400.0, 800.0, 264), (100.0, 10000.0, 132),
         (50.0, 60.0, 1), (1e-3, 1e6, 4096)]
SIZES = [0, 1, 8, 4 * MIB - 1, 4 * MIB, 8 * MIB + 7, 64 * MIB + 3, 256 * MIB, (1 << 30) + 5, 3 << 30]


@pytest.mark.parametrize("link,hash_,wave", RATES)
def test_peer_schedule_follows_the_rates(link, hash_, wave):
    for n in SIZES:
        got = torch.ops.pyxfer.plan_peer_chunks(n, link, hash_, wave)
        shrink, min_chunk, hash_blocks, src_blocks = ref_schedule(link, hash_, wave)
        assert got[:4] == [shrink, min_chunk, hash_blocks, src_blocks], (n, link, hash_, wave)
        ends = got[4:]
        assert ends == ref_ends(n, shrink, min_chunk), n
        # chunks tile [0, n), start on 8-byte words (PXH64 partial sums compose there), none below the
        # minimum but a copy smaller than it, and each shrinks by the factor the hash rate can hide
        assert ends == sorted(set(ends)) and (not ends or ends[-1] == n) and (n > 0 or ends == [])
        sizes = [b - a for a, b in zip([0] + ends, ends)]
        assert all(e % 8 == 0 for e in ends[:-1])
        assert all(s >= min(min_chunk, n) for s in sizes)
        for bigger, smaller in zip(sizes[:-2], sizes[1:-1]):
            assert smaller == min_chunk or bigger >= smaller * (shrink - 1) - 8
        # the chunk hashes keep up with the copy: a throttled grid hashes >= shrink x the link rate
        # (where a full wave can), and never more than a wave
        assert 1 <= hash_blocks <= wave and 1 <= src_blocks <= wave
        assert hash_blocks == wave or hash_ * hash_blocks / wave >= 1.25 * shrink * link * (1 - 1e-9)


def test_peer_schedule_on_the_measured_chips():
    # issue 34's figures: PXH64 ~7.6x NVLink on H100, ~10.8x on H200, one wave of 4 x 132 blocks
    h100 = torch.ops.pyxfer.plan_peer_chunks(256 * MIB, 395.0, 7.6 * 395.0, 528)
    h200 = torch.ops.pyxfer.plan_peer_chunks(256 * MIB, 395.0, 10.8 * 395.0, 528)
    assert h100[:4] == [3, 4 * MIB, 261, 174] and h200[:4] == [4, 4 * MIB, 245, 123]
    assert h100[4:] == ref_ends(256 * MIB, 3, 4 * MIB) and len(h100[4:]) == 4
    assert h100[2] < 528 // 2 + 2 and h200[2] < 528 // 2  # the hashes leave about half the HBM to the copy


def test_plan_peer_chunks_rejects_bad_arguments():
    op = torch.ops.pyxfer.plan_peer_chunks
    for args, message in [((-1, 1.0, 1.0, 1), "num_bytes must be >= 0, got -1"),
                          ((8, 0.0, 1.0, 1), "link_gbps must be a positive rate, got 0"),
                          ((8, 1.0, float("nan"), 1), "hash_gbps must be a positive rate, got nan"),
                          ((8, 1.0, 1.0, 0), "wave_blocks must be >= 1, got 0")]:
        with pytest.raises(RuntimeError, match=re.escape("pyxfer.plan_peer_chunks: " + message)):
            op(*args)


def test_knobs_override_the_schedule_and_the_limits():
    code = """
import torch, pyxfer
op = torch.ops.pyxfer.plan_peer_chunks
print(op(100 << 20, 395.0, 3000.0, 528, True)[:4])
print(op(100 << 20, 395.0, 3000.0, 528)[:4])
print(torch.ops.pyxfer.verified_copy_limits())
"""
    r = run_python(code, env={"PYXFER_PEER_CHUNKS": "2,8", "PYXFER_PEER_HASH_GRID": "0.25",
                              "PYXFER_PEER_FUSED_MIB": "8"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str([2, 8 * MIB, 132, 132]),  # knobs=True: as the CUDA path applies them
                                     str(list(ref_schedule(395.0, 3000.0, 528))),  # knobs=False: the rates alone
                                     str([MIB, 8 * MIB, 64 * MIB])]
    for name, value, form in [("PYXFER_PEER_HASH_GRID", "1.5", "in (0, 1]"),
                              ("PYXFER_PEER_HASH_GRID", "half", "in (0, 1]"),
                              ("PYXFER_PEER_RATES", "395", "'<link GB/s>,<hash GB/s>'"),
                              ("PYXFER_PEER_RATES", "395,-1", "'<link GB/s>,<hash GB/s>'"),
                              ("PYXFER_PEER_CHUNKS", "fast", "'<shrink>,<min chunk MiB>'"),
                              ("PYXFER_PEER_FUSED_MIB", "-3", "a size in MiB")]:
        r = run_python("import torch, pyxfer; torch.ops.pyxfer.verified_copy_limits()", env={name: value})
        assert r.returncode != 0 and f"{name} must be" in r.stderr and form in r.stderr, (name, value, r.stderr)


def test_verified_copy_limits():
    assert torch.ops.pyxfer.verified_copy_limits() == [MIB, 64 * MIB, 64 * MIB]


# ---- the checker ---------------------------------------------------------------------------------

def canary(device):
    return mix(0x43414E4152593634 ^ ((device + 1) * K & MASK))


def token(seq, device):
    return mix(((seq * M2) & MASK) ^ canary(device)) | 1


def signed(v):
    return v - (1 << 64) if v >= 1 << 63 else v


def judge(words, seq, src, dst):
    ok, src_hash, dst_hash = torch.ops.pyxfer.judge_verify_words([signed(w) for w in words], seq, src, dst)
    return bool(ok), src_hash & MASK, dst_hash & MASK


def published(h_src, h_dst, seq, src, dst):
    """The words the source's and the destination's kernels of call `seq` publish on their own devices."""
    return [h_src ^ canary(src), h_dst ^ canary(dst), token(seq, src), token(seq, dst)]


PAIRS = [(0, 0), (0, 1), (1, 0), (3, 3), (2, 7)]


def test_canaries_are_distinct_and_never_zero():
    values = [canary(d) for d in range(1024)]
    assert len(set(values)) == 1024 and 0 not in values
    assert all(token(seq, d) & 1 for seq in (0, 1, 2**63) for d in range(8))  # never a consumed token (0)


@pytest.mark.parametrize("src,dst", PAIRS)
def test_judge_accepts_a_copy_proven_by_both_kernels(src, dst, gen):
    h = int(torch.randint(0, 2**62, (1,), generator=gen)) * 3 + 1
    seq = int(torch.randint(1, 2**62, (1,), generator=gen))
    assert judge(published(h, h, seq, src, dst), seq, src, dst) == (True, h, h)
    h2 = h ^ (1 << 17)  # a destination that differs: the hashes as published, canaries removed
    assert judge(published(h, h2, seq, src, dst), seq, src, dst) == (False, h, h2)


@pytest.mark.parametrize("src,dst", PAIRS)
def test_judge_rejects_a_kernel_that_did_not_run(src, dst, gen):
    seq = int(torch.randint(2, 2**62, (1,), generator=gen))
    h = int(torch.randint(0, 2**62, (1,), generator=gen))
    # prefilled words (a sync copy's, or a deferred copy's after the last check consumed them)
    ok, src_hash, dst_hash = judge([PREFILL_SRC, PREFILL_DST, 0, 0], seq, src, dst)
    assert not ok and (src != dst or src_hash != dst_hash)  # on one device the prefills never agree
    # the previous call's words, equal hashes of the same data: the token is of another call
    assert not judge(published(h, h, seq - 1, src, dst), seq, src, dst)[0]
    # one kernel ran, the other did not (its words still prefilled)
    words = published(h, h, seq, src, dst)
    assert not judge([words[0], PREFILL_DST, words[2], 0], seq, src, dst)[0]
    assert not judge([PREFILL_SRC, words[1], 0, words[3]], seq, src, dst)[0]
    # equal hashes but a token missing (only the token check stands between them and a match)
    assert not judge(words[:2] + [words[2], 0], seq, src, dst)[0]
    assert not judge(words[:2] + [0, words[3]], seq, src, dst)[0]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_judge_rejects_a_kernel_that_ran_on_another_device(src, dst, gen):
    seq = int(torch.randint(1, 2**62, (1,), generator=gen))
    h = int(torch.randint(0, 2**62, (1,), generator=gen))
    other = 5
    # the destination's kernel ran on cuda:5 (the legacy stream of the wrong current device)
    wrong = [h ^ canary(src), h ^ canary(other), token(seq, src), token(seq, other)]
    assert not judge(wrong, seq, src, dst)[0]
    # the canary in the hash alone (tokens as expected) is enough to reject it ...
    assert not judge([h ^ canary(src), h ^ canary(other), token(seq, src), token(seq, dst)], seq, src, dst)[0]
    # ... and so is the token alone (the hash as expected)
    assert not judge([h ^ canary(src), h ^ canary(dst), token(seq, src), token(seq, other)], seq, src, dst)[0]
    if src != dst:  # likewise for the source's kernel
        assert not judge([h ^ canary(other), h ^ canary(dst), token(seq, src), token(seq, dst)], seq, src, dst)[0]
        assert not judge([h ^ canary(src), h ^ canary(dst), token(seq, other), token(seq, dst)], seq, src, dst)[0]


def test_judge_words_argument_is_checked():
    with pytest.raises(RuntimeError, match=re.escape("pyxfer.judge_verify_words: words must be [src, dst, "
                                                     "src_token, dst_token], got 3 values")):
        torch.ops.pyxfer.judge_verify_words([1, 2, 3], 1, 0, 0)


# ---- the skip_kernel fault -------------------------------------------------------------------------

def test_skip_kernel_fault_is_for_direct_gpu_copies_only(gen):
    assert KERNEL_FAULT_KINDS == ("skip_kernel",)
    with pytest.raises(ValueError, match=r"inject_fault: kind 'skip_kernel' needs path='direct'"):
        with inject_fault("skip_kernel", path="staged"):
            pass
    with pytest.raises(ValueError, match=r"inject_fault: kind 'skip_kernel' needs path='direct'"):
        with inject_fault("skip_kernel", path="gather"):
            pass
    with pytest.raises(RuntimeError, match=r"kind 'skip_kernel' needs path='direct'"):
        torch.ops.pyxfer.fault_push("skip_kernel", -2, -2, "staged", 1, 0, False)
    with pytest.raises(ValueError, match=r"inject_fault: kind must be one of \(.*'shift', 'skip_kernel'\)"):
        with inject_fault("skip_kernels"):
            pass
    src = random_tensor((4099,), torch.uint8, gen)
    with inject_fault("skip_kernel") as fault:  # the host path has no hashing kernel: never hit
        for verify in ("sync", "deferred", "none"):
            out = pyxfer.verified_copy(src, "cpu", route="direct", verify=verify)
            assert torch.equal(out, src)
    assert fault.used == 0
    pyxfer.check_transfers()
    assert pyxfer.health.status("cpu", "cpu") == "healthy"
