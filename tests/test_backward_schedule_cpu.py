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


def order(key_blocks, pairs, tail_pairs):
    return [tuple(int(x) for x in key_block_of(c, key_blocks, pairs, tail_pairs))
            for c in range(key_blocks * pairs)]


@pytest.mark.parametrize("key_blocks", [1, 2, 7, 32])
@pytest.mark.parametrize("pairs", [1, 3, 10, 64])
@pytest.mark.parametrize("tail", [0, 1, 2, 5, 64])
def test_each_block_once_and_in_order_per_pair(key_blocks, pairs, tail):
    tail = min(tail, pairs)
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


# ------------------------------------------------------------------ the Hopper backward's walk

walk_start = blocks.walk_start.py_func
walk_next = blocks.walk_next.py_func


def walk(n_block, key_blocks, m_first, m_blocks, q_blocks, down, heads=2, rotate=True):
    """(head, block) of each step of one key block's walk over ``heads`` query heads."""
    start = walk_start(n_block, key_blocks, m_first, m_blocks, q_blocks, down, rotate)
    head, m, seen = 0, start, []
    for _ in range(heads * (m_blocks - m_first)):
        seen.append((head, m))
        head, m = walk_next(head, m, m_first, m_blocks, start, down)
    assert (head, m) == (heads, start)
    return seen


@pytest.mark.parametrize("down,rotate", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("m_first,m_blocks", [(0, 1), (0, 5), (3, 4), (2, 9), (7, 16)])
@pytest.mark.parametrize("n_block,key_blocks,q_blocks", [(0, 4, 16), (3, 4, 16), (5, 8, 4), (31, 32, 16)])
def test_walk_visits_each_block_of_each_head_once(down, rotate, m_first, m_blocks, n_block, key_blocks,
                                                   q_blocks):
    seen = walk(n_block, key_blocks, m_first, m_blocks, q_blocks, down, rotate=rotate)
    if not rotate:  # from the range's first block up (causal and window kernels)
        assert seen[0] == (0, m_first)
    assert sorted(seen) == [(h, m) for h in range(2) for m in range(m_first, m_blocks)]
    for h in range(2):  # each head's blocks in one run, in the walk's cyclic order
        ms = [m for g, m in seen if g == h]
        step = -1 if down else 1
        for a, b in zip(ms, ms[1:], strict=False):
            assert b == a + step or (b, a) in ((m_blocks - 1, m_first), (m_first, m_blocks - 1))


def test_down_is_the_deterministic_walk():
    assert walk(3, 8, 0, 6, 6, True, heads=1) == [(0, m) for m in range(5, -1, -1)]


@pytest.mark.parametrize("blocks_q,blocks_k", [(16, 16), (8, 8), (32, 16)])
def test_up_walks_start_apart(blocks_q, blocks_k):
    """Without masking and at least as many query blocks as key blocks, each key block starts on
    a block of its own; with causal masking (the range from the diagonal) each starts on its
    diagonal: so no two key blocks of a head first reach a query block at the same step."""
    starts = [walk_start(n, blocks_k, 0, blocks_q, blocks_q, False, True) for n in range(blocks_k)]
    assert len(set(starts)) == blocks_k
    ratio = blocks_q // blocks_k
    for rotate in (True, False):  # causal: the range from the diagonal, either way
        diagonal = [walk_start(n, blocks_k, n * ratio, blocks_q, blocks_q, False, rotate)
                    for n in range(blocks_k)]
        assert diagonal == [n * ratio for n in range(blocks_k)]
    for first_block in (lambda n: 0, lambda n: n * ratio):  # full, causal
        visits = {}  # query block -> the steps at which each key block reaches it
        for n in range(blocks_k):
            m_first = first_block(n)
            for step, (_, m) in enumerate(walk(n, blocks_k, m_first, blocks_q, blocks_q, False, heads=1,
                                               rotate=m_first == 0)):
                visits.setdefault(m, []).append(step)
        for m, steps in visits.items():
            assert len(steps) == len(set(steps)), (m, steps)
