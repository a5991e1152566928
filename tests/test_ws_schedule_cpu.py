"""The persistent Hopper kernel's work list (``kernels.blocks.work_units`` / ``unit_tile``), run
on CPU through the device functions' Python bodies: every query block of every (batch, head)
comes exactly once, units of one head are consecutive, and with causal masking every unit of a
square problem reads the same number of KV tiles (CTAs that take units in turn stay in step)."""

from __future__ import annotations

import collections

import pytest

from numbaflash.kernels import blocks

work_units = blocks.work_units.py_func
unit_tile = blocks.unit_tile.py_func
visible_kv_tiles = blocks.visible_kv_tiles.py_func


def walk(m_blocks, heads_q, group, batch, causal):
    """[(unit, tile)] in the order the units are numbered."""
    out = []
    for u in range(work_units(m_blocks, heads_q, batch, causal)):
        for h in range(2 if causal else 1):
            tile, present = unit_tile(u, h, m_blocks, heads_q, group, causal)
            if present:
                out.append((u, tuple(int(x) for x in tile)))
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("m_blocks", [1, 2, 3, 7, 8, 32])
@pytest.mark.parametrize(("heads_q", "group", "batch"), [(1, 1, 1), (4, 2, 3), (6, 6, 2)])
def test_every_query_block_exactly_once(causal, m_blocks, heads_q, group, batch):
    tiles = [t for _, t in walk(m_blocks, heads_q, group, batch, causal)]
    expected = {(mb, h, b, h // group)
                for mb in range(m_blocks) for h in range(heads_q) for b in range(batch)}
    assert len(tiles) == len(expected) and set(tiles) == expected


@pytest.mark.parametrize("causal", [False, True])
def test_units_of_a_head_are_consecutive(causal):
    heads = [(t[2], t[1]) for _, t in walk(8, 4, 1, 2, causal)]
    changes = sum(a != b for a, b in zip(heads, heads[1:], strict=False))
    assert changes == 4 * 2 - 1


@pytest.mark.parametrize(("seqlen", "block_m", "block_n"),
                         [(4096, 128, 128), (1024, 128, 192), (4000, 128, 128)])
def test_causal_units_cost_the_same(seqlen, block_m, block_n):
    m_blocks = -(-seqlen // block_m)
    cost = collections.Counter()
    for u, (mb, *_rest) in walk(m_blocks, 2, 1, 1, True):
        cost[u] += visible_kv_tiles(mb * block_m, block_m, block_n, seqlen, 0, True)
    middle = m_blocks // 2 if m_blocks % 2 else None  # the unit with one block
    full_units = [c for u, c in cost.items() if u % ((m_blocks + 1) // 2) != middle]
    assert max(full_units) - min(full_units) <= 1  # tile rounding only
    # Heaviest first: each unit starts with its longer query block.
    first = {}
    for u, (mb, *_rest) in walk(m_blocks, 2, 1, 1, True):
        first.setdefault(u, mb)
    assert all(mb >= (m_blocks - 1) / 2 for mb in first.values())
