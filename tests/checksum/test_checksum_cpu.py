"""The multi-threaded CPU PXH64 against the independent numpy reference (tests/support/pxh64_reference.py).

csrc/cpu/checksum_cpu.cpp splits the full words of an input over min(torch.get_num_threads(),
words // 2**19) threads (kMinWordsPerThread: 4 MiB), each keyed from its own first word, and hashes a
partial tail word on the calling thread. Every size here sits on a side of that split (one word below
it, exactly on it, just past it) for 2, 3 and 4 threads, with a tail of 0-7 bytes, odd storage
offsets, word offsets and full 64-bit seeds; a wrong per-thread key or range changes the value even
where both ends of a verified copy would agree with each other.
"""
import pytest
import torch

import pyxfer
from pyxfer.checksums import as_uint64

from support.pxh64_reference import finalize, partial_np, pxh64_np
from support.tensors import logical_bytes, random_tensor

WORDS_PER_THREAD = 1 << 19  # kMinWordsPerThread in csrc/cpu/checksum_cpu.cpp


@pytest.fixture
def threads():
    """Set torch's intra-op thread count (what the CPU checksum splits over); restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _seed(gen):
    """A full 64-bit seed from the test's generator: the top bit is set half of the time (the op
    schema carries such a seed as a negative int64)."""
    hi, lo = torch.randint(0, 1 << 32, (2,), generator=gen).tolist()
    return hi << 32 | lo


# (threads asked for, full words, tail bytes): the thread count used is min(threads, words // 2**19)
SPLITS = [
    (2, 2 * WORDS_PER_THREAD - 1, 7),   # one word short of a split: one thread
    (2, 2 * WORDS_PER_THREAD, 0),       # exactly two ranges of 2**19 words
    (2, 2 * WORDS_PER_THREAD + 1, 3),   # two uneven ranges, a tail word after them
    (3, 3 * WORDS_PER_THREAD + 5, 1),   # three ranges of ceil(n / 3): the last one shorter
    (4, 3 * WORDS_PER_THREAD + 2, 5),   # four asked, three used
    (4, 4 * WORDS_PER_THREAD + 3, 6),   # four ranges
]


@pytest.mark.parametrize("num_threads,words,tail", SPLITS,
                         ids=[f"{t}threads-{w}words-tail{b}" for t, w, b in SPLITS])
def test_threaded_checksum_matches_reference(num_threads, words, tail, threads, gen):
    threads(num_threads)
    assert torch.get_num_threads() == num_threads
    n = 8 * words + tail
    base = random_tensor((n + 3,), torch.uint8, gen)
    seed = _seed(gen)
    for offset in (0, 3):  # offset 3: hashed from a misaligned view (the op hashes its logical bytes)
        t = base[offset:offset + n]
        data = logical_bytes(t)
        expected = pxh64_np(data, seed)
        assert pyxfer.checksum(t, seed) == expected, (offset, seed)
        # the threaded partial keyed from a large absolute word offset, then combined by the op
        word_offset = int(torch.randint(1, 1 << 40, (1,), generator=gen))
        partial = torch.ops.pyxfer.checksum_partial(t, word_offset, seed - (1 << 64) if seed >> 63 else seed)
        assert as_uint64(partial) == partial_np(data, seed, word_offset), (offset, word_offset)


def test_threaded_partials_compose_across_thread_ranges(threads, gen):
    """Partials cut inside and across the per-thread ranges (word offsets kept absolute) combine to
    the whole hash, both as the op computes them and as the reference sums them."""
    threads(3)
    words = 3 * WORDS_PER_THREAD + 11
    t = random_tensor((8 * words + 4,), torch.uint8, gen)
    seed = _seed(gen) >> 1  # an int64-representable seed for the raw op
    cuts = [0, 8 * (WORDS_PER_THREAD - 1), 8 * (2 * WORDS_PER_THREAD + 1), 8 * words, t.numel()]
    partials = [torch.ops.pyxfer.checksum_partial(t[a:b], a // 8, seed) for a, b in zip(cuts, cuts[1:])]
    data = logical_bytes(t)
    for (a, b), p in zip(zip(cuts, cuts[1:]), partials):
        assert as_uint64(p) == partial_np(data[a:b], seed, a // 8), (a, b)
    whole = torch.ops.pyxfer.checksum_combine(torch.stack(partials), t.numel(), seed)
    assert as_uint64(whole) == pxh64_np(data, seed) == pyxfer.checksum(t, seed)
    acc = sum(as_uint64(p) for p in partials) % (1 << 64)
    assert finalize(acc, t.numel(), seed) == pyxfer.checksum(t, seed)


def test_threaded_checksum_of_a_strided_float_view(threads, gen):
    """A non-contiguous float view large enough to split: the logical row-major bytes are hashed."""
    threads(2)
    x = random_tensor((2 * WORDS_PER_THREAD + 7, 3), torch.float32, gen)[:, 1:]  # 8 bytes a row, strided
    seed = _seed(gen)
    assert x.numel() * 4 > 8 * 2 * WORDS_PER_THREAD
    assert pyxfer.checksum(x, seed) == pxh64_np(logical_bytes(x), seed)


def test_thread_count_does_not_change_the_value(threads, gen):
    t = random_tensor((8 * 4 * WORDS_PER_THREAD + 5,), torch.uint8, gen)
    seed = _seed(gen)
    values = set()
    for n in (1, 2, 3, 4):
        threads(n)
        values.add(pyxfer.checksum(t, seed))
    assert values == {pxh64_np(logical_bytes(t), seed)}
