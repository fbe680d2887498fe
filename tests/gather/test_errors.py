"""pyxfer.gather.GatherVerificationError survives pickling and copying with its message and every
field (issue 39, item 13: its keyword-only fields made pickle fail, so a process-pool worker that
raised it gave the caller BrokenProcessPool)."""
import concurrent.futures
import copy
import multiprocessing
import os
import pickle

import pytest

from pyxfer.gather import GatherVerificationError

FIELDS = ("src_rank", "rank", "buffer", "num_bytes", "expected", "actual")


def _make(seed):
    """An error with fields that differ from one another (so a swap shows), hashes over 2**63."""
    g = int.from_bytes(seed, "little")
    fields = dict(src_rank=3 + g % 5, rank=g % 3, buffer="columnwise_scale_inv", num_bytes=2 ** 20 + 3 + g % 1000,
                  expected=2 ** 63 + g % 2 ** 62, actual=(g * 7919) % 2 ** 63 + 1)
    message = f"pyxfer.all_gather: the columnwise_scale_inv shard from rank {fields['src_rank']} arrived corrupted"
    return GatherVerificationError(message, **fields), message, fields


def _raise_in_worker(seed):  # runs in the pool's worker process
    raise _make(seed)[0]


def _check(got, message, fields, notes):
    assert type(got) is GatherVerificationError
    assert isinstance(got, RuntimeError)
    assert str(got) == message and got.args == (message,)
    assert {name: getattr(got, name) for name in FIELDS} == fields
    assert getattr(got, "__notes__", None) == notes


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_round_trip_keeps_message_fields_and_notes(how):
    err, message, fields = _make(os.urandom(8))
    err.add_note("a note added by the caller")
    err.extra = "an attribute set after construction"
    got = {"pickle": lambda e: pickle.loads(pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)),
           "copy": copy.copy, "deepcopy": copy.deepcopy}[how](err)
    assert got is not err
    _check(got, message, fields, ["a note added by the caller"])
    assert got.extra == "an attribute set after construction"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        _check(pickle.loads(pickle.dumps(err, protocol=protocol)), message, fields, ["a note added by the caller"])


def test_raised_in_a_process_pool_worker_reaches_the_caller():
    seed = os.urandom(8)
    _, message, fields = _make(seed)
    # spawn: a fresh interpreter, as on every platform's default start method
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        future = pool.submit(_raise_in_worker, seed)
        with pytest.raises(GatherVerificationError) as info:
            future.result(timeout=300)
        _check(info.value, message, fields, None)
        # the pool still works (a failed unpickling in the caller breaks it)
        assert pool.submit(abs, -5).result(timeout=300) == 5
