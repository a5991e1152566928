"""The persistent Hopper kernel's work list (``kernels.blocks.work_units`` / ``unit_tile``), run
on CPU through the device functions' Python bodies: every query block of every (batch, head)
comes exactly once, units of one head are consecutive, with causal masking every unit of a
square problem reads the same number of KV tiles (CTAs that take units in turn stay in step),
and every CTA takes every position of a head in turn."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from numbaflash.kernels import blocks

work_units = blocks.work_units.py_func
unit_tile = blocks.unit_tile.py_func
visible_kv_tiles = blocks.visible_kv_tiles.py_func


def walk(m_blocks, heads_q, group, batch, causal, grid=132):
    """[(unit, tile)] in the order the units are numbered (``grid`` CTAs)."""
    out = []
    for u in range(work_units(m_blocks, heads_q, batch, causal)):
        for h in range(2 if causal else 1):
            tile, present = unit_tile(u, h, m_blocks, heads_q, group, causal, grid)
            if present:
                out.append((u, tuple(int(x) for x in tile)))
    return out


# Every block count (one, a pair, odd and even, many) with and without causal pairing and each
# head layout; the persistent grid (one CTA, fewer CTAs than units, more) taking them in turn.
WALKS = [(causal, m_blocks, *heads, (1, 5, 12, 132)[i % 4]) for i, (causal, m_blocks, heads) in enumerate(
    itertools.product((False, True), (1, 2, 3, 7, 8, 32), ((1, 1, 1), (4, 2, 3), (6, 6, 2))))]


@pytest.mark.parametrize(("causal", "m_blocks", "heads_q", "group", "batch", "grid"), WALKS)
def test_every_query_block_exactly_once(causal, m_blocks, heads_q, group, batch, grid):
    tiles = [t for _, t in walk(m_blocks, heads_q, group, batch, causal, grid)]
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
    blocks_of = collections.Counter(u for u, _ in walk(m_blocks, 2, 1, 1, True))
    full_units = [c for u, c in cost.items() if blocks_of[u] == 2]  # not the one with one block
    assert max(full_units) - min(full_units) <= 1  # tile rounding only
    # Heaviest first: each unit starts with its longer query block.
    first = {}
    for u, (mb, *_rest) in walk(m_blocks, 2, 1, 1, True):
        first.setdefault(u, mb)
    assert all(mb >= (m_blocks - 1) / 2 for mb in first.values())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("m_blocks", "grid"), [(6, 132), (22, 132), (8, 64), (6, 12)])
def test_each_cta_takes_every_position_in_turn(causal, m_blocks, grid):
    """With a grid that is a multiple of the units per head (1024 rows in 192-row blocks on 132
    SMs: 6 blocks), CTA c does not always get the same block of a head: the cheaper ragged last
    block (warpgroups past seqlen_q pass over it) goes to every CTA in turn."""
    per_head = (m_blocks + 1) // 2 if causal else m_blocks
    heads = grid  # per_head rounds of every CTA
    positions = collections.defaultdict(collections.Counter)
    for u, (mb, *_rest) in walk(m_blocks, heads, 1, 1, causal, grid):
        positions[u % grid][min(mb, m_blocks - 1 - mb) if causal else mb] += 1
    for cta in range(grid):
        assert len(positions[cta]) == per_head, f"CTA {cta} gets only blocks {sorted(positions[cta])}"


@pytest.mark.parametrize("consumers", [2, 3])
def test_first_block_lead_ends_the_blocks_at_seqlen_q(consumers):
    """The causal 3-consumer kernels start the first query block up to 128 rows before row 0, in
    whole warpgroups, so that the blocks end with the warpgroup that holds the last row: a ragged
    block is then the first (the lightest), and the block count does not change."""
    from numbaflash.kernels.shapes import WsConfig

    config = WsConfig(head_dim=64, block_n=128, stages=2, consumers=consumers)
    block_m = config.block_m
    for seqlen in range(1, 3000):
        lead = config.first_block_lead(seqlen)
        m_blocks = -(-seqlen // block_m)
        if consumers == 2:
            assert lead == 0
            continue
        assert lead % 64 == 0 and 0 <= lead < block_m, (seqlen, lead)
        assert -(-(seqlen + lead) // block_m) == m_blocks, (seqlen, lead)
        # the last warpgroup holds the last row
        assert 0 <= m_blocks * block_m - lead - seqlen < 64, (seqlen, lead)


def walk_turns(monkeypatch, problem, block_m, block_n, causal, grid, window=False, seqs=None):
    """Every CTA's (TileTurn, kv count returned) list, from ``blocks.make_tile_walk`` run on CPU:
    its device callees are swapped for their Python bodies, ``cuda`` for the CTA's indices."""
    import types

    for name in ("work_units", "unit_tile", "visible_kv_tiles", "block_kv_tiles", "block_first_row",
                 "block_visible_tiles", "block_band_tiles", "band_kv_tiles", "sequence_place", "call_place"):
        monkeypatch.setattr(blocks, name, getattr(blocks, name).py_func)
    turns = {}

    def on_tile(cta, turn):
        turns[cta].append(turn)
        return int(turn.kv0) + int(turn.n_tiles)  # as both roles do

    walk = blocks.make_tile_walk(on_tile, block_m, block_n, causal, window, seqs is not None).py_func
    for cta in range(grid):
        turns[cta] = []
        monkeypatch.setattr(blocks, "cuda", types.SimpleNamespace(blockIdx=types.SimpleNamespace(x=cta),
                                                                  gridDim=types.SimpleNamespace(x=grid)))
        walk(cta, problem, seqs)
    return turns


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "lead", "grid"),
                         [(1000, 1000, 0, 3), (1024, 1024, 128, 5), (300, 900, 0, 7), (900, 300, 64, 2)])
def test_tile_walk_counts_the_rings_alike(monkeypatch, causal, seqlen_q, seqlen_k, lead, grid):
    """The walk the producer and the consumers share: each CTA's blocks in order, with the Q ring
    count (blocks before) and the KV ring count (their KV tiles) that both roles derive their
    stages and parities from; every query block of the problem comes once over the grid, with
    the KV tiles it can see."""
    block_m, block_n, heads_q, group, batch = 192, 128, 4, 2, 2
    m_blocks = -(-seqlen_q // block_m)
    problem = blocks.Problem(seqlen_q, seqlen_k, heads_q, group, batch, m_blocks, lead, 0, 0)
    turns = walk_turns(monkeypatch, problem, block_m, block_n, causal, grid)
    seen = []
    for cta_turns in turns.values():
        kv = 0
        for q_count, turn in enumerate(cta_turns):
            assert int(turn.round_q) == q_count and int(turn.kv0) == kv
            row0 = int(turn.tile.m_block) * block_m - lead
            last_key = seqlen_k if not causal else min(seqlen_k, row0 + block_m + seqlen_k - seqlen_q)
            assert int(turn.n_tiles) == max(-(-last_key // block_n), 0) and int(turn.kv_first) == 0
            kv += int(turn.n_tiles)
            seen.append(tuple(int(x) for x in turn.tile))
    expected = {(mb, h, b, h // group)
                for mb in range(m_blocks) for h in range(heads_q) for b in range(batch)}
    assert len(seen) == len(expected) and set(seen) == expected


def check_band_tiles(turn, block_n, rows, seqlen_q, seqlen_k, left, right):
    """``turn`` reads the KV tiles from the first to the last holding a key that one of ``rows``
    sees under the window (left, right) at the diagonal seqlen_k - seqlen_q; none if none does."""
    diag = seqlen_k - seqlen_q
    keys = [j for i in rows for j in range(max(0, i + diag - left), min(seqlen_k, i + diag + right + 1))]
    if keys:
        assert int(turn.kv_first) == min(keys) // block_n
        assert int(turn.kv_first) + int(turn.n_tiles) == max(keys) // block_n + 1
    else:
        assert int(turn.n_tiles) == 0


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "left", "right", "grid"),
                         [(1000, 1000, 300, 0, 3), (300, 2000, 0, 0, 5), (2000, 300, 64, 7, 4),
                          (777, 1500, 1 << 40, 0, 2), (1000, 1000, 5, 1 << 40, 6)])
def test_tile_walk_of_a_window_reads_the_band(monkeypatch, seqlen_q, seqlen_k, left, right, grid):
    """A sliding-window kernel's walk: one block a unit (non-causal order), each block reading the
    KV tiles from the first to the last that one of its rows (those below seqlen_q) sees, counted
    alike in the rings; blocks no row of which sees a key read none."""
    block_m, block_n, heads_q, group, batch = 128, 128, 2, 2, 2
    m_blocks = -(-seqlen_q // block_m)
    diag = seqlen_k - seqlen_q
    # (the edges are int64 in the kernel, as here; the first row an int32)
    problem = blocks.Problem(seqlen_q, seqlen_k, heads_q, group, batch, m_blocks, 0, np.int64(diag - left),
                             np.int64(diag + right))
    turns = walk_turns(monkeypatch, problem, block_m, block_n, False, grid, window=True)
    seen = []
    for cta_turns in turns.values():
        kv = 0
        for q_count, turn in enumerate(cta_turns):
            assert int(turn.round_q) == q_count and int(turn.kv0) == kv
            m0 = int(turn.tile.m_block) * block_m
            check_band_tiles(turn, block_n, range(m0, min(seqlen_q, m0 + block_m)), seqlen_q, seqlen_k, left,
                             right)
            kv += int(turn.n_tiles)
            seen.append(tuple(int(x) for x in turn.tile))
    expected = {(mb, h, b, h // group)
                for mb in range(m_blocks) for h in range(heads_q) for b in range(batch)}
    assert len(seen) == len(expected) and set(seen) == expected


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("grid", [1, 4, 7])
def test_tile_walk_of_packed_sequences_visits_only_their_blocks(monkeypatch, causal, window, grid):
    """Packed sequences (the varlen kernels): over ceil(max_seqlen_q / block_m) blocks of every
    (sequence, head), the walk hands the roles exactly the blocks that start below their own
    sequence's length (none of an empty one), each with its sequence's offsets, lengths, diagonal
    and window edges, and the KV tiles of its own keys; the ring counts stay as in a dense walk."""
    block_m, block_n, heads_q, group = 128, 128, 2, 2
    lengths_q, lengths_k = [0, 1, 300, 129, 128, 5], [7, 0, 200, 400, 128, 1]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    left, right = (np.int64(37), np.int64(0)) if window else (np.int64(0), np.int64(0))
    max_q = max(lengths_q)
    m_blocks = -(-max_q // block_m)
    problem = blocks.Problem(np.int32(max_q), np.int32(max(lengths_k)), heads_q, group, len(lengths_q),
                             m_blocks, np.int32(0), np.int64(0), np.int64(0))
    seqs = blocks.PackedSequences(cu_q, cu_k, left, right)
    turns = walk_turns(monkeypatch, problem, block_m, block_n, causal and not window, grid, window, seqs)
    seen = []
    for cta_turns in turns.values():
        kv = 0
        for q_count, turn in enumerate(cta_turns):
            assert int(turn.round_q) == q_count and int(turn.kv0) == kv
            b, place = int(turn.tile.batch), turn.place
            sq, sk = lengths_q[b], lengths_k[b]
            assert (int(place.start_q), int(place.start_k), int(place.batch)) == (cu_q[b], cu_k[b], 0)
            assert (int(place.problem.seqlen_q), int(place.problem.seqlen_k)) == (sq, sk)
            assert int(place.problem.first) == sk - sq - left and int(place.problem.last) == sk - sq + right
            m0 = int(turn.tile.m_block) * block_m
            assert m0 < sq
            rows = range(m0, min(sq, m0 + block_m))
            if window:
                check_band_tiles(turn, block_n, rows, sq, sk, left, right)
            else:  # causal: right 0, left unbounded; else both unbounded
                check_band_tiles(turn, block_n, rows, sq, sk, sk, 0 if causal else sk)
            kv += int(turn.n_tiles)
            seen.append((int(turn.tile.m_block), int(turn.tile.head), b))
    expected = {(m, h, b)
                for b, n in enumerate(lengths_q) for m in range(-(-n // block_m)) for h in range(heads_q)}
    assert len(seen) == len(expected) and set(seen) == expected
