"""The self-test's ``--decode`` mode (``tools/selftest_decode``): its case drawing, the host
arrays it builds (NaN wherever no sequence's keys lie), its float64 problem and its expected
caches, and ``main`` on a stand-in GPU; all without a GPU."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools import selftest
from numbaflash.tools import selftest_decode as sd
from numbaflash.tools.reference import attention_reference, varlen_attention_reference

SEEDS = (0, 1, 12345, 2**32 - 1)


@pytest.mark.parametrize("quick", [False, True])
def test_draws_are_reproducible_and_independent(quick):
    forward = [sd.draw_decode_case(42, i, quick) for i in range(60)]
    backward = [sd.draw_decode_case(42, i, quick) for i in reversed(range(60))][::-1]
    assert forward == backward
    assert [sd.draw_decode_case(43, i, quick) for i in range(60)] != forward


@pytest.mark.parametrize("seed", SEEDS)
def test_consecutive_cases_cover_every_head_dim_mask_and_dtype(seed):
    want = set(itertools.product(SUPPORTED_HEAD_DIMS, (False, True), selftest.DTYPE_NAMES))
    cases = [sd.draw_decode_case(seed, i) for i in range(len(want))]
    assert {(c.head_dim, c.causal, c.dtype) for c in cases} == want


@pytest.mark.parametrize("quick", [False, True])
def test_cases_are_valid_calls_within_the_reference_budget(quick):
    longest, cap = sd.DECODE_LIMITS[quick]
    cases = [sd.draw_decode_case(s, i, quick) for s in SEEDS for i in range(250)]
    for c in cases:
        assert 1 <= c.batch <= 6 and c.heads_q % c.heads_kv == 0 and 1 <= c.seqlen_q <= 16, c.describe()
        assert 1 <= c.capacity and (c.page_size == 0 or c.capacity % c.page_size == 0), c.describe()
        assert c.page_size in (0, *sd.PAGE_SIZES) and c.kind in sd.DECODE_KINDS, c.describe()
        assert 0 <= c.seqlen_new <= min(4, c.capacity), c.describe()
        assert all(0 <= n <= c.capacity - c.seqlen_new for n in c.cache_seqlens), c.describe()
        assert 0 <= c.num_splits <= 32 and c.amplitude >= 1, c.describe()
        assert c.batch * c.heads_q * c.seqlen_q * c.capacity <= cap, c.describe()
        assert c.window_size[0] >= -1 and c.window_size[1] >= -1 and c.softcap >= 0, c.describe()
    # the corners: empty and full caches, no keys at all, one key, paged and contiguous, splits
    assert any(0 in c.cache_seqlens for c in cases)
    assert any(c.capacity - c.seqlen_new in c.cache_seqlens and c.seqlen_new for c in cases)
    assert any(0 in c.keys for c in cases) and any(1 in c.keys for c in cases)
    assert any(c.page_size == 1 for c in cases) and any(c.page_size == 7 for c in cases)
    assert any(c.page_size == 0 for c in cases) and any(c.num_splits == 32 for c in cases)
    assert any(c.capacity > 1024 for c in cases) or quick
    plain = [c for c in cases if not c.mla]  # MLA cases take no window or softcap
    variant = sum(c.window_size != (-1, -1) or c.softcap > 0 for c in plain) / len(plain)
    assert abs(variant - sd.DECODE_WINDOW_SOFTCAP_SHARE) < 0.05


def test_variants_give_every_case_a_window_or_a_softcap():
    cases = [sd.draw_decode_case(s, i, variants=True) for s in SEEDS for i in range(100)]
    assert all(c.window_size != (-1, -1) or c.softcap > 0 for c in cases)
    assert any(c.window_size == (-1, -1) for c in cases) and any(c.softcap == 0 for c in cases)


def _paged_case():
    """A paged case with an empty sequence, a full one and new rows."""
    for i in itertools.count():
        c = sd.draw_decode_case(5, i, quick=True)
        if (c.page_size > 1 and c.seqlen_new and c.batch >= 2 and 0 in c.cache_seqlens
                and c.capacity - c.seqlen_new in c.cache_seqlens):
            return c


@pytest.mark.parametrize("paged", [False, True])
def test_inputs_are_nan_exactly_where_no_sequence_has_keys(paged):
    c = _paged_case() if paged else next(
        c for i in range(500) if (c := sd.draw_decode_case(3, i, quick=True)).page_size == 0 and c.seqlen_new)
    x = sd.make_decode_inputs(c)
    assert x.q.shape == (c.batch, c.seqlen_q, c.heads_q, c.head_dim)
    assert x.k_new.shape == x.v_new.shape == (c.batch, c.seqlen_new, c.heads_kv, c.head_dim)
    assert x.cache_seqlens.dtype == np.int32 and tuple(x.cache_seqlens) == c.cache_seqlens
    owned = np.zeros(x.k_cache.shape[:2], bool)
    for b, n in enumerate(c.cache_seqlens):
        owned[sd.cache_rows(c, x.block_table, b, c.start_of(b), n)] = True
    for cache in (x.k_cache, x.v_cache):
        nan = np.isnan(cache.astype(np.float64)).all(axis=(2, 3))
        assert (nan == ~owned).all() and not np.isnan(cache[owned].astype(np.float64)).any()
    if paged:
        table = x.block_table
        assert table.dtype == np.int32 and table.shape == (c.batch, c.capacity // c.page_size)
        assert len(set(table.ravel())) == table.size and table.max() < x.k_cache.shape[0]


def test_packed_problem_is_each_sequence_on_its_cache_then_its_new_rows():
    c = _paged_case()
    x = sd.make_decode_inputs(c)
    q, k, v, cu_q, cu_k = sd.packed_problem(c, x)
    assert list(np.diff(cu_k)) == list(c.keys) and list(np.diff(cu_q)) == [c.seqlen_q] * c.batch
    assert not np.isnan(k.astype(np.float64)).any()
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=c.causal)
    for b, n in enumerate(c.cache_seqlens):  # against a dense call on the sequence's own rows
        rows = sd.cache_rows(c, x.block_table, b, 0, n)
        kb = np.concatenate([x.k_cache[rows], x.k_new[b]])[None]
        vb = np.concatenate([x.v_cache[rows], x.v_new[b]])[None]
        o, s = attention_reference(x.q[b:b + 1], kb, vb, causal=c.causal)
        rows_q = slice(cu_q[b], cu_q[b + 1])
        assert np.array_equal(out[rows_q], o[0]) and np.array_equal(lse[:, rows_q], s[0])


def test_expected_caches_append_the_new_rows_and_keep_the_rest():
    c = _paged_case()
    x = sd.make_decode_inputs(c)
    k, v = sd.expected_caches(c, x)
    changed = np.zeros(k.shape[:2], bool)
    for b, n in enumerate(c.cache_seqlens):
        rows = sd.cache_rows(c, x.block_table, b, n, n + c.seqlen_new)
        changed[rows] = True
        assert np.array_equal(k[rows], x.k_new[b]) and np.array_equal(v[rows], x.v_new[b])
    same = lambda a, b: np.array_equal(a.astype(np.float64), b.astype(np.float64), equal_nan=True)  # noqa: E731
    assert same(k[~changed], x.k_cache[~changed]) and same(v[~changed], x.v_cache[~changed])


@pytest.mark.parametrize("variants", [False, True])
def test_main_with_decode(fake_hopper, capsys, variants):
    argv = ["--decode", "--quick", "--seed", "5", "--cases", "40"] + (["--variants"] if variants else [])
    assert selftest.main(argv) == 1
    text = capsys.readouterr().out
    assert fake_hopper == [sd.draw_decode_case(5, i, True, variants) for i in range(40)]
    assert "decode: 40 cases" in text and "39 passed, 1 failed" in text
    flags = "--quick --decode" + (" --variants" if variants else "")
    assert f"replay: python -m numbaflash.selftest --seed 5 {flags} --case 2" in text


@pytest.mark.parametrize("argv", [["--decode", "--backward"], ["--decode", "--family", "sm90"]])
def test_decode_refuses_options_that_do_not_apply(fake_hopper, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        selftest.main(argv)
    assert exc.value.code == 2 and "--decode" in capsys.readouterr().err and not fake_hopper


def test_a_share_of_decode_cases_draws_a_sink():
    """A learnable sink (issue 56) in about 15% of the cases (a third with --variants), one logit a
    query head, from a stream of its own."""
    from numbaflash.tools import selftest_decode

    for variants, share in ((False, selftest_decode.DECODE_SINK_SHARE),
                            (True, selftest_decode.DECODE_SINK_SHARE_VARIANTS)):
        cases = [selftest_decode.draw_decode_case(s, i, False, variants) for s in (0, 1) for i in range(500)]
        with_sink = [c for c in cases if c.sink]
        assert abs(len(with_sink) / len(cases) - share) < 0.05
        assert all(len(c.sink) == c.heads_q for c in with_sink) and "sink=" in with_sink[0].describe()


def test_a_share_of_decode_cases_draws_the_cache_options():
    """cache_batch_idx, cache_leftpad or both (issue 56) in about a quarter of the cases, from a stream
    of their own: the rest of a case is drawn as without them. cache_batch_idx: distinct rows of a
    cache of up to two rows more; cache_leftpad: 0 .. each sequence's cache_seqlens."""
    cases = [sd.draw_decode_case(s, i) for s in (0, 1) for i in range(500)]
    with_options = [c for c in cases if c.cache_batch_idx or c.cache_leftpad]
    assert abs(len(with_options) / len(cases) - sd.DECODE_CACHE_OPTION_SHARE) < 0.05
    for c in with_options:
        idx, pad = c.cache_batch_idx, c.cache_leftpad
        assert not idx or (len(set(idx)) == len(idx) == c.batch and c.batch <= c.cache_batch <= c.batch + 2)
        assert not pad or all(0 <= p <= n for p, n in zip(pad, c.cache_seqlens, strict=True))
        assert c.keys == tuple(n - c.start_of(b) + c.seqlen_new for b, n in enumerate(c.cache_seqlens))
    assert any(c.cache_batch_idx and c.cache_leftpad for c in with_options)
    assert any(c.cache_batch_idx and not c.cache_leftpad for c in with_options)
    assert any(c.cache_leftpad and not c.cache_batch_idx for c in with_options)
    assert any(0 < p < n for c in with_options for p, n in zip(c.cache_leftpad, c.cache_seqlens, strict=True))
    import dataclasses

    for c in with_options[:20]:
        plain = dataclasses.replace(c, cache_batch_idx=(), cache_leftpad=())
        assert plain == dataclasses.replace(sd.draw_decode_case(c.seed, c.index), cache_batch_idx=(),
                                            cache_leftpad=())
        assert "cache_" in c.describe()


@pytest.mark.parametrize("paged", [False, True])
def test_an_options_case_is_the_reference_call(paged):
    """An options case's inputs, packed problem and expected caches are ``kvcache_reference``'s call
    (the float64 reference of ``flash_attention_with_kvcache``): the same outputs, the same caches
    (NaN where no sequence's keys lie: before the left padding, the unused rows and pages)."""
    from numbaflash.tools.reference import kvcache_reference

    c = next(c for i in range(3000) if (c := sd.draw_decode_case(7, i, quick=True)).cache_batch_idx
             and c.cache_leftpad and c.seqlen_new and (c.page_size > 0) == paged and not c.rotary
             and any(0 < p < n for p, n in zip(c.cache_leftpad, c.cache_seqlens, strict=True)))
    x = sd.make_decode_inputs(c)
    assert tuple(x.cache_batch_idx) == c.cache_batch_idx and tuple(x.cache_leftpad) == c.cache_leftpad
    out, lse, k_after, v_after = kvcache_reference(
        x.q, x.k_cache, x.v_cache, x.cache_seqlens, k_new=x.k_new, v_new=x.v_new, block_table=x.block_table,
        cache_batch_idx=x.cache_batch_idx, cache_leftpad=x.cache_leftpad, causal=c.causal)
    q, k, v, cu_q, cu_k = sd.packed_problem(c, x)
    assert not np.isnan(k.astype(np.float64)).any() and not np.isnan(out).any()
    packed_out, packed_lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=c.causal)
    assert np.array_equal(packed_out, out.reshape(-1, c.heads_q, c.dims[1]))
    assert np.array_equal(packed_lse, lse.transpose(1, 0, 2).reshape(c.heads_q, -1))
    want_k, want_v = sd.expected_caches(c, x)
    for got, want in ((k_after, want_k), (v_after, want_v)):
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True)
    for b in range(c.batch):  # the rows before the left padding are NaN
        before = sd.cache_rows(c, x.block_table, b, 0, c.start_of(b))
        assert np.isnan(x.k_cache[before].astype(np.float64)).all()


def test_a_share_of_the_cases_with_new_rows_draws_a_rotary_embedding():
    cases = [sd.draw_decode_case(s, i) for s in (0, 1) for i in range(600)]
    with_new = [c for c in cases if c.seqlen_new]
    rotary = [c for c in with_new if c.rotary]
    assert abs(len(rotary) / len(with_new) - sd.DECODE_ROTARY_SHARE) < 0.06
    assert not any(c.rotary for c in cases if not c.seqlen_new)
    assert {c.rotary for c in rotary} == {1, 2} and all(
        c.rotary_dim % 16 == 0 and 16 <= c.rotary_dim <= c.head_dim for c in rotary)
    assert any(c.rotary_dim == c.head_dim for c in rotary) and "rotary=" in rotary[0].describe()


@pytest.mark.parametrize("paged", [False, True])
def test_a_rotary_case_is_the_reference_call(paged):
    """A rotary case (with the cache options where drawn) is ``kvcache_reference``'s call: the same
    outputs from its packed problem, the same caches (the rotated new rows)."""
    from numbaflash.tools.reference import kvcache_reference

    c = next(c for i in range(3000) if (c := sd.draw_decode_case(9, i, quick=True)).rotary
             and (c.page_size > 0) == paged and c.seqlen_q > 1 and (c.cache_batch_idx or c.cache_leftpad))
    x = sd.make_decode_inputs(c)
    assert x.rotary_cos.shape == (c.capacity + c.seqlen_q, c.rotary_dim // 2)
    assert x.rotary_cos.dtype == x.q.dtype
    out, lse, k_after, v_after = kvcache_reference(
        x.q, x.k_cache, x.v_cache, x.cache_seqlens, k_new=x.k_new, v_new=x.v_new, block_table=x.block_table,
        cache_batch_idx=x.cache_batch_idx, cache_leftpad=x.cache_leftpad, causal=c.causal,
        window_size=c.window_size, rotary_cos=x.rotary_cos, rotary_sin=x.rotary_sin,
        rotary_interleaved=c.rotary == 2)
    q, k, v, cu_q, cu_k = sd.packed_problem(c, x)
    packed_out, packed_lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=c.causal,
                                                        window_size=c.window_size)
    assert np.array_equal(packed_out, out.reshape(-1, c.heads_q, c.dims[1]))
    assert np.array_equal(packed_lse, lse.transpose(1, 0, 2).reshape(c.heads_q, -1))
    want_k, want_v = sd.expected_caches(c, x)
    for got, want in ((k_after, want_k), (v_after, want_v)):
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True)
    assert not np.array_equal(want_k.astype(np.float64), sd.expected_caches(
        dataclasses.replace(c, rotary=0, rotary_dim=0), x)[0].astype(np.float64), equal_nan=True)
    # a rounding of the dtype apart passes the cache check, more does not
    ulp = 2.0 ** (-10 if c.dtype == "float16" else -7)
    near = want_k.astype(np.float64) * (1 + ulp / 2)
    assert sd.same_cache(near, want_k.astype(np.float64), True, c.dtype)
    assert not sd.same_cache(near, want_k.astype(np.float64), False, c.dtype)
    far = want_k.astype(np.float64) * (1 + 4 * ulp) + 1e-3
    assert not sd.same_cache(far, want_k.astype(np.float64), True, c.dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_a_share_of_decode_cases_runs_a_pair_of_head_dims_as_the_reference_call(paged, monkeypatch):
    """(192, 128) in place of the head dim in about 15% of the cases, from a stream of its own (the
    rest of a case is drawn as without it): q, k_cache and k_new at 192 columns, v_cache, v_new and
    out at 128, a rotary dim within 192; the packed problem is ``kvcache_reference``'s call."""
    import dataclasses

    from numbaflash.tools.reference import kvcache_reference

    cases = [sd.draw_decode_case(s, i) for s in (0, 1) for i in range(500)]
    pairs = [c for c in cases if c.value_dims]
    assert abs(len(pairs) / len(cases) - sd.DECODE_VALUE_DIM_SHARE) < 0.05
    assert all(c.dims == (192, 128) and c.rotary_dim <= 192 for c in pairs)
    assert "d192v128" in pairs[0].describe()
    with monkeypatch.context() as patch:
        patch.setattr(sd, "DECODE_VALUE_DIM_SHARE", 0.0)
        for c in pairs[:20]:
            plain = sd.draw_decode_case(c.seed, c.index)
            assert dataclasses.replace(c, value_dims=(), rotary_dim=plain.rotary_dim) == plain
    c = next(c for i in range(3000) if (c := sd.draw_decode_case(5, i, quick=True)).value_dims
             and c.seqlen_new and (c.page_size > 0) == paged)
    x = sd.make_decode_inputs(c)
    assert x.q.shape[3] == x.k_cache.shape[3] == x.k_new.shape[3] == 192
    assert x.v_cache.shape[3] == x.v_new.shape[3] == 128
    rope = {} if not c.rotary else {"rotary_cos": x.rotary_cos, "rotary_sin": x.rotary_sin,
                                    "rotary_interleaved": c.rotary == 2}
    out, lse, _, v_after = kvcache_reference(
        x.q, x.k_cache, x.v_cache, x.cache_seqlens, k_new=x.k_new, v_new=x.v_new, block_table=x.block_table,
        cache_batch_idx=x.cache_batch_idx, cache_leftpad=x.cache_leftpad, causal=c.causal, **rope)
    q, k, v, cu_q, cu_k = sd.packed_problem(c, x)
    packed_out, packed_lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=c.causal)
    assert np.array_equal(packed_out, out.reshape(-1, c.heads_q, 128))
    assert np.array_equal(packed_lse, lse.transpose(1, 0, 2).reshape(c.heads_q, -1))
    assert np.array_equal(v_after.astype(np.float64), sd.expected_caches(c, x)[1].astype(np.float64),
                          equal_nan=True)


def test_a_share_of_decode_cases_runs_mla_decode():
    """About 10% of the cases are MLA decode, from a stream of their own: one latent KV head of 576
    columns whose first 512 are V (the host v_cache is k_cache's first columns), 1 to 128 query
    heads, no new rows, window, softcap, sink, cache options or rotary; every other case is drawn
    as without it. The packed problem's values are its keys' first 512 columns."""
    import dataclasses

    cases = [sd.draw_decode_case(s, i) for s in (0, 1) for i in range(500)]
    mla = [c for c in cases if c.mla]
    assert abs(len(mla) / len(cases) - sd.DECODE_MLA_SHARE) < 0.04
    assert {c.heads_q for c in mla} <= set(sd.MLA_HEADS) and len({c.heads_q for c in mla}) > 3
    assert any(c.page_size == 1 for c in cases if c.page_size) and any(c.page_size for c in mla)
    for c in mla:
        assert c.dims == (576, 512) and c.heads_kv == 1 and c.seqlen_new == 0 and not c.value_dims
        assert c.window_size == (-1, -1) and not (c.softcap or c.sink or c.cache_batch_idx or c.cache_leftpad
                                                  or c.rotary)
        assert c.describe().startswith("mla d576v512")
    with_mla = {(c.seed, c.index) for c in mla}
    saved = sd.DECODE_MLA_SHARE
    try:
        sd.DECODE_MLA_SHARE = 0.0
        assert all(sd.draw_decode_case(c.seed, c.index) == c for c in cases[:300]
                   if (c.seed, c.index) not in with_mla)
    finally:
        sd.DECODE_MLA_SHARE = saved
    c = next(c for c in mla if c.batch > 1 and max(c.cache_seqlens) > 0)
    x = sd.make_decode_inputs(c)
    assert x.q.shape[3] == x.k_cache.shape[3] == 576 and x.v_cache.shape[3] == 512
    assert np.array_equal(x.v_cache, x.k_cache[..., :512], equal_nan=True)
    q, k, v, _, _ = sd.packed_problem(c, x)
    assert np.array_equal(v, k[..., :512])
    assert dataclasses.replace(c, mla=False).dims != c.dims
