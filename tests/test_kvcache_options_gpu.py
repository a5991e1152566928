"""The KV-cache call's ``cache_batch_idx`` and ``cache_leftpad`` (issue 56, item 4) on the GPU: each
sequence against the float64 reference of its own keys (cache rows cache_leftpad[b] ..
cache_seqlens[b] - 1 of the cache's row cache_batch_idx[b], then the new rows), contiguous and
paged caches of more rows than sequences, appended rows (the caches checked bit for bit against
``tools.reference.kvcache_reference``: the new rows in the right cache rows, nothing else
written), GQA, seqlen_q 1 to 4, one, five and the automatic number of splits, causal and not, a
window, a softcap and a learnable sink with them, sequences of no key, and a captured CUDA graph
that follows new values of both arrays.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_kvcache_options_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
from numbaflash.tools.reference import compare_with_reference, kvcache_reference  # noqa: E402
from tests.test_decode_gpu import DTYPES, PAGE, host  # noqa: E402

pytestmark = pytest.mark.gpu

OPTIONS = [(True, False), (False, True), (True, True)]  # (cache_batch_idx, cache_leftpad)
IDS = ["batch_idx", "leftpad", "both"]


def option_problem(seed, dtype, paged, *, batch=4, rows=6, seqlen_q=2, heads_kv=2, group=4, d=128,
                   capacity=500, seqlen_new=3, batch_idx=True, leftpad=True):
    """q, the caches (``rows`` batch rows, or pages of ``rows`` table rows), cache_seqlens (the first
    sequence's 1, the second's its room), the new rows, the block table, cache_batch_idx (distinct
    rows, shuffled) and cache_leftpad (0, the whole cache, random) or None."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(dtype)  # noqa: E731
    q = rand(batch, seqlen_q, heads_kv * group, d)
    room = capacity - seqlen_new
    lengths = [1, room] + [int(x) for x in rng.integers(1, room + 1, batch - 2)]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    new = (rand(batch, seqlen_new, heads_kv, d), rand(batch, seqlen_new, heads_kv, d)) if seqlen_new else None
    cache_rows = rows if batch_idx else batch
    table = None
    if paged:
        per_seq = -(-capacity // PAGE)
        num_pages = cache_rows * per_seq + 5
        order = rng.permutation(num_pages)[:cache_rows * per_seq]
        table = torch.tensor(order.reshape(cache_rows, per_seq), dtype=torch.int32, device="cuda")
        kc, vc = rand(num_pages, PAGE, heads_kv, d), rand(num_pages, PAGE, heads_kv, d)
    else:
        kc, vc = rand(cache_rows, capacity, heads_kv, d), rand(cache_rows, capacity, heads_kv, d)
    idx = pad = None
    if batch_idx:
        idx = torch.tensor(rng.permutation(rows)[:batch], dtype=torch.int32, device="cuda")
    if leftpad:
        pads = [0, lengths[1]] + [int(rng.integers(0, n + 1)) for n in lengths[2:]]
        pad = torch.tensor(pads, dtype=torch.int32, device="cuda")
    return q, kc, vc, seqlens, new, table, idx, pad


def bits(x):
    """A 16-bit array's bits (float16 and bfloat16 alike), to compare bit for bit."""
    return np.asarray(x).view(np.uint16)


def run_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, *, causal=True, splits=0, sink=None,
                  **options):
    """One call (the caches first reset to ``before``, out poisoned with NaN), each sequence against
    float64 on its own keys, and the caches bit for bit against the reference's."""
    kc.copy_(before[0])
    vc.copy_(before[1])
    out = torch.full_like(q, float("nan"))
    kwargs = {"block_table": table, "num_splits": splits, "return_lse": True, "out": out, "causal": causal,
              "cache_batch_idx": idx, "cache_leftpad": pad, **options}
    if sink is not None:
        kwargs["learnable_sink"] = torch.from_numpy(sink).cuda()
    if new is not None:
        kwargs.update(k_new=new[0], v_new=new[1])
    result, lse = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    torch.cuda.synchronize()
    assert result is out
    host_new = {} if new is None else {"k_new": host(new[0]), "v_new": host(new[1])}
    ref = kvcache_reference(
        host(q), host(before[0]), host(before[1]), seqlens.cpu().numpy(), **host_new,
        block_table=None if table is None else table.cpu().numpy(),
        cache_batch_idx=None if idx is None else idx.cpu().numpy(),
        cache_leftpad=None if pad is None else pad.cpu().numpy(), causal=causal)
    assert np.array_equal(bits(host(kc)), bits(ref[2])), "k_cache holds other rows than expected"
    assert np.array_equal(bits(host(vc)), bits(ref[3])), "v_cache holds other rows than expected"
    for b in range(q.shape[0]):
        row = b if idx is None else int(idx[b])
        start, end = (0 if pad is None else int(pad[b])), int(seqlens[b])
        keys, values = [], []
        for cache, found in ((before[0], keys), (before[1], values)):
            if table is None:
                found.append(cache[row, start:end])
            else:
                found.append(torch.cat([cache[int(p)] for p in table[row]])[start:end])
        if new is not None:
            keys.append(new[0][b])
            values.append(new[1][b])
        k_b, v_b = torch.cat(keys)[None], torch.cat(values)[None]
        if k_b.shape[1] == 0:  # no key: 0, and LSE -inf (or the sink)
            assert (out[b].float() == 0).all()
            expected = np.full((q.shape[2], q.shape[1]), -np.inf) if sink is None else np.repeat(
                sink[:, None], q.shape[1], axis=1)
            got = lse[b].cpu().numpy()
            assert np.array_equal(np.isneginf(got), np.isneginf(expected))
            continue
        _, problems = compare_with_reference(host(q[b:b + 1]), host(k_b), host(v_b), host(out[b:b + 1]),
                                             lse[b:b + 1].cpu().numpy(), causal=causal, sink=sink, **options)
        assert not problems, (f"batch {b} (row {row}, keys {start}..{end} + new, splits {splits}, causal "
                              f"{causal}, {options}): " + "; ".join(problems))
    return out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize(("batch_idx", "leftpad"), OPTIONS, ids=IDS)
@pytest.mark.parametrize(("group", "seqlen_q"), [(1, 1), (8, 1), (4, 4)])
def test_options_match_reference(d, dtype, paged, batch_idx, leftpad, group, seqlen_q):
    for seqlen_new in (0, 3):
        seed = d + group + seqlen_q + seqlen_new + 10 * batch_idx + 20 * leftpad
        q, kc, vc, seqlens, new, table, idx, pad = option_problem(
            seed, DTYPES[dtype], paged, seqlen_q=seqlen_q, group=group, d=d, seqlen_new=seqlen_new,
            batch_idx=batch_idx, leftpad=leftpad)
        before = (kc.clone(), vc.clone())
        for splits, causal in ((0, True), (1, False), (5, True), (5, False)):
            run_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, causal=causal, splits=splits)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 4])
def test_options_with_window_softcap_and_sink(dtype, paged, splits):
    q, kc, vc, seqlens, new, table, idx, pad = option_problem(3, DTYPES[dtype], paged)
    before = (kc.clone(), vc.clone())
    sink = (np.random.default_rng(3).standard_normal(q.shape[2]) * 2).astype(np.float32)
    for kwargs in ({"window_size": (127, 0), "causal": False}, {"softcap": 30.0}, {"sink": sink},
                   {"window_size": (40, 0), "softcap": 30.0, "sink": sink}):
        run_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, splits=splits, **kwargs)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_only_the_indexed_rows_change(paged):
    """Sequences 0..3 use cache rows 5, 3, 1, 0 of six: the new rows land there (checked against the
    reference in ``run_and_check``), and rows 2 and 4 keep every bit."""
    q, kc, vc, seqlens, new, table, _, pad = option_problem(5, torch.float16, paged)
    idx = torch.tensor([5, 3, 1, 0], dtype=torch.int32, device="cuda")
    before = (kc.clone(), vc.clone())
    run_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, splits=3)
    for row in (2, 4):
        units = [row] if table is None else [int(p) for p in table[row]]
        for unit in units:
            assert torch.equal(kc[unit], before[0][unit]) and torch.equal(vc[unit], before[1][unit]), unit


@pytest.mark.parametrize("splits", [0, 4])
def test_graph_replays_follow_new_option_values(splits):
    """A call captured once with cache_batch_idx and cache_leftpad, replayed after writing new
    values into both (and cache_seqlens) on the device: each replay equals an eager call with those
    values, bit for bit."""
    q, kc, vc, seqlens, new, _, idx, pad = option_problem(11, torch.float16, False, seqlen_new=1)
    before = (kc.clone(), vc.clone())
    out = torch.empty_like(q)
    kwargs = {"k_new": new[0], "v_new": new[1], "num_splits": splits, "cache_batch_idx": idx,
              "cache_leftpad": pad}
    numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, out=out, **kwargs)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, out=out, **kwargs)
    rng = np.random.default_rng(11)
    for _ in range(8):
        lengths = rng.integers(1, 400, q.shape[0])
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        idx.copy_(torch.tensor(rng.permutation(6)[:q.shape[0]], dtype=torch.int32))
        pad.copy_(torch.tensor([int(rng.integers(0, n + 1)) for n in lengths], dtype=torch.int32))
        kc.copy_(before[0])
        vc.copy_(before[1])
        graph.replay()
        k_graph, v_graph = kc.clone(), vc.clone()
        kc.copy_(before[0])
        vc.copy_(before[1])
        eager = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(kc, k_graph) and torch.equal(vc, v_graph)


# ------------------------------------------------------------------ the rotary embedding


def rope_tables(rows, dim, dtype, base=10000.0):
    """cos, sin (rows, dim / 2) of the usual RoPE angles, in ``dtype``, on the GPU."""
    angle = torch.arange(rows, dtype=torch.float64)[:, None] / base ** (
        torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)[None, :]
    return angle.cos().to(dtype).cuda(), angle.sin().to(dtype).cuda()


def run_rotary_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, cos, sin, interleaved, *,
                         causal=True, splits=0, **options):
    """One rotary call (caches reset to ``before``, out poisoned with NaN): the caches against
    ``kvcache_reference`` (bit for bit outside the appended rows; the appended rows, rotated in
    float32 by both, within a rounding of the dtype), then each sequence against float64 on its
    own keys: its cached rows, then the rotated new rows the kernel stored, with q rotated by the
    reference."""
    from numbaflash.tools.reference import rotary_embedding, rotary_query_step

    kc.copy_(before[0])
    vc.copy_(before[1])
    out = torch.full_like(q, float("nan"))
    result, lse = numbaflash.flash_attention_with_kvcache(
        q, kc, vc, seqlens, k_new=new[0], v_new=new[1], block_table=table, num_splits=splits, return_lse=True,
        out=out, causal=causal, cache_batch_idx=idx, cache_leftpad=pad, rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=interleaved, **options)
    torch.cuda.synchronize()
    assert result is out
    lens = seqlens.cpu().numpy()
    host_table = None if table is None else table.cpu().numpy()
    ref = kvcache_reference(
        host(q), host(before[0]), host(before[1]), lens, k_new=host(new[0]), v_new=host(new[1]),
        block_table=host_table, cache_batch_idx=None if idx is None else idx.cpu().numpy(),
        cache_leftpad=None if pad is None else pad.cpu().numpy(), causal=causal, rotary_cos=host(cos),
        rotary_sin=host(sin), rotary_interleaved=interleaved, **options)
    assert np.array_equal(bits(host(vc)), bits(ref[3])), "v_cache holds other rows than expected"
    got_k = host(kc).astype(np.float64)
    want_k = ref[2].astype(np.float64)
    ulp = 2.0 ** (-10 if q.dtype == torch.float16 else -7)
    assert np.all(np.abs(got_k - want_k) <= ulp * np.abs(want_k) + 1e-6), "k_cache: rotated rows differ"
    room = kc.shape[1] * (1 if table is None else table.shape[1])
    step = rotary_query_step(causal, options.get("window_size", (-1, -1)), room)
    for b in range(q.shape[0]):
        row = b if idx is None else int(idx[b])
        start, end = (0 if pad is None else int(pad[b])), int(lens[b])
        seen_k, seen_v = [], []
        for cache, found, stop in ((kc, seen_k, end + new[0].shape[1]), (before[1], seen_v, end)):
            rows = cache[row] if table is None else torch.cat([cache[int(p)] for p in table[row]])
            found.append(rows[start:stop])
        seen_v.append(new[1][b])
        q_rot = rotary_embedding(host(q[b]), host(cos), host(sin), end + np.arange(q.shape[1]) * step,
                                 interleaved)
        _, problems = compare_with_reference(q_rot[None], host(torch.cat(seen_k))[None],
                                             host(torch.cat(seen_v))[None], host(out[b:b + 1]),
                                             lse[b:b + 1].cpu().numpy(), causal=causal, **options)
        assert not problems, (f"batch {b} (row {row}, keys {start}..{end} + new, splits {splits}, causal "
                              f"{causal}, interleaved {interleaved}, {options}): " + "; ".join(problems))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rotary", ["16", "half", "all"])
def test_rotary_matches_reference(d, dtype, paged, interleaved, rotary):
    dim = {"16": 16, "half": d // 2, "all": d}[rotary]
    for options, (batch_idx, leftpad) in ((0, (False, False)), (1, (True, True))):
        q, kc, vc, seqlens, new, table, idx, pad = option_problem(
            d + dim + options, DTYPES[dtype], paged, d=d, seqlen_q=3, group=2, batch_idx=batch_idx,
            leftpad=leftpad)
        room = kc.shape[1] * (1 if table is None else table.shape[1])
        cos, sin = rope_tables(room + 7, dim, DTYPES[dtype])
        before = (kc.clone(), vc.clone())
        for splits, causal in ((0, True), (1, False), (5, True)):
            run_rotary_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, cos, sin, interleaved,
                                 causal=causal, splits=splits)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_rotary_with_window_softcap_and_the_window_append(interleaved):
    """A window kernel appends its new rows by a pass of its own (``append_new_rows``): rotated
    there too; with a softcap."""
    q, kc, vc, seqlens, new, table, idx, pad = option_problem(21, torch.bfloat16, False, seqlen_q=2)
    cos, sin = rope_tables(kc.shape[1], 64, torch.bfloat16)
    before = (kc.clone(), vc.clone())
    for splits in (1, 4):
        run_rotary_and_check(q, kc, vc, seqlens, new, table, idx, pad, before, cos, sin, interleaved,
                             causal=False, splits=splits, window_size=(40, 0), softcap=30.0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 3])
def test_option_calls_of_a_known_layout_take_the_fast_path(monkeypatch, paged, splits):
    """A second call of a validated layout with a learnable sink, cache_batch_idx and
    cache_leftpad goes through ``decode.run_torch`` and gives the first call's bits; a new sink
    of the same layout is read (the output changes), and a sink the plan cannot take (float16) is
    declined there and refused by the full path."""
    from numbaflash.operations import decode as decode_op

    q, kc, vc, seqlens, _, table, idx, pad = option_problem(12, torch.bfloat16, paged, seqlen_new=0)
    sink = torch.randn(q.shape[2], device="cuda")
    kwargs = {"block_table": table, "num_splits": splits, "return_lse": True, "learnable_sink": sink,
              "cache_batch_idx": idx, "cache_leftpad": pad}
    out0, lse0 = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    fast = []
    real = decode_op.run_torch
    monkeypatch.setattr(decode_op, "run_torch", lambda *args: fast.append(real(*args)) or fast[-1])
    out1, lse1 = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
    torch.cuda.synchronize()
    assert fast and fast[0] is not None, "the second call did not take the fast path"
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    out2, lse2 = numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **{**kwargs,
                                                                               "learnable_sink": sink + 3})
    assert fast[-1] is not None and not torch.equal(lse2, lse0) and not torch.equal(out2, out0)
    with pytest.raises(TypeError, match="learnable_sink must be float32"):
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **{**kwargs,
                                                                       "learnable_sink": sink.half()})
    assert fast[-1] is None
