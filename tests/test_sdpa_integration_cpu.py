"""``numbaflash.integrations.sdpa`` with no GPU: which SDPA calls go to numbaflash and which to
torch's own, and that the routed ones mean what SDPA means. numbaflash's call is replaced by a
float64 stand-in with FlashAttention's semantics (bottom-right causal alignment), and the GPU and
16-bit dtype conditions are opened to CPU float64 tensors, so every routed result can be compared
with torch's SDPA on the same inputs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import numbaflash  # noqa: E402
from numbaflash.integrations import sdpa  # noqa: E402

F = torch.nn.functional
TORCH_SDPA = F.scaled_dot_product_attention


def flash_semantics(q, k, v, causal=False, softmax_scale=None):
    """(batch, seqlen, heads, d) attention, FlashAttention's rules: GQA, bottom-right causal."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (softmax_scale or q.shape[-1] ** -0.5)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


@pytest.fixture
def routed(monkeypatch):
    calls = []

    def flash_attention(q, k, v, causal=False, softmax_scale=None):
        calls.append((tuple(q.shape), causal, softmax_scale))
        return flash_semantics(q, k, v, causal, softmax_scale)

    monkeypatch.setattr(numbaflash.api, "flash_attention", flash_attention)
    monkeypatch.setattr(sdpa, "_on_gpu", lambda t: True)
    monkeypatch.setattr(sdpa, "_dtypes", lambda: (torch.float64,))
    return calls


def bhsd(batch, heads, seqlen, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, seqlen, d, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize(("sq", "sk", "heads_kv", "d", "causal", "scale"), [
    (7, 11, 4, 64, False, None), (9, 9, 4, 64, True, None), (9, 9, 2, 128, True, 0.2),
    (5, 5, 4, 80, True, None), (1, 30, 1, 96, False, None), (6, 6, 2, 512, True, None),  # 512: in halves
])
def test_routed_calls_mean_what_sdpa_means(routed, sq, sk, heads_kv, d, causal, scale):
    q, k, v = bhsd(2, 4, sq, d, 1), bhsd(2, heads_kv, sk, d, 2), bhsd(2, heads_kv, sk, d, 3)
    gqa = heads_kv != 4
    out = sdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    assert routed == [((2, sq, 4, d), causal, scale)]
    assert out.shape == (2, 4, sq, d)
    torch.testing.assert_close(out, TORCH_SDPA(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa))


def test_calls_numbaflash_cannot_compute_exactly_go_to_torch(routed):
    q, k, v = bhsd(1, 4, 6, 64), bhsd(1, 4, 10, 64, 1), bhsd(1, 4, 10, 64, 2)
    mask = torch.rand(6, 10, generator=torch.Generator().manual_seed(0)) > 0.3
    cases = [
        dict(is_causal=True),  # seqlen_q != seqlen_k: SDPA's causal is top-left, FlashAttention's not
        dict(attn_mask=mask),
        dict(dropout_p=0.0, attn_mask=torch.zeros(6, 10, dtype=torch.float64)),
    ]
    for kw in cases:
        got = sdpa.scaled_dot_product_attention(q, k, v, **kw)
        torch.testing.assert_close(got, TORCH_SDPA(q, k, v, **kw))
    assert routed == []
    torch.manual_seed(0)
    dropped = sdpa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, TORCH_SDPA(q, k, v, dropout_p=0.5))
    assert not sdpa.routes(q, k[:, :2], v[:, :2])  # GQA heads without enable_gqa: torch raises, as itself
    assert not sdpa.routes(*(bhsd(1, 4, 6, 264, s) for s in range(3)))  # no kernel, not even padded
    assert not sdpa.routes(q[0], k[0], v[0])  # 3-D
    assert not sdpa.routes(q.float(), k.float(), v.float())  # not a kernel dtype
    strided = bhsd(1, 4, 64, 6).transpose(2, 3)  # (1, 4, 6, 64), its head dim not contiguous
    assert strided.shape == q.shape and not sdpa.routes(strided, k, v)
    odd = bhsd(1, 4, 6, 65)[..., 1:]  # rows off 16-byte boundaries
    assert sdpa.routes(q, k, v) and not sdpa.routes(odd, k[..., :6, :], v[..., :6, :])
    assert routed == []


def test_install_and_patched_swap_torch_s_function(routed):
    q, k, v = bhsd(1, 2, 5, 32), bhsd(1, 2, 5, 32, 1), bhsd(1, 2, 5, 32, 2)

    def model(q, k, v):  # looks the function up when it runs, as diffusers and transformers do
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa.patched():
        assert F.scaled_dot_product_attention is sdpa.scaled_dot_product_attention
        model(q, k, v)
        with sdpa.patched():  # nested: the inner block leaves it installed
            pass
        assert F.scaled_dot_product_attention is sdpa.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is TORCH_SDPA and len(routed) == 1
    sdpa.install()
    try:
        sdpa.install()
        assert F.scaled_dot_product_attention is sdpa.scaled_dot_product_attention
    finally:
        sdpa.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA
