"""flash-attn's interface on numbaflash (``numbaflash.integrations.flash_attn``), no GPU: numbaflash's
three calls replaced by recorders that compute attention in float64, so these tests check what
each flash-attn function passes on (arguments, defaults, packed views, return values), what it
refuses, and that ``install()`` makes ``import flash_attn`` give them."""

from __future__ import annotations

import importlib
import math
import sys

import pytest

torch = pytest.importorskip("torch")

import numbaflash  # noqa: E402
from numbaflash.integrations import flash_attn as fa  # noqa: E402


def attend(q, k, v, causal, scale):
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        seen = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
        s = s.masked_fill(~seen, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.fixture
def calls(monkeypatch):
    seen: list = []

    def dense(q, k, v, **kw):
        seen.append(("dense", q, k, v, kw))
        out, lse = attend(q, k, v, kw["causal"], kw["softmax_scale"] or q.shape[-1] ** -0.5)
        return (out, lse) if kw["return_lse"] else out

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.append(("varlen", q, k, v, (cu_q, cu_k, max_q, max_k), kw))
        return (q, q.new_zeros(q.shape[1], q.shape[0])) if kw["return_lse"] else q

    def kvcache(q, k_cache, v_cache, cache_seqlens, **kw):
        seen.append(("kvcache", q, k_cache, v_cache, cache_seqlens, kw))
        return (q, q.new_zeros(q.shape[0], q.shape[2], q.shape[1])) if kw["return_lse"] else q

    monkeypatch.setattr(numbaflash.api, "flash_attention", dense)
    monkeypatch.setattr(numbaflash.api, "flash_attention_varlen", varlen)
    monkeypatch.setattr(numbaflash.api, "flash_attention_with_kvcache", kvcache)
    return seen


def qkv(batch=2, seqlen=6, heads=4, heads_kv=2, d=32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, seqlen, heads, d, dtype=torch.float64, generator=gen),
            torch.randn(batch, seqlen, heads_kv, d, dtype=torch.float64, generator=gen),
            torch.randn(batch, seqlen, heads_kv, d, dtype=torch.float64, generator=gen))


def test_flash_attn_func_passes_flash_attn_s_arguments_and_returns_its_tuple(calls):
    q, k, v = qkv()
    out = fa.flash_attn_func(q, k, v, 0.0, 0.25, True, (3, 0), 5)
    _, _, _, _, kw = calls[-1]
    assert kw == {"causal": True, "softmax_scale": 0.25, "window_size": (3, 0), "softcap": 5.0,
                  "return_lse": False}
    torch.testing.assert_close(out, attend(q, k, v, True, 0.25)[0])
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 6)  # flash-attn gives probabilities only with dropout
    assert calls[-1][4]["softmax_scale"] is None  # the default scale is numbaflash's: 1/sqrt(head_dim)


def test_packed_inputs_are_read_in_place(calls):
    q, k, v = qkv(heads_kv=4)
    fa.flash_attn_qkvpacked_func(torch.stack((q, k, v), dim=2), causal=True)
    _, q2, k2, v2, _ = calls[-1]
    for got, want in zip((q2, k2, v2), (q, k, v), strict=True):
        torch.testing.assert_close(got, want)
        assert got.stride(-1) == 1  # a view with a contiguous head dim: what the kernels take
    fa.flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2))
    torch.testing.assert_close(calls[-1][2], k)
    torch.testing.assert_close(calls[-1][3], v)


def test_varlen_functions(calls):
    q = torch.randn(10, 4, 32, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int64)
    fa.flash_attn_varlen_func(q, q, q, cu, cu, 6, torch.tensor(6), causal=True)
    name, _, _, _, lengths, kw = calls[-1]
    assert name == "varlen" and lengths[0].dtype == torch.int32 and lengths[2:] == (6, 6)
    assert kw["causal"] is True and kw["window_size"] == (-1, -1) and kw["return_lse"] is False
    packed = torch.stack((q, q, q), dim=1)
    out, lse, probs = fa.flash_attn_varlen_qkvpacked_func(packed, cu, 6, return_attn_probs=True)
    assert probs is None and torch.equal(calls[-1][4][0], calls[-1][4][1])
    fa.flash_attn_varlen_kvpacked_func(q, torch.stack((q, q), dim=1), cu, cu, 6, 6)
    with pytest.raises(NotImplementedError, match="block_table"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_kvcache_takes_flash_attn_s_defaults(calls):
    q = torch.randn(3, 1, 4, 32)
    cache = torch.randn(3, 16, 2, 32)
    fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5)
    _, _, _, _, seqlens, kw = calls[-1]
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [5, 5, 5]
    assert kw["causal"] is False and kw["rotary_interleaved"] is True and kw["return_lse"] is False
    new = torch.randn(3, 1, 2, 32)
    out, lse = fa.flash_attn_with_kvcache(q, cache, cache, k=new, v=new, cache_seqlens=7, causal=True,
                                          return_softmax_lse=True, num_splits=2)
    _, _, _, _, seqlens, kw = calls[-1]
    assert seqlens.tolist() == [7, 7, 7] and kw["k_new"] is new and kw["v_new"] is new
    count = len(calls)
    with pytest.raises(ValueError, match="need cache_seqlens"):  # flash-attn's rule: nowhere to append
        fa.flash_attn_with_kvcache(q, cache, cache, k=new, v=new)
    assert len(calls) == count
    fa.flash_attn_with_kvcache(q, cache, cache)
    assert calls[-1][4].tolist() == [16, 16, 16]  # no new rows: every cache row is a key
    assert kw["causal"] is True and kw["num_splits"] == 2
    pages = torch.zeros(3, 4, dtype=torch.int32)
    fa.flash_attn_with_kvcache(q, cache, cache, block_table=pages, cache_seqlens=torch.tensor([1, 2, 3]))
    _, _, _, _, seqlens, kw = calls[-1]
    assert seqlens.dtype == torch.int32 and kw["block_table"] is pages
    fa.flash_attn_with_kvcache(q, cache, cache, block_table=pages)
    assert calls[-1][4].tolist() == [64, 64, 64]  # every page's rows


def test_what_numbaflash_does_not_have_is_refused(calls):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="no attention dropout"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4))
    with pytest.raises(NotImplementedError, match="ALiBi"):
        fa.flash_attn_with_kvcache(q, k, v, alibi_slopes=torch.ones(4))
    assert calls == []


def test_deterministic_turns_torch_s_setting_on_for_the_call(calls, monkeypatch):
    states = []
    dense = numbaflash.api.flash_attention

    def recording(*args, **kw):
        states.append(torch.are_deterministic_algorithms_enabled())
        return dense(*args, **kw)

    monkeypatch.setattr(numbaflash.api, "flash_attention", recording)
    q, k, v = qkv()
    assert not torch.are_deterministic_algorithms_enabled()
    fa.flash_attn_func(q, k, v, deterministic=True)
    fa.flash_attn_func(q, k, v)
    assert states == [True, False] and not torch.are_deterministic_algorithms_enabled()


def test_install_makes_flash_attn_imports_give_numbaflash(calls):
    before = sys.modules.get("flash_attn")
    module = fa.install()
    try:
        assert fa.install() is module
        import flash_attn
        from flash_attn import flash_attn_varlen_func
        from flash_attn.flash_attn_interface import flash_attn_func

        assert flash_attn is module and flash_attn.__version__.endswith("+numbaflash")
        assert flash_attn_func is fa.flash_attn_func and flash_attn_varlen_func is fa.flash_attn_varlen_func
        assert importlib.import_module("flash_attn.flash_attn_interface").flash_attn_with_kvcache is (
            fa.flash_attn_with_kvcache)
        q, k, v = qkv()
        flash_attn_func(q, k, v, causal=True)
        assert calls[-1][0] == "dense"
    finally:
        fa.uninstall()
    assert sys.modules.get("flash_attn") is before
    assert "flash_attn.flash_attn_interface" not in sys.modules or before is not None
