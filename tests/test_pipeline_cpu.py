"""The numpy pipeline's plan, on CPU: chunks cover every (batch, kv head) pair once, keep GQA
groups together, respect the staging limit, and a small problem stays one chunk."""

from __future__ import annotations

import itertools

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
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("limit_mb", [16, 2048])
def test_chunks_cover_every_pair_once(shape, with_lse, limit_mb):
    p = pl.Problem(*shape, with_lse)
    limit = limit_mb << 20
    chunks = pl.plan_chunks(p, limit=limit)
    pairs = [(b, g) for c in chunks for b in range(c.b0, c.b1) for g in range(c.g0, c.g1)]
    assert sorted(pairs) == list(itertools.product(range(p.batch), range(p.heads_kv)))
    for c in chunks:
        assert c.b1 > c.b0 and c.g1 > c.g0
        assert (c.g0, c.g1) == (0, p.heads_kv) or c.b1 - c.b0 == 1  # whole batches, or one batch
        size = pl.chunk_layout(p, c).nbytes
        one_pair = pl.chunk_layout(p, pl.Chunk(0, 1, 0, 1)).nbytes
        assert size * pl.LANES <= limit or (c.b1 - c.b0) * (c.g1 - c.g0) == 1 or size <= one_pair
    assert len(chunks) <= max(pl.TARGET_CHUNKS * 2, p.batch * p.heads_kv)


def test_small_problem_is_one_chunk():
    p = pl.Problem(2, 256, 256, 4, 4, 64, True)
    assert pl.plan_chunks(p) == [pl.Chunk(0, 2, 0, 4)]


def test_issue_shape_gives_about_target_chunks():
    p = pl.Problem(4, 4096, 4096, 16, 16, 128, False)
    chunks = pl.plan_chunks(p)
    assert pl.TARGET_CHUNKS // 2 <= len(chunks) <= 2 * pl.TARGET_CHUNKS


def test_layout_is_aligned_and_ordered():
    p = pl.Problem(3, 1000, 333, 6, 3, 64, True)
    lay = pl.chunk_layout(p, pl.Chunk(0, 1, 1, 3))
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
