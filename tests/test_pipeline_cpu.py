"""The numpy pipeline's plan, on CPU: chunks cover every (batch, kv head, query row) once, keep
GQA groups together, cut query rows at multiples of the kernel's block, give each row range the
keys it sees, respect the staging limit, and a small problem stays one chunk."""

from __future__ import annotations

import itertools
import math

import pytest

from numbaflash.runtime import pipeline as pl

SHAPES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (4, 4096, 4096, 16, 16, 128),  # the issue's shape
    (1, 8192, 8192, 32, 8, 128),  # one batch, GQA
    (64, 512, 512, 8, 1, 64),  # many batches, MQA
    (3, 1000, 333, 6, 3, 64),  # ragged
    (1, 1, 1, 1, 1, 64),  # tiny
    (2, 17, 40000, 4, 2, 128),  # seqlen_q far from seqlen_k
    (1, 32768, 32768, 8, 1, 128),  # one pair: cut into query-row ranges
    (2, 20000, 3000, 4, 2, 64),  # few pairs, seqlen_q > seqlen_k: causal leaves rows with no key
]


# Each shape under a tight and a loose staging limit, causal or not; the LSE and the block
# height (quantum) alternate between them, so that every shape meets each value of each.
PLANS = [(16, True, True, 128), (16, False, False, 192), (2048, True, False, 192), (2048, False, True, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("limit_mb", "causal", "with_lse", "quantum"), PLANS)
def test_chunks_cover_every_row_once(shape, with_lse, limit_mb, causal, quantum):
    p = pl.Problem(*shape, with_lse, causal, quantum)
    limit = limit_mb << 20
    chunks = pl.plan_chunks(p, limit=limit)
    cells = [(b, g, r) for c in chunks for b in range(c.b0, c.b1) for g in range(c.g0, c.g1)
             for r in (c.r0, c.r1)]
    starts = sorted((b, g, r) for (b, g, r) in cells[0::2])
    ends = sorted((b, g, r) for (b, g, r) in cells[1::2])
    pairs = sorted({(b, g) for b, g, _ in starts})
    assert pairs == list(itertools.product(range(p.batch), range(p.heads_kv)))
    for b, g in pairs:  # the row ranges of a pair tile 0 .. seqlen_q exactly
        r_starts = [r for bb, gg, r in starts if (bb, gg) == (b, g)]
        r_ends = [r for bb, gg, r in ends if (bb, gg) == (b, g)]
        assert r_starts[0] == 0 and r_ends[-1] == p.seqlen_q and r_starts[1:] == r_ends[:-1]
    diag = p.seqlen_k - p.seqlen_q
    for c in chunks:
        assert c.b1 > c.b0 and c.g1 > c.g0 and c.r1 > c.r0
        assert c.r0 % quantum == 0, "row ranges start on the kernel's block boundaries"
        assert (c.g0, c.g1) == (0, p.heads_kv) or c.b1 - c.b0 == 1  # whole batches, or one batch
        assert (c.r0, c.r1) == (0, p.seqlen_q) or (c.b1 - c.b0, c.g1 - c.g0) == (1, 1)
        assert c.k1 == (min(p.seqlen_k, c.r1 + diag) if causal else p.seqlen_k)
        size = pl.chunk_layout(p, c).nbytes
        one_pair = pl.chunk_layout(p, pl.Chunk.rows(p, 0, 1, 0, 1)).nbytes
        assert size * pl.LANES <= limit or (c.b1 - c.b0) * (c.g1 - c.g0) == 1 or size <= one_pair
    for_memory = math.ceil(p.bytes_per_pair() / (limit // pl.LANES))  # row ranges a pair needs to fit
    assert len(chunks) <= max(pl.TARGET_CHUNKS * 2, p.batch * p.heads_kv * for_memory)


def test_few_pairs_are_cut_into_row_ranges_for_every_lane():
    p = pl.Problem(1, 32768, 32768, 8, 1, 128, False)
    chunks = pl.plan_chunks(p)
    assert len(chunks) >= pl.LANES
    assert all(c.k1 == p.seqlen_k for c in chunks)
    causal = pl.plan_chunks(pl.Problem(1, 32768, 32768, 8, 1, 128, False, True))
    assert [c.k1 for c in causal] == [c.r1 for c in causal], "each range takes keys to its diagonal"


def test_causal_rows_before_the_first_diagonal_see_no_key():
    p = pl.Problem(2, 20000, 3000, 4, 2, 64, True, True)
    chunks = pl.plan_chunks(p)
    assert any(c.k1 <= 0 for c in chunks) and any(c.k1 > 0 for c in chunks)
    for c in chunks:  # k1 <= 0 exactly when the range's last row sees no key
        assert (c.k1 <= 0) == (c.r1 - 1 + 3000 - 20000 < 0)


def test_small_problem_is_one_chunk():
    p = pl.Problem(2, 256, 256, 4, 4, 64, True)
    assert pl.plan_chunks(p) == [pl.Chunk(0, 2, 0, 4, 0, 256, 256)]


def test_issue_shape_gives_about_target_chunks():
    p = pl.Problem(4, 4096, 4096, 16, 16, 128, False)
    chunks = pl.plan_chunks(p)
    assert pl.TARGET_CHUNKS // 2 <= len(chunks) <= 2 * pl.TARGET_CHUNKS


def test_layout_is_aligned_and_ordered():
    p = pl.Problem(3, 1000, 333, 6, 3, 64, True)
    lay = pl.chunk_layout(p, pl.Chunk.rows(p, 0, 1, 1, 3))
    offsets = [lay.q, lay.k, lay.v, lay.o, lay.lse]
    assert offsets == sorted(offsets) and all(o % 256 == 0 for o in offsets)
    assert lay.q_shape == (1, 1000, 4, 64) and lay.kv_shape == (1, 333, 2, 64)
    assert lay.lse_shape == (1, 4, 1000)
    assert lay.nbytes >= lay.lse + 4 * 4 * 1000


@pytest.mark.parametrize("value", ["x", "8"])
def test_staging_limit_is_checked(monkeypatch, value):
    monkeypatch.setenv("NUMBAFLASH_STAGING_LIMIT_MB", value)
    with pytest.raises(ValueError, match="NUMBAFLASH_STAGING_LIMIT_MB"):
        pl.staging_limit_bytes()


# seqlen_q, seqlen_k, window_size, causal: windows whose right side is bounded, unbounded or 0,
# with seqlen_q far from seqlen_k either way (the selftest's case 281 of seed 4063807155 first:
# 761 of 1104 rows see no key, and the window ends 38 keys past the diagonal).
WINDOWED = [
    (1104, 305, (546, 38), False),
    (1104, 305, (-1, 38), False),
    (1104, 305, (546, -1), False),
    (1104, 305, (100, 0), False),
    (900, 2000, (64, 200), False),
    (2000, 700, (0, 0), False),
    (1500, 1500, (-1, -1), True),
    (1500, 700, (-1, -1), False),
]


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "window_size", "causal"), WINDOWED)
@pytest.mark.parametrize("quantum", [64, 128])
def test_row_chunks_keep_every_rows_keys(seqlen_q, seqlen_k, window_size, causal, quantum):
    """A problem cut into row chunks (a tight staging limit): each chunk's kernel, given its rows,
    its keys 0 .. k1 - 1 and the window sides ``chunk_window_sides`` gives it, sees exactly the
    keys each of those rows sees in the whole problem (FlashAttention's rule, ``visible_keys``,
    applied to the chunk as the kernel applies it), and no row sees a key at or past k1."""
    from numbaflash.operations.forward import chunk_window_sides, keys_past_diagonal, variant_of
    from numbaflash.tools.reference import visible_keys

    var = variant_of(causal, window_size, 0.0, 0.125, seqlen_q, seqlen_k)
    p = pl.Problem(1, seqlen_q, seqlen_k, 8, 1, 256, False, keys_past_diagonal(var) == 0, quantum,
                   keys_past_diagonal(var))
    chunks = pl.plan_chunks(p, limit=16 << 20)
    assert len(chunks) > 1 and all(c.r1 - c.r0 < seqlen_q for c in chunks), "the rows are cut"
    whole = visible_keys(seqlen_q, seqlen_k, causal, window_size)
    for c in chunks:
        rows = whole[c.r0:c.r1]
        if c.k1 <= 0:  # the pipeline writes 0 and LSE -inf: right only if no row sees a key
            assert not rows.any()
            continue
        assert not rows[:, c.k1:].any(), "a key the chunk does not copy is seen"
        left, right = chunk_window_sides(var, pl.diagonal_shift(p, c))
        if var.window:
            assert left >= 0 and right >= 0, "the kernel takes sides >= 0"
            kernel = visible_keys(c.r1 - c.r0, c.k1, False, (left, right))
        else:
            assert pl.diagonal_shift(p, c) == 0 or not var.causal
            kernel = visible_keys(c.r1 - c.r0, c.k1, var.causal)
        assert (kernel == rows[:, :c.k1]).all(), f"chunk rows {c.r0}:{c.r1} keys 0:{c.k1}"
