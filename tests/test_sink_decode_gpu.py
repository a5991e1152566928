"""A learnable sink (issue 56) in decode against a KV cache, on the GPU: every sequence of a batch
against the float64 reference of its own keys with the sink (``compare_with_reference(...,
sink=)``), contiguous and paged caches, appended rows (the cache checked row by row), GQA,
seqlen_q 1 to 4, one, five and the automatic number of splits (the sink joins split 0's merge
only: the combine must not count it twice), a window and a softcap, outputs poisoned with NaN, and
rows that see no key (an empty cache, and causal rows before a short cache's diagonal): 0 and
LSE = the sink.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_sink_decode_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")
from tests.test_decode_gpu import DTYPES, check_sequences, expected_caches, problem  # noqa: E402

pytestmark = pytest.mark.gpu


def random_sink(seed: int, heads_q: int) -> np.ndarray:
    """float32 (heads_q,): random logits, head 0 dominant (+8), head 1 no sink (-inf)."""
    sink = (np.random.default_rng(seed).standard_normal(heads_q) * 2).astype(np.float32)
    sink[:2] = (8.0, -np.inf)[:heads_q]
    return sink


def run_and_check(q, kc, vc, seqlens, new, table, before, sink, causal=True, splits=0, **options):
    """One call with the sink and a NaN-poisoned out (the caches first reset to ``before``), each
    sequence against float64, and the caches: the new rows appended, nothing else written."""
    kc.copy_(before[0])
    vc.copy_(before[1])
    out = torch.full_like(q, float("nan"))
    kwargs = {"block_table": table, "num_splits": splits, "return_lse": True, "out": out, "causal": causal,
              "learnable_sink": torch.from_numpy(sink).cuda(), **options}
    if new is not None:
        kwargs.update(k_new=new[0], v_new=new[1])
    result, lse = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    torch.cuda.synchronize()
    assert result is out
    check_sequences(q, out, lse, before, new, seqlens, table, f"splits {splits}, ", causal=causal, sink=sink,
                    **options)
    expect_k, expect_v = expected_caches(before, new, seqlens, table)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v), "the cache holds other rows than expected"
    return out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("group", "seqlen_q"), [(1, 1), (8, 1), (4, 4)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_sink_matches_reference(d, dtype, group, seqlen_q, paged):
    batch, heads_kv, capacity = 4, 2, 700
    for seqlen_new in (0, 3):
        seed = d + group + seqlen_q + seqlen_new
        q, kc, vc, seqlens, new, table = problem(seed, batch, seqlen_q, heads_kv * group, heads_kv, d,
                                                 capacity, seqlen_new, DTYPES[dtype], paged)
        before = (kc.clone(), vc.clone())
        sink = random_sink(seed, heads_kv * group)
        for splits, causal in ((0, True), (1, False), (5, True)):
            run_and_check(q, kc, vc, seqlens, new, table, before, sink, causal, splits)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sink_with_window_and_softcap(dtype, splits):
    batch, heads_kv, group, capacity = 4, 2, 4, 700
    q, kc, vc, seqlens, new, table = problem(3, batch, 2, heads_kv * group, heads_kv, 128, capacity, 2,
                                             DTYPES[dtype], False)
    before = (kc.clone(), vc.clone())
    sink = random_sink(3, heads_kv * group)
    run_and_check(q, kc, vc, seqlens, new, table, before, sink, False, splits, window_size=(127, 0))
    run_and_check(q, kc, vc, seqlens, new, table, before, sink, True, splits, softcap=30.0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("splits", [1, 4])
def test_rows_that_see_no_key_give_zero_and_the_sink(dtype, splits):
    """Sequence 0 has an empty cache (every row sees no key); sequence 1 one cached row and four
    causal query rows, of which the first three see no key."""
    heads_kv, group, d = 2, 2, 128
    q, kc, vc, _, _, _ = problem(7, 2, 4, heads_kv * group, heads_kv, d, 300, 0, DTYPES[dtype], False)
    seqlens = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    before = (kc.clone(), vc.clone())
    sink = random_sink(7, heads_kv * group)
    out, lse = run_and_check(q, kc, vc, seqlens, None, None, before, sink, True, splits)
    empty = [(0, i) for i in range(4)] + [(1, i) for i in range(3)]
    for b, i in empty:
        assert (out[b, i].float() == 0).all(), (b, i)
        got = lse[b, :, i].cpu().numpy()
        finite = np.isfinite(sink)
        assert (np.isneginf(got) == ~finite).all() and np.abs(got[finite] - sink[finite]).max() < 1e-3, (b, i)
