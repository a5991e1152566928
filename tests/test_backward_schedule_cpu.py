"""The backward main kernel's launch order (``kernels.blocks.key_block_of``,
``operations.launch_backward.backward_tail_pairs``), run on CPU through the device function's
Python body: every (key block, pair) comes exactly once, each pair's key blocks launch in
increasing order (deterministic mode's turns wait only on CTAs launched earlier), no tail is the
plain order, and with a tail the last CTAs launched are the shortest of a causal problem."""

from __future__ import annotations

import pytest

from numbaflash.kernels import blocks
from numbaflash.operations.launch_backward import backward_tail_pairs

key_block_of = blocks.key_block_of.py_func


def order(key_blocks, pairs, tail_pairs, of=key_block_of):
    return [tuple(int(x) for x in of(c, key_blocks, pairs, tail_pairs))
            for c in range(key_blocks * pairs)]


# Every distinct (pairs, tail pairs): none, one, some, all interleaved; the key-block counts
# (one, two, odd, many) taking them in turn.
ORDERS = [((1, 2, 7, 32)[i % 4], pairs, tail) for i, (pairs, tail) in enumerate(
    (p, t) for p in (1, 3, 10, 64) for t in sorted({min(t, p) for t in (0, 1, 2, 5, 64)}))]


@pytest.mark.parametrize(("key_blocks", "pairs", "tail"), ORDERS)
def test_each_block_once_and_in_order_per_pair(key_blocks, pairs, tail):
    seen = order(key_blocks, pairs, tail)
    assert sorted(seen) == [(n, p) for n in range(key_blocks) for p in range(pairs)]
    for p in range(pairs):
        blocks_of_p = [n for n, q in seen if q == p]
        assert blocks_of_p == list(range(key_blocks))


def test_no_tail_is_the_plain_order():
    assert order(4, 3, 0) == [(n, p) for p in range(3) for n in range(4)]


def test_the_tail_is_interleaved_longest_first():
    seen = order(4, 5, 2)
    assert seen[:12] == [(n, p) for p in range(3) for n in range(4)]
    assert seen[12:] == [(0, 3), (0, 4), (1, 3), (1, 4), (2, 3), (2, 4), (3, 3), (3, 4)]
    # causal: key block n walks fewer query blocks than n - 1, so the work of the last CTAs falls
    steps = [32 - n for n, _ in seen[12:]]
    assert steps == sorted(steps, reverse=True)


@pytest.mark.parametrize(("key_blocks", "pairs", "sms", "expected"),
                         [(32, 256, 132, 9), (8, 1024, 132, 33), (128, 64, 132, 3), (1, 1, 132, 1),
                          (32, 4, 132, 4), (1000, 8, 108, 1)])
def test_tail_pairs_cover_two_waves(key_blocks, pairs, sms, expected):
    tail = backward_tail_pairs(key_blocks, pairs, sms)
    assert tail == expected
    assert tail == pairs or tail * key_blocks >= 2 * sms


@pytest.mark.parametrize(("key_blocks", "pairs", "tail"), ORDERS)
def test_narrow_is_the_same_order(key_blocks, pairs, tail):
    narrow = blocks.key_block_of_narrow.py_func
    assert order(key_blocks, pairs, tail, narrow) == order(key_blocks, pairs, tail)
