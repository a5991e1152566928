"""Head dims with no kernel of their own, run padded on the next larger kernel
(``numbaflash.operations.head_dims``), on the GPU against float64 with FlashAttention's criterion:
numpy and torch inputs, the forward, the standalone backward, autograd and the packed call.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_padded_head_dims_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash.tools.reference import (
    compare_gradients_with_reference,
    compare_varlen_with_reference,
    compare_with_reference,
)

pytestmark = pytest.mark.gpu

# (d_qk, d_v): Stable Diffusion's 40 and 160, Phi-2's 80, SigLIP's 72, a pair no kernel has
DIMS = [(40, 40), (80, 80), (72, 72), (160, 160), (72, 48)]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): ragged, seqlen_q past seqlen_k (rows that see
# no key under causal masking), GQA
SHAPES = [(2, 77, 133, 4, 2), (1, 190, 65, 2, 1)]


def draw(rng, shape, dims, dtype):
    batch, sq, sk, hq, hkv = shape
    d, dv = dims
    return (rng.standard_normal((batch, sq, hq, d)).astype(dtype),
            rng.standard_normal((batch, sk, hkv, d)).astype(dtype),
            rng.standard_normal((batch, sk, hkv, dv)).astype(dtype))


def dtypes():
    import ml_dtypes

    return [np.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_forward_and_backward(dims, shape, causal):
    rng = np.random.default_rng(hash((dims, shape, causal)) % 2**32)
    for dtype in dtypes():
        q, k, v = draw(rng, shape, dims, dtype)
        out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
        assert out.shape == (*q.shape[:3], dims[1]) and out.dtype == q.dtype
        ratio, problems = compare_with_reference(q, k, v, out, lse, causal=causal)
        assert not problems, (dtype, problems)
        dout = rng.standard_normal(out.shape).astype(dtype)
        grads = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=causal)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        ratio, problems = compare_gradients_with_reference(q, k, v, dout, grads, causal=causal)
        assert not problems, (dtype, problems)


@pytest.mark.parametrize("dims", [(80, 80), (72, 48)])
def test_torch_autograd_window_and_softcap(dims):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    q, k, v = draw(rng, SHAPES[0], dims, np.float16)
    dout = rng.standard_normal((*q.shape[:3], dims[1])).astype(np.float16)
    options = {"causal": True, "window_size": (40, 0), "softcap": 8.0}
    tq, tk, tv = (torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v))
    out = numbaflash.flash_attention(tq, tk, tv, **options)
    out.backward(torch.from_numpy(dout).cuda())
    ratio, problems = compare_with_reference(q, k, v, out.detach().cpu().numpy(), **options)
    assert not problems, problems
    grads = tuple(x.grad.cpu().numpy() for x in (tq, tk, tv))
    ratio, problems = compare_gradients_with_reference(q, k, v, dout, grads, **options)
    assert not problems, problems


def test_torch_packed_call():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    lengths = [17, 0, 64, 5]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), h, 80)).astype(np.float16) for h in (4, 2, 2))
    out, lse = numbaflash.flash_attention_varlen(*(torch.from_numpy(x).cuda() for x in (q, k, v)),
                                                 torch.from_numpy(cu).cuda(), torch.from_numpy(cu).cuda(),
                                                 max(lengths), max(lengths), causal=True, return_lse=True)
    ratio, problems = compare_varlen_with_reference(q, k, v, cu, cu, out.cpu().numpy(), lse.cpu().numpy(),
                                                    causal=True)
    assert not problems, problems
