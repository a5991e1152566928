"""MLA decode (``flash_mla_with_kvcache``, issue 58) on the GPU: every sequence of a batch against
the float64 reference of its own latent rows (keys all 576 values, values the first 512), ragged
lengths from 0 to the full cache, contiguous and paged caches (pages of 1, 16, 64 and 256,
shuffled), every row past a sequence's length and every unused page NaN, 16 to 128 query heads
(each MLA config: 16, 32 and 64 packed rows, two row blocks), seqlen_q 1 to 3 with causal masking,
forced and automatic split counts, a given ``out``, and a CUDA graph whose replays follow
cache_seqlens. On Hopper the wgmma kernel (above 16 rows) is also forced on every case."""

from __future__ import annotations

import pytest

import numbaflash
from numbaflash.tools.reference import compare_mla_with_reference

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
D, DV = 576, 512


def host(x):
    """A torch tensor as a numpy array of its own 16-bit dtype (bfloat16 through ml_dtypes)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return x.cpu().numpy()


def mla_problem(seed, batch, seqlen_q, heads, lengths, page, dtype):
    """q, the cache (NaN past each sequence's length and in every unused page), the lengths and
    the block table (None for a contiguous cache)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, D, generator=g, device="cuda").to(dtype)
    capacity = max(max(lengths), 1)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page is None:
        cache = torch.randn(batch, capacity, 1, D, generator=g, device="cuda").to(dtype)
        for b, n in enumerate(lengths):
            cache[b, n:] = float("nan")
        return q, cache, seqlens, None
    per_seq = -(-capacity // page)
    num_pages = batch * per_seq + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = order[:batch * per_seq].reshape(batch, per_seq).to(torch.int32).cuda()
    cache = torch.full((num_pages, page, 1, D), float("nan"), device="cuda", dtype=dtype)
    for b, n in enumerate(lengths):
        for j in range(-(-n // page)):
            rows = min(page, n - j * page)
            cache[int(table[b, j]), :rows] = torch.randn(rows, 1, D, generator=g, device="cuda").to(dtype)
    return q, cache, seqlens, table


def check(q, cache, seqlens, table, out, lse, causal, context):
    problems = compare_mla_with_reference(host(q), host(cache), seqlens.cpu().numpy(), host(out),
                                          lse.cpu().numpy(), block_table=None if table is None
                                          else table.cpu().numpy(), causal=causal)
    assert not problems, f"{context}: " + "; ".join(problems)


def case_problem(heads, seqlen_q, page, dtype):
    """A CASES row's problem (ragged lengths with an empty sequence; shorter ones at page size 1) and a
    NaN-filled ``out``."""
    lengths = [1, 300, 0, 77, 513] if page != 1 else [1, 130, 0, 57]
    dt = getattr(torch, dtype)
    q, cache, seqlens, table = mla_problem(heads + seqlen_q, len(lengths), seqlen_q, heads, lengths, page, dt)
    return q, cache, seqlens, table, torch.full((*q.shape[:3], DV), float("nan"), device="cuda", dtype=dt)


# (heads, seqlen_q, page, dtype, causal, splits): each MLA config (16, 32, 64 rows; two row blocks
# at 128), contiguous and paged at pages of 1, 16, 64 and 256, one fp16 case.
CASES = [
    (16, 1, 64, "bfloat16", False, 0),
    (16, 1, None, "float16", False, 3),
    (32, 1, 16, "bfloat16", False, 0),
    (16, 2, None, "bfloat16", True, 1),
    (64, 2, 64, "bfloat16", True, 0),
    (128, 1, 1, "bfloat16", False, 0),
    (40, 3, 256, "bfloat16", True, 5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads, seqlen_q, page, dtype, causal, splits", CASES)
def test_mla_matches_reference(heads, seqlen_q, page, dtype, causal, splits):
    q, cache, seqlens, table, out = case_problem(heads, seqlen_q, page, dtype)
    got, lse = numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, causal=causal, num_splits=splits,
                                                 return_lse=True, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (*q.shape[:3], DV)
    assert lse.shape == (q.shape[0], heads, seqlen_q) and lse.dtype == torch.float32
    check(q, cache, seqlens, table, out, lse, causal, f"heads {heads} sq {seqlen_q} page {page} {dtype}")
    plain = numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, causal=causal, num_splits=splits)
    assert torch.equal(plain, out), "the call without out or LSE gives other bits"


# The Hopper kernel forced (``kernels.mla_ws``: it takes more than 16 rows on its own; forced, the
# 16-row calls too), on CASES and two more: fp16 causal with splits, 128 heads x 2 causal contiguous.
HOPPER_CASES = [*CASES, (64, 1, 64, "float16", True, 2), (128, 2, None, "bfloat16", True, 0)]


@pytest.mark.hopper
@pytest.mark.parametrize("heads, seqlen_q, page, dtype, causal, splits", HOPPER_CASES)
def test_hopper_kernel_matches_reference(heads, seqlen_q, page, dtype, causal, splits):
    from numbaflash import configs
    from numbaflash.kernels.shapes import WsMlaConfig

    q, cache, seqlens, table, out = case_problem(heads, seqlen_q, page, dtype)
    with configs.force_decode_config(WsMlaConfig(paged=page is not None)):
        _, lse = numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, causal=causal, num_splits=splits,
                                                   return_lse=True, out=out)
    check(q, cache, seqlens, table, out, lse, causal, f"wgmma: heads {heads} sq {seqlen_q} page {page}")


@pytest.mark.gpu
def test_graph_replays_follow_cache_seqlens():
    """One capture, replayed as the lengths advance on the device (a decode loop)."""
    q, cache, seqlens, table = mla_problem(7, 4, 1, 16, [5, 64, 200, 1], 64, torch.bfloat16)
    lens = seqlens.clone()
    numbaflash.flash_mla_with_kvcache(q, cache, lens, table)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = numbaflash.flash_mla_with_kvcache(q, cache, lens, table, return_lse=True)
    for step in range(3):
        grown = seqlens + step
        cache_rows = cache.clone()
        for b in range(4):  # fill the rows the step exposes (they are NaN)
            for j in range(int(seqlens[b]), int(grown[b])):
                cache_rows[int(table[b, j // 64]), j % 64] = torch.randn(1, D, device="cuda").to(cache.dtype)
        cache.copy_(cache_rows)
        lens.copy_(grown)
        graph.replay()
        torch.cuda.synchronize()
        check(q, cache, lens, table, out, lse, False, f"replay {step}")


@pytest.mark.gpu
def test_bad_input_is_refused_before_launch():
    q = torch.randn(2, 1, 16, D, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 64, 1, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([3, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        numbaflash.flash_mla_with_kvcache(q, cache, lens, head_dim_v=576)
    with pytest.raises(ValueError, match="kv_cache must be"):
        numbaflash.flash_mla_with_kvcache(q, cache.expand(2, 64, 2, D), lens)
    with pytest.raises(ValueError, match="q's head_dim must be 576"):
        numbaflash.flash_mla_with_kvcache(q[..., :512], cache, lens)
    with pytest.raises(ValueError, match="block_table must have shape"):
        numbaflash.flash_mla_with_kvcache(q, cache, lens, torch.zeros(3, 1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="cache_seqlens"):
        numbaflash.flash_mla_with_kvcache(q, cache, lens[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 64])
def test_known_layouts_take_the_fast_path_with_the_same_bits(monkeypatch, page):
    """A second call of a validated layout skips the checks (``decode.run_torch(.., latent=True)``)
    and gives the same bits; a call the fast path cannot vouch for (a head_dim_v of another type)
    falls back to the full checks."""
    from numbaflash.operations import decode as decode_op

    q, cache, seqlens, table = mla_problem(3, 3, 1, 32, [9, 300, 64], page, torch.bfloat16)
    first, lse = numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, return_lse=True, num_splits=2)
    fast = []
    real = decode_op.run_torch
    monkeypatch.setattr(decode_op, "run_torch", lambda *a, **k: fast.append(real(*a, **k)) or fast[-1])
    second, lse2 = numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, return_lse=True, num_splits=2)
    assert fast and fast[0] is not None, "the second call did not take the fast path"
    assert torch.equal(first, second) and torch.equal(lse, lse2)
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, head_dim_v=512.5)
    check(q, cache, seqlens, table, second, lse2, False, "fast path")


@pytest.mark.gpu
def test_compiled_decode_step_runs_the_custom_op_with_the_same_bits():
    """A decode step under torch.compile (fullgraph) runs ``numbaflash::flash_mla_with_kvcache``:
    the same output and LSE as the eager call."""
    q, cache, seqlens, table = mla_problem(11, 2, 2, 16, [100, 700], 64, torch.bfloat16)
    eager, eager_lse = numbaflash.flash_mla_with_kvcache(q, cache, seqlens, table, causal=True,
                                                         return_lse=True)

    def step(q, cache, lens, table):
        return numbaflash.flash_mla_with_kvcache(q, cache, lens, table, causal=True, return_lse=True)

    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True)(q, cache, seqlens, table)
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
