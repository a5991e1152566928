"""Context parallelism's layouts and ring step planner (pure Python: no torch, no GPU; run in CI):
every layout holds each token once, and each step's kernel calls let through exactly the gathered
sequence's mask, checked cell by cell against a brute-force mask."""

from __future__ import annotations

import subprocess
import sys

import pytest

import numbaflash.distributed as nd
from numbaflash.distributed import layout as L


def test_layouts_and_planner_import_no_torch():
    code = ("import sys, numbaflash.distributed as nd, numbaflash.distributed.layout\n"
            "nd.positions('zigzag', 8, 2, 0)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


WINDOWS = [(-1, -1), (0, 0), (1, 0), (3, -1), (-1, 2), (2, 2), (5, 1), (0, -1), (7, 0)]


def test_layouts_cover_the_sequence_once():
    for layout in L.LAYOUTS:
        for world in (1, 2, 3, 4):
            seqlen = 3 * L.divisor(layout, world)
            held = sorted(p for r in range(world) for p in nd.positions(layout, seqlen, world, r))
            assert held == list(range(seqlen)), layout
            # every rank holds as many tokens
            assert len({len(nd.positions(layout, seqlen, world, r)) for r in range(world)}) == 1
    assert nd.positions("zigzag", 8, 2, 0) == [0, 1, 6, 7]
    assert nd.positions("stripe", 8, 2, 1) == [1, 3, 5, 7]
    assert nd.positions("contiguous", 8, 2, 1) == [4, 5, 6, 7]


def test_layout_errors():
    with pytest.raises(ValueError, match="layout must be one of"):
        L.segments("ring", 8, 2, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        L.segments("zigzag", 6, 2, 0)
    with pytest.raises(ValueError, match="rank must lie"):
        L.segments("contiguous", 8, 2, 2)


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_plan_covers_exactly_the_mask(layout):
    """Every ring step's calls, for every rank pair, mask and size: the cells they let through
    (FlashAttention's rule on their sliced shapes) are the gathered mask's, each once, and no call
    has a row that sees nothing."""
    checked = 0
    for world in (1, 2, 3, 4):
        d = L.divisor(layout, world)
        for seqlen in (d, 2 * d, 3 * d):
            for causal in (False, True):
                for window in WINDOWS + [(seqlen, 0)]:
                    for rank in range(world):
                        qs = L.segments(layout, seqlen, world, rank)
                        qpos = [p for s in qs for p in s.positions()]
                        for owner in range(world):
                            ks = L.segments(layout, seqlen, world, owner)
                            kpos = [p for s in ks for p in s.positions()]
                            calls = L.plan_step(qs, ks, causal, window)
                            want = {
                                (i, j)
                                for i, p in enumerate(qpos)
                                for j, t in enumerate(kpos)
                                if L.visible(p, t, causal, window)
                            }
                            got = []
                            for c in calls:
                                cells = L.call_mask(c, len(qpos), len(kpos))
                                assert {i for i, _ in cells} == set(range(c.q_lo, c.q_hi)), c
                                got.extend(cells)
                            assert len(got) == len(set(got)) and set(got) == want, (
                                world,
                                seqlen,
                                causal,
                                window,
                                rank,
                                owner,
                                calls,
                            )
                            checked += 1
    assert checked > 300


def test_zigzag_causal_steps_are_balanced_single_calls():
    """ring-flash-attention's zigzag schedule: the own block causal over all rows; an earlier
    rank's block: all queries against its first chunk; a later rank's: the second half of the
    queries against all its keys; one call each, the same work on every rank."""
    world, c = 4, 8
    seqlen = 2 * world * c
    for rank in range(world):
        qs = L.segments("zigzag", seqlen, world, rank)
        for owner in range(world):
            (call,) = L.plan_step(qs, L.segments("zigzag", seqlen, world, owner), True)
            if owner == rank:
                assert call == L.BlockCall(0, 2 * c, 0, 2 * c, True, (-1, -1))
            elif owner < rank:
                assert call == L.BlockCall(0, 2 * c, 0, c, False, (-1, -1))
            else:
                assert call == L.BlockCall(c, 2 * c, 0, 2 * c, False, (-1, -1))


