"""The packed variable-length backward on the GPU: each sequence's gradients match float64 by
FlashAttention's rule (``compare_varlen_gradients_with_reference``) and, in deterministic mode,
equal bit for bit a dense ``flash_attention_backward`` of that sequence alone with the same
config (tiles never straddle sequences, so they line up); lengths 0, 1 and ragged, seqlen_q !=
seqlen_k, causal and not, GQA, every head dim, fp16 and bf16; windows and softcap; autograd and
torch.compile through the varlen torch op.

    OMP_NUM_THREADS=2 NUMBAFLASH_REQUIRE_GPU=1 pytest -n 8 -m gpu tests/test_varlen_backward_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from test_varlen_gpu import _dtype, _packed

import numbaflash
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import compare_varlen_gradients_with_reference

pytestmark = pytest.mark.gpu

# (lengths_q, lengths_k): an empty sequence, one of one row, ragged, seqlen_q != seqlen_k, a
# sequence with queries and no keys, one with keys and no queries.
LENGTHS = [((1, 77, 0, 130, 5, 0), (1, 64, 3, 200, 0, 9)), ((129, 1, 33), (129, 300, 1))]


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    out, lse = numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                                 **options)
    return np.array(out), np.array(lse)


def _case(lengths_q, lengths_k, heads, d, bf16, seed=0, scale=1.0, **options):
    dtype = _dtype(bf16)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, d, dtype, seed=seed, scale=scale)
    dout = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(dtype)
    max_q, max_k = max(max(lengths_q), 1), max(max(lengths_k), 1)
    out, lse = _forward(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    return q, k, v, dout, out, lse, cu_q, cu_k, max_q, max_k


def _backward(case, deterministic=False, **options):
    q, k, v, dout, out, lse, cu_q, cu_k, max_q, max_k = case
    grads = numbaflash.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                       deterministic=deterministic, **options)
    return tuple(np.array(g) for g in grads)


def _check_float64(case, grads, **options):
    q, k, v, dout, _, _, cu_q, cu_k, _, _ = case
    ratio, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, grads, **options)
    assert not problems, problems


def _check_dense_bit_equal(case, grads, **options):
    """Each sequence's gradients against a deterministic dense backward of that sequence alone."""
    q, k, v, dout, out, lse, cu_q, cu_k, _, _ = case
    dq, dk, dv = grads
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0 or k1 == k0:  # nothing pairs: zero gradients
            assert (dq[q0:q1].astype(np.float32) == 0).all()
            assert (dk[k0:k1].astype(np.float32) == 0).all() and (dv[k0:k1].astype(np.float32) == 0).all()
            continue
        dense = numbaflash.flash_attention_backward(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            np.ascontiguousarray(lse[None, :, q0:q1]), deterministic=True, **options)
        for name, got, want in zip(("dq", "dk", "dv"), (dq[q0:q1], dk[k0:k1], dv[k0:k1]), dense, strict=True):
            assert np.array_equal(got.view(np.uint16), np.asarray(want)[0].view(np.uint16)), (
                f"sequence {b}: {name} differs from the dense backward")


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_head_dim_against_float64_and_dense_bit_for_bit(head_dim, causal):
    bf16 = (head_dim // 32 + causal) % 2 == 1  # both dtypes over the grid of cases
    lengths_q, lengths_k = LENGTHS[0] if causal else LENGTHS[1]
    case = _case(lengths_q, lengths_k, (4, 2), head_dim, bf16, causal=causal)
    grads = _backward(case, deterministic=True, causal=causal)
    _check_float64(case, grads, causal=causal)
    _check_dense_bit_equal(case, grads, causal=causal)


@pytest.mark.parametrize("bf16", [False, True])
def test_mqa_not_deterministic_against_float64(bf16):
    case = _case(*LENGTHS[0], (6, 1), 64, bf16, seed=3, causal=True)
    _check_float64(case, _backward(case, causal=True), causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_twice_bit_identical(causal):
    case = _case((300, 17, 0, 256), (256, 400, 5, 1), (4, 2), 128, False, seed=5, causal=causal)
    first = _backward(case, deterministic=True, causal=causal)
    second = _backward(case, deterministic=True, causal=causal)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize(("window_size", "softcap", "causal"), [
    ((33, 7), 0.0, False), ((0, 0), 0.0, False), ((1, -1), 30.0, False), ((-1, -1), 50.0, True),
    ((127, 0), 30.0, False),
])
def test_window_and_softcap_against_float64(window_size, softcap, causal):
    options = {"causal": causal, "window_size": window_size, "softcap": softcap}
    case = _case(*LENGTHS[0], (2, 1), 64, False, seed=7, scale=3.0 if softcap else 1.0, **options)
    _check_float64(case, _backward(case, **options), **options)


def test_device_arrays_and_given_outputs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    case = _case(*LENGTHS[1], (2, 2), 64, False, seed=9, causal=True)
    want = _backward(case, deterministic=True, causal=True)
    q, k, v, dout, out, lse, cu_q, cu_k, max_q, max_k = (torch.from_numpy(np.ascontiguousarray(x)).cuda()
                                                         if isinstance(x, np.ndarray) else x for x in case)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    got = numbaflash.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                     causal=True, deterministic=True, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a.cpu().numpy().view(np.uint16), b.view(np.uint16))


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    return torch


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_torch_autograd_against_float64(torch_cuda, dtype_name):
    torch = torch_cuda
    dtype = getattr(torch, dtype_name)
    lengths_q, lengths_k = LENGTHS[0]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((sum(lengths_q), 4, 64), generator=gen, device="cuda").to(dtype).requires_grad_(True)
    k = torch.randn((sum(lengths_k), 2, 64), generator=gen, device="cuda").to(dtype).requires_grad_(True)
    v = torch.randn((sum(lengths_k), 2, 64), generator=gen, device="cuda").to(dtype).requires_grad_(True)
    out = numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    out.backward(dout)

    def host(x):
        return x.detach().float().cpu().numpy().astype(_dtype(dtype_name == "bfloat16"))

    ratio, problems = compare_varlen_gradients_with_reference(
        host(q), host(k), host(v), host(dout), cu_q.cpu().numpy(), cu_k.cpu().numpy(),
        (host(q.grad), host(k.grad), host(v.grad)), causal=True)
    assert not problems, problems


def test_torch_compile_fullgraph_training_step(torch_cuda):
    torch = torch_cuda
    torch._dynamo.reset()
    lengths = (100, 0, 37, 260)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    torch.manual_seed(0)
    proj = torch.nn.Linear(128, 3 * 128, dtype=torch.bfloat16, device="cuda")
    x = torch.randn((total, 128), dtype=torch.bfloat16, device="cuda")
    target = torch.randn((total, 128), dtype=torch.bfloat16, device="cuda")

    def loss_of(x):
        q, k, v = proj(x).view(total, 3, 2, 64).unbind(1)
        out = numbaflash.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        return torch.nn.functional.mse_loss(out.reshape(total, 128).float(), target.float())

    explained = torch._dynamo.explain(loss_of)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(loss_of, fullgraph=True)
    optimizer = torch.optim.AdamW(proj.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = compiled(x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
