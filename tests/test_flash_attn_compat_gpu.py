"""flash-attn's interface on numbaflash (``numbaflash.integrations.flash_attn``) on the GPU: the
functions against torch's SDPA in float32, packed inputs read in place, gradients through them, and
the KV-cache call with flash-attn's int ``cache_seqlens``.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_flash_attn_compat_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numbaflash.integrations import flash_attn as fa  # noqa: E402

pytestmark = pytest.mark.gpu


def sdpa(q, k, v, causal):
    """float32 SDPA on (batch, seqlen, heads, d), GQA expanded, causal bottom-right aligned."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    mask = None
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        rows, keys = torch.arange(sq, device=q.device), torch.arange(sk, device=q.device)
        mask = keys[None, :] <= rows[:, None] + sk - sq
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def test_qkvpacked_forward_and_backward():
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, 257, 3, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    qkv.requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = sdpa(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    grad = qkv.grad.clone()
    qkv.grad = None
    ref32 = qkv.detach().float().requires_grad_()
    sdpa(ref32[:, :, 0], ref32[:, :, 1], ref32[:, :, 2], True).square().sum().backward()
    assert (grad.float() - ref32.grad).abs().max() <= 0.05 * ref32.grad.abs().max()


def test_gqa_kvpacked_and_lse():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 100, 8, 64, device="cuda", dtype=torch.float16, generator=gen)
    kv = torch.randn(1, 300, 2, 2, 64, device="cuda", dtype=torch.float16, generator=gen)
    out, lse, probs = fa.flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (1, 8, 100) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), sdpa(q, kv[:, :, 0], kv[:, :, 1], True), atol=5e-3, rtol=5e-3)


def test_kvcache_with_an_int_cache_seqlens():
    gen = torch.Generator(device="cuda").manual_seed(2)
    k_cache = torch.randn(4, 512, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(4, 1, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=300)
    assert torch.equal(k_cache[:, 300], k[:, 0]) and torch.equal(v_cache[:, 300], v[:, 0])
    ref = sdpa(q, k_cache[:, :301], v_cache[:, :301], False)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
