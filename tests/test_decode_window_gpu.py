"""Sliding window and softcap (issue 35) in decode against a KV cache, on the GPU: every sequence of
a batch against the float64 reference of its own keys (the cache's first cache_seqlens[b] rows,
then the new rows) with the window placed at that sequence's diagonal (FlashAttention's rule with
L = cache_seqlens[b] + seqlen_new), ``compare_with_reference``'s criterion; ragged lengths from 1
to the full capacity, paged caches with shuffled pages, the in-place append checked row by row
(also where the window does not see the new rows), GQA, seqlen_q 1 to 16, one and several splits
(empty ones included: a window's tiles are few), outputs poisoned with NaN, and a CUDA graph whose
replays follow cache_seqlens with a window.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_decode_window_gpu.py
"""

from __future__ import annotations

import pytest

import numbaflash
from numbaflash.tools.reference import compare_with_reference

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")
from tests.test_decode_gpu import DTYPES, check_sequences, expected_caches, host, problem  # noqa: E402

pytestmark = pytest.mark.gpu

# (window_size, causal): sizes 0, 1 and 127, asymmetric ones, one side unbounded, and causal
# masking with a window (its right side 0).
WINDOWS = [((0, 0), False), ((1, 1), False), ((127, 0), False), ((127, 3), False), ((3, 50), False),
           ((5, -1), False), ((-1, 2), False), ((0, -1), True), ((127, -1), True)]


def run_and_check(q, kc, vc, seqlens, new, table, before, causal, window_size=(-1, -1), softcap=0.0,
                  splits=0):
    """One call with a NaN-poisoned out (the caches first reset to ``before``), each sequence
    against float64, and the caches: the new rows appended, nothing else written."""
    kc.copy_(before[0])
    vc.copy_(before[1])
    out = torch.full_like(q, float("nan"))
    kwargs = {"block_table": table, "num_splits": splits, "return_lse": True, "out": out, "causal": causal,
              "window_size": window_size, "softcap": softcap}
    if new is not None:
        kwargs.update(k_new=new[0], v_new=new[1])
    result, lse = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    torch.cuda.synchronize()
    assert result is out
    check_sequences(q, out, lse, before, new, seqlens, table, f"splits {splits}, ", causal=causal,
                    window_size=window_size, softcap=softcap)
    expect_k, expect_v = expected_caches(before, new, seqlens, table)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v), "the cache holds other rows than expected"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("group", "seqlen_q"), [(1, 1), (8, 1), (4, 4), (2, 16)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_window_matches_reference(d, dtype, group, seqlen_q, paged):
    """Every window with and without appended rows, one, four and the automatic number of splits
    (the windows rotate over the split counts), ragged lengths 1 .. capacity."""
    batch, heads_kv, capacity = 4, 2, 700
    for seqlen_new in (0, 3):
        q, kc, vc, seqlens, new, table = problem(d + group + seqlen_q + seqlen_new, batch, seqlen_q,
                                                 heads_kv * group, heads_kv, d, capacity, seqlen_new,
                                                 DTYPES[dtype], paged)
        before = (kc.clone(), vc.clone())
        for i, (window, causal) in enumerate(WINDOWS):
            run_and_check(q, kc, vc, seqlens, new, table, before, causal, window, splits=(1, 4, 0)[i % 3])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_softcap_matches_reference_at_large_scores(d, dtype, causal, paged):
    """Softcap 30 and 50 on q and keys scaled by 30 (the cap bites: scaled scores far past it;
    in float16 the scale shrinks above head dim 128 as in the forward's test), alone and with a
    window, seqlen_q 1 and 4 with GQA, appended rows, one and three splits."""
    amplitude = 30.0 if dtype == "bfloat16" or d <= 128 else 30.0 * (128 / d) ** 0.5
    batch, heads_kv, capacity = 3, 2, 500
    for seqlen_q, group in ((1, 4), (4, 2)):
        q, kc, vc, seqlens, new, table = problem(d + seqlen_q, batch, seqlen_q, heads_kv * group, heads_kv, d,
                                                 capacity, 2, DTYPES[dtype], paged)
        q.mul_(amplitude)
        kc.mul_(amplitude)
        new[0].mul_(amplitude)
        before = (kc.clone(), vc.clone())
        for softcap, window, splits in [(30.0, (-1, -1), 1), (50.0, (-1, -1), 3), (30.0, (127, 0), 3),
                                        (50.0, (40, 5), 1)]:
            run_and_check(q, kc, vc, seqlens, new, table, before, causal, window, softcap, splits)


def test_window_wider_than_the_cache_equals_no_window():
    """A window that bounds no row runs the plain kernel: the same bits as no window."""
    q, kc, vc, seqlens, new, table = problem(5, 3, 2, 8, 2, 128, 300, 0, torch.float16, False)
    plain = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, causal=False)
    wide = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, causal=False, window_size=(400, 400))
    assert torch.equal(plain, wide)


@pytest.mark.parametrize("splits", [0, 4])
def test_graph_replays_follow_cache_seqlens_with_a_window(splits):
    """A 40-step decode loop captured once with a window of 24 keys: each replay appends one row
    and advances cache_seqlens on the device, so the window slides; the outputs equal eager calls
    bit for bit and the float64 reference, and the cache ends as the eager one."""
    batch, heads_kv, group, d, capacity = 2, 2, 4, 128, 256
    window = (24, 0)
    q, kc, vc, seqlens, new, _ = problem(7, batch, 1, heads_kv * group, heads_kv, d, capacity, 1,
                                         torch.float16, False)
    seqlens.copy_(torch.tensor([10, 90], dtype=torch.int32))
    kc_eager, vc_eager, lens_eager = kc.clone(), vc.clone(), seqlens.clone()
    out = torch.empty_like(q)
    kwargs = {"k_new": new[0], "v_new": new[1], "num_splits": splits, "window_size": window}
    numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, out=out, **kwargs)  # warm-up
    kc.copy_(kc_eager)
    vc.copy_(vc_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, out=out, **kwargs)
        seqlens.add_(1)
    for step in range(40):
        out.fill_(float("nan"))
        graph.replay()
        eager = numbaflash.flash_attention_with_kvcache(q, kc_eager, vc_eager, lens_eager, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"step {step}"
        if step % 13 == 0:
            for b in range(batch):
                n = int(lens_eager[b]) + 1
                _, problems = compare_with_reference(host(q[b:b + 1]), host(kc_eager[b:b + 1, :n]),
                                                     host(vc_eager[b:b + 1, :n]), host(out[b:b + 1]), None,
                                                     causal=True, window_size=window)
                assert not problems, f"step {step}, batch {b}: " + "; ".join(problems)
        lens_eager.add_(1)
    assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager) and int(seqlens[0]) == 50
