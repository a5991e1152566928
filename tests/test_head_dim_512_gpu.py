"""Head dim 512 (issue 56 item 3) on the GPU against the float64 reference, FlashAttention's
criterion: the forward and backward of q, k, v at 512, which run as one call of the pair
(512, 256) per half of V (``operations.head_dims``), on numpy arrays and torch tensors (autograd),
dense and packed, with a window, a softcap and a learnable sink; and the other GPUs' configs of the
pair (``configs.ASYMMETRIC_FALLBACKS``: A100's 160 KB, and 88 KB for 99 KB a CTA) forced on this
GPU. The pair itself runs in ``test_asymmetric_gpu`` (``ASYMMETRIC_HEAD_DIMS``).

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_head_dim_512_gpu.py
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.tools.reference import (
    compare_gradients_with_reference,
    compare_varlen_gradients_with_reference,
    compare_varlen_with_reference,
    compare_with_reference,
)
from tests.test_sink_gpu import DTYPES

pytestmark = pytest.mark.gpu
D = 512
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): ragged, seqlen_q above seqlen_k (causal: rows that
# see no key) and below it, one query row, GQA and MQA.
SHAPES = [(2, 200, 200, 4, 2), (1, 333, 129, 4, 1), (1, 129, 517, 2, 2), (2, 1, 300, 4, 1)]


def random_qkv(rng, batch, sq, sk, hq, hkv, dtype, amplitude=1.0):
    q = (rng.standard_normal((batch, sq, hq, D)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, D)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, D)).astype(dtype)
    return q, k, v


def to_torch(x):
    import torch

    dtype = torch.bfloat16 if x.dtype != np.float16 else torch.float16
    return torch.from_numpy(np.ascontiguousarray(x).view(np.uint16)).view(dtype).cuda()


def to_host(t, dtype):
    import torch

    return t.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16).view(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("causal", "window", "softcap"), [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                           (False, (64, 7), 0.0), (True, (-1, -1), 30.0)])
def test_forward_and_backward_on_numpy(rng, causal, window, softcap, dtype):
    options = {"causal": causal, "window_size": window, "softcap": softcap}
    amplitude = 10.0 if softcap else 1.0
    for shape in SHAPES:
        q, k, v = random_qkv(rng, *shape, DTYPES[dtype], amplitude)
        out, lse = numbaflash.flash_attention(q, k, v, return_lse=True, **options)
        assert out.shape == q.shape and lse.shape == (shape[0], shape[3], shape[1])
        _, problems = compare_with_reference(q, k, v, out, lse, **options)
        assert not problems, f"forward {shape}: " + "; ".join(problems)
        dout = rng.standard_normal(q.shape).astype(DTYPES[dtype])
        grads = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, **options)
        _, problems = compare_gradients_with_reference(q, k, v, dout, grads, **options)
        assert not problems, f"backward {shape}: " + "; ".join(problems)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sink", [False, True])
def test_autograd_on_torch_tensors(rng, dtype, sink):
    """q, k, v (and a sink) that require grad: two custom-op calls a step, their gradients
    composed by autograd, against float64; a given out (poisoned) without autograd."""
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(rng, 2, 300, 400, 4, 2, DTYPES[dtype])
    dout = rng.standard_normal(q.shape).astype(DTYPES[dtype])
    logits = np.array([8.0, -np.inf, -4.0, 1.0], np.float32) if sink else None
    tq, tk, tv = (to_torch(x).requires_grad_() for x in (q, k, v))
    extra = {}
    if sink:
        extra["learnable_sink"] = torch.from_numpy(logits).cuda().requires_grad_()
    out = numbaflash.flash_attention(tq, tk, tv, causal=True, **extra)
    assert out.shape == q.shape and out.grad_fn is not None
    out.backward(to_torch(dout))
    grads = [to_host(x.grad, DTYPES[dtype]) for x in (tq, tk, tv)]
    if sink:
        grads.append(extra["learnable_sink"].grad.cpu().numpy())
    _, problems = compare_with_reference(q, k, v, to_host(out, DTYPES[dtype]), causal=True, sink=logits)
    assert not problems, "forward: " + "; ".join(problems)
    _, problems = compare_gradients_with_reference(q, k, v, dout, grads, causal=True, sink=logits)
    assert not problems, "backward: " + "; ".join(problems)
    with torch.no_grad():
        given = torch.full_like(tq, float("nan"))
        assert numbaflash.flash_attention(tq, tk, tv, causal=True, out=given, **extra) is given
    assert torch.equal(given, out.detach())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_and_backward(rng, causal, dtype):
    """Three packed sequences (one with no query, one query row with no key, a ragged one)."""
    lengths_q, lengths_k = (0, 1, 300), (5, 0, 217)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    dt = DTYPES[dtype]
    q = rng.standard_normal((int(cu_q[-1]), 4, D)).astype(dt)
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, D)).astype(dt) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dt)
    out, lse = numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, 300, 217, causal=causal,
                                                 return_lse=True)
    _, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, lse, causal=causal)
    assert not problems, "forward: " + "; ".join(problems)
    grads = numbaflash.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 300, 217,
                                                       causal=causal)
    _, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, grads, causal=causal)
    assert not problems, "backward: " + "; ".join(problems)


@pytest.mark.parametrize("fallback", [0, 1], ids=["a100", "99kb"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_the_other_gpus_configs_of_the_pair(rng, causal, dtype, fallback):
    """(512, 256)'s configs for GPUs where the default's 224 KB do not fit, forced here: what an A100
    (64 x 64, 160 KB) and sm_86, sm_89 and sm_120 (64 x 16, 88 KB) run."""
    from numba import cuda

    capability = tuple(cuda.get_current_device().compute_capability)
    config = configs.ASYMMETRIC_FALLBACKS[(512, 256)][fallback]
    limit = configs.max_shared_bytes((8, 0) if fallback == 0 else (8, 6))
    assert config == configs.forward_config((8, 0) if fallback == 0 else (8, 6), 512, causal, head_dim_v=256)
    assert config.shared_bytes <= limit
    with contextlib.ExitStack() as stack:
        for flag in (False, True):
            stack.enter_context(configs.force_config(capability, flag, config))
        for shape in SHAPES:
            q, k, v = random_qkv(rng, *shape, DTYPES[dtype])
            out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
            _, problems = compare_with_reference(q, k, v, out, lse, causal=causal)
            assert not problems, f"{shape}: " + "; ".join(problems)
