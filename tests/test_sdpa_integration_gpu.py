"""``numbaflash.integrations.sdpa`` on the GPU: routed SDPA calls (plain, causal, GQA, a padded head
dim) against torch's own SDPA in float32, forward and gradients, and a call that stays on torch.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_sdpa_integration_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numbaflash.integrations import sdpa  # noqa: E402

pytestmark = pytest.mark.gpu
F = torch.nn.functional


@pytest.mark.parametrize(("sq", "sk", "heads_kv", "d", "causal"), [
    (333, 333, 8, 128, True), (200, 517, 8, 64, False), (256, 256, 2, 128, True), (77, 77, 8, 80, True),
    (64, 4096, 8, 40, False),
])
def test_routed_calls_match_torch(sq, sk, heads_kv, d, causal):
    gen = torch.Generator(device="cuda").manual_seed(sq + d)
    q = torch.randn(2, 8, sq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, heads_kv, sk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    gqa = heads_kv != 8
    assert sdpa.routes(q, k, v, is_causal=causal, enable_gqa=gqa)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sdpa.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    out.float().square().sum().backward()
    ref_leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal, enable_gqa=gqa)
    ref.square().sum().backward()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert (got.grad.float() - want.grad).abs().max() <= 0.05 * want.grad.abs().max() + 1e-3


def test_a_top_left_causal_call_stays_on_torch():
    q = torch.randn(1, 4, 10, 64, device="cuda", dtype=torch.float16)
    k = v = torch.randn(1, 4, 30, 64, device="cuda", dtype=torch.float16)
    assert not sdpa.routes(q, k, v, is_causal=True)
    with sdpa.patched():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
