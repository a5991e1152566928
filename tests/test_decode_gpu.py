"""Decode against a KV cache on the GPU: every
sequence of a batch against the float64 reference of its own keys (the cache's first
cache_seqlens[b] rows, then the new rows), ragged lengths from 1 to the full capacity, paged
caches with shuffled pages, in-place append checked row by row (and nothing else written), GQA,
seqlen_q 1 to 16, forced split counts, and a CUDA graph whose replays follow cache_seqlens."""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash.tools.reference import compare_with_reference

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PAGE = 64


def host(x):
    """A torch tensor as a numpy array of its own 16-bit dtype (bfloat16 through ml_dtypes)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return x.cpu().numpy()


def problem(seed, batch, seqlen_q, heads_q, heads_kv, d, capacity, seqlen_new, dtype, paged):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(dtype)  # noqa: E731
    q = rand(batch, seqlen_q, heads_q, d)
    lengths = [1, capacity - seqlen_new, max(1, (capacity - seqlen_new) // 3)][:batch]
    lengths += [int(x) for x in torch.randint(1, capacity - seqlen_new + 1, (batch - len(lengths),))]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    new = (rand(batch, seqlen_new, heads_kv, d), rand(batch, seqlen_new, heads_kv, d)) if seqlen_new else None
    if not paged:
        return q, rand(batch, capacity, heads_kv, d), rand(batch, capacity, heads_kv, d), seqlens, new, None
    per_seq = -(-capacity // PAGE)
    num_pages = batch * per_seq + 5
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[:batch * per_seq]
    table = order.reshape(batch, per_seq).to(torch.int32).cuda()
    return (q, rand(num_pages, PAGE, heads_kv, d), rand(num_pages, PAGE, heads_kv, d), seqlens, new, table)


def sequence_rows(cache, table, b, n):
    """The first n key rows of sequence b of a cache (paged through ``table``)."""
    if table is None:
        return cache[b, :n]
    rows = torch.cat([cache[int(p)] for p in table[b]])
    return rows[:n]


def check_sequences(q, out, lse, before, new, seqlens, table, context="", **options):
    """Each sequence's rows of ``out`` (and the LSE) against float64 on its own keys: the cache's
    first cache_seqlens[b] rows (of ``before``), then the new rows (``options``: causal,
    window_size, softcap)."""
    for b in range(q.shape[0]):
        n_old = int(seqlens[b])
        keys = [sequence_rows(before[0], table, b, n_old)]
        values = [sequence_rows(before[1], table, b, n_old)]
        if new is not None:
            keys.append(new[0][b])
            values.append(new[1][b])
        k_b, v_b = torch.cat(keys)[None], torch.cat(values)[None]
        _, problems = compare_with_reference(host(q[b:b + 1]), host(k_b), host(v_b), host(out[b:b + 1]),
                                             lse[b:b + 1].cpu().numpy(), **options)
        assert not problems, f"batch {b} ({n_old} cached rows, {context}{options}): " + "; ".join(problems)


def expected_caches(before, new, seqlens, table):
    """The caches after appending ``new`` at each sequence's cache_seqlens[b]."""
    expect_k, expect_v = before[0].clone(), before[1].clone()
    if new is None:
        return expect_k, expect_v
    for b in range(seqlens.shape[0]):
        for i in range(new[0].shape[1]):
            j = int(seqlens[b]) + i
            if table is None:
                expect_k[b, j], expect_v[b, j] = new[0][b, i], new[1][b, i]
            else:
                page = int(table[b, j // PAGE])
                expect_k[page, j % PAGE], expect_v[page, j % PAGE] = new[0][b, i], new[1][b, i]
    return expect_k, expect_v


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("group", "seqlen_q"), [(1, 1), (4, 1), (8, 1), (4, 4), (1, 16), (8, 16)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_new", [0, 3])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_decode_matches_reference(d, dtype, group, seqlen_q, paged, seqlen_new, splits):
    batch, heads_kv, capacity = 4, 2, 700
    seed = d + group + seqlen_q
    q, kc, vc, seqlens, new, table = problem(seed, batch, seqlen_q, heads_kv * group, heads_kv, d, capacity,
                                             seqlen_new, DTYPES[dtype], paged)
    before = (kc.clone(), vc.clone())
    kwargs = {"block_table": table, "num_splits": splits, "return_lse": True}
    if new is not None:
        kwargs.update(k_new=new[0], v_new=new[1])
    for causal in (True, False):
        kc.copy_(before[0])
        vc.copy_(before[1])
        out, lse = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, causal=causal, **kwargs)
        torch.cuda.synchronize()
        check_sequences(q, out, lse, before, new, seqlens, table, causal=causal)
        if new is not None:  # the new rows are in the cache, and nothing else changed
            expect_k, expect_v = expected_caches(before, new, seqlens, table)
            assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
        else:
            assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 4])
def test_graph_replays_follow_cache_seqlens(splits):
    """A 32-step decode loop captured once: each replay appends one row and advances
    cache_seqlens on the device; the outputs equal eager calls bit for bit (with 4 splits every
    replay runs the combine kernel too)."""
    batch, heads_kv, group, d, capacity = 2, 2, 4, 128, 256
    q, kc, vc, seqlens, new, _ = problem(7, batch, 1, heads_kv * group, heads_kv, d, capacity, 1,
                                         torch.float16, False)
    seqlens.fill_(10)
    kc_eager, vc_eager, lens_eager = kc.clone(), vc.clone(), seqlens.clone()
    out = torch.empty_like(q)
    numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, k_new=new[0], v_new=new[1], out=out,
                                            num_splits=splits)  # warm-up
    kc.copy_(kc_eager)
    vc.copy_(vc_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, k_new=new[0], v_new=new[1], out=out,
                                                num_splits=splits)
        seqlens.add_(1)
    for _ in range(32):
        graph.replay()
        eager = numbaflash.flash_attention_with_kvcache(q, kc_eager, vc_eager, lens_eager, k_new=new[0],
                                                        v_new=new[1], num_splits=splits)
        lens_eager.add_(1)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert torch.equal(kc, kc_eager) and int(seqlens[0]) == 42


@pytest.mark.gpu
def test_numpy_reference_helper_is_the_dense_forward():
    """The reference path above agrees with the dense forward on a plain cache (a sanity check of
    the test itself): seqlen_q 1, full cache, no append."""
    q, kc, vc, _, _, _ = problem(3, 1, 1, 4, 2, 64, 128, 0, torch.float16, False)
    seqlens = torch.full((1,), 128, dtype=torch.int32, device="cuda")
    out = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, causal=False)
    dense = numbaflash.flash_attention(q, kc, vc, causal=False)
    np.testing.assert_allclose(out.float().cpu().numpy(), dense.float().cpu().numpy(), atol=2e-3, rtol=2e-3)


def spy_on_the_fast_path(monkeypatch) -> list:
    """What each later call's ``decode.run_torch`` returned (None: declined, the full path ran)."""
    from numbaflash.operations import decode as decode_op

    fast = []
    real = decode_op.run_torch
    monkeypatch.setattr(decode_op, "run_torch", lambda *args: fast.append(real(*args)) or fast[-1])
    return fast


def call_twice(monkeypatch, q, kc, vc, seqlens, **kwargs) -> tuple:
    """The call, then the caches put back and the same call again, spied on
    (``spy_on_the_fast_path``): (first result, second result, the spy's list, k_cache after the
    first call)."""
    before = (kc.clone(), vc.clone())
    first = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    k_after = kc.clone()
    kc.copy_(before[0])
    vc.copy_(before[1])
    fast = spy_on_the_fast_path(monkeypatch)
    second = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    torch.cuda.synchronize()
    return first, second, fast, k_after


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 3])
def test_known_layouts_take_the_fast_path_with_the_same_bits(monkeypatch, paged, splits):
    """A second call of a validated layout goes through ``decode.run_torch`` (bound launches, no
    operand descriptions) and returns the first call's bits; an out of a known layout that
    overlaps the cache is declined there and rejected by the full path."""
    q, kc, vc, seqlens, new, table = problem(11, 3, 2, 8, 2, 128, 300, 2, torch.float16, paged)
    kwargs = {"block_table": table, "num_splits": splits, "return_lse": True, "k_new": new[0],
              "v_new": new[1]}
    (out0, lse0), (out1, lse1), fast, _ = call_twice(monkeypatch, q, kc, vc, seqlens, **kwargs)
    assert fast and fast[0] is not None, "the second call did not take the fast path"
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    given = torch.empty_like(q)
    numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, out=given, **kwargs)  # this out's layout
    inside = kc.view(-1)[:q.numel()].view(q.shape)  # the same layout, in the cache's memory
    with pytest.raises(ValueError, match="shares memory"):
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, out=inside, **kwargs)
    assert fast[-1] is None  # declined by the fast path
