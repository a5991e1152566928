"""The backward with a learnable sink (issue 56) on the GPU against the float64 reference
(``compare_gradients_with_reference(..., sink=)``: FlashAttention's criterion for each of dq, dk,
dv and d_sink, and dq exactly 0 on rows that see no key).

The forward with the sink gives out and the sink-inclusive LSE; the backward with the same sink
gives (dq, dk, dv, d_sink). Calls go through the dispatcher (on Hopper at head dims 64 and 128 the
warp-specialised backward, whose prepare kernel is the mma.sync one) and with the mma.sync
family's config forced (``test_sink_backward_on_the_mma_sync_family``).

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_sink_backward_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from test_backward_gpu import DTYPES, device, problem
from test_sink_gpu import SHAPES, random_sink

import numbaflash
from numbaflash import configs
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import (
    attention_backward_reference,
    compare_gradients_with_reference,
    compare_varlen_gradients_with_reference,
    visible_keys,
)

pytestmark = pytest.mark.gpu


def run_sink_backward(q, k, v, dout, sink, deterministic=False, **options):
    """The forward with the sink (out, LSE), then the backward with it: (dq, dk, dv, d_sink) on
    the host."""
    from numba import cuda

    args = [device(x) for x in (q, k, v)]
    sink_d = cuda.to_device(sink)
    out, lse = numbaflash.flash_attention(*args, return_lse=True, learnable_sink=sink_d, **options)
    grads = numbaflash.flash_attention_backward(device(dout), *args, out, lse, learnable_sink=sink_d,
                                                deterministic=deterministic, **options)
    assert len(grads) == 4
    return tuple(g.copy_to_host() for g in grads)


def check(q, k, v, dout, sink, **options):
    grads = run_sink_backward(q, k, v, dout, sink, **options)
    _, problems = compare_gradients_with_reference(q, k, v, dout, grads, sink=sink, **options)
    assert not problems, f"{q.shape} {k.shape} {options}: " + "; ".join(problems)
    assert grads[3].dtype == np.float32 and grads[3].shape == (q.shape[2],)
    return grads


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_sink_backward_matches_reference(rng, causal, dtype, head_dim):
    for shape in SHAPES:
        q, k, v, dout = problem(rng, *shape, head_dim, DTYPES[dtype])
        check(q, k, v, dout, random_sink(rng, shape[3]), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_sink_backward_of_a_long_query_sequence(rng, causal):
    """A query sequence of ``configs.BACKWARD_LONG_SEQLEN`` rows or more (on Hopper at d128 the
    long-sequence config: its prepare kernel's sink build over 80-row query blocks), GQA 4:1, a
    ragged last block; few keys keep the float64 reference cheap."""
    sq = configs.BACKWARD_LONG_SEQLEN + 53
    q, k, v, dout = problem(rng, 1, sq, 333, 4, 1, 128, DTYPES["bfloat16"])
    check(q, k, v, dout, random_sink(rng, 4), causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_sink_backward_on_the_mma_sync_family(rng, causal, dtype, head_dim):
    """The mma.sync backward (its prepare kernel's sink build) with its config forced on Hopper,
    where the warp-specialised backward runs unforced at head dims 64 and 128."""
    from numbaflash.runtime import device as gpu_device

    capability, _ = gpu_device.GPU.current()
    if capability[0] != 9:
        pytest.skip("the GPU's own backward is the mma.sync one (test_sink_backward_matches_reference)")
    config = configs.backward_config((8, 0), head_dim, causal)
    with configs.force_config(capability, causal, config):
        for shape in SHAPES[:3]:
            q, k, v, dout = problem(rng, *shape, head_dim, DTYPES[dtype])
            check(q, k, v, dout, random_sink(rng, shape[3]), causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(("window", "softcap"), [((127, 0), 0.0), ((3, 50), 0.0), ((-1, -1), 30.0),
                                                 ((16, 0), 50.0)])
def test_sink_backward_with_window_and_softcap(rng, window, softcap, head_dim, dtype):
    amplitude = 10.0 if softcap else 1.0
    for shape in ((2, 333, 517, 4, 2), (1, 517, 129, 4, 4)):
        q, k, v, dout = problem(rng, *shape, head_dim, DTYPES[dtype], amplitude=amplitude)
        check(q, k, v, dout, random_sink(rng, 4), window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_rows_that_see_no_key_give_zero_dq_and_nothing_to_d_sink(rng, head_dim, dtype):
    """seqlen_q > seqlen_k, causal: the first rows see no key (O = 0, so D = 0): dq exactly 0
    there, and d_sink equal to the reference's (which drops them)."""
    q, k, v, dout = problem(rng, 2, 700, 300, 4, 2, head_dim, DTYPES[dtype])
    sink = random_sink(rng, 4)
    dq, *_ = check(q, k, v, dout, sink, causal=True)
    empty = ~visible_keys(700, 300, True).any(axis=1)
    assert empty.any() and (dq[:, empty].astype(np.float32) == 0).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_a_sink_of_minus_inf_gives_the_plain_gradients_and_zero(rng, causal, dtype):
    """Every logit -inf: the forward is the plain one bit for bit (test_sink_gpu), so dq, dk, dv are
    the plain backward's bit for bit (deterministic mode), and d_sink is exactly 0."""
    q, k, v, dout = problem(rng, 2, 333, 517, 4, 2, 128, DTYPES[dtype])
    no_sink = np.full(4, -np.inf, np.float32)
    dq, dk, dv, d_sink = run_sink_backward(q, k, v, dout, no_sink, True, causal=causal)
    args = [device(x) for x in (q, k, v)]
    out, lse = numbaflash.flash_attention(*args, causal=causal, return_lse=True)
    plain = numbaflash.flash_attention_backward(device(dout), *args, out, lse, causal=causal,
                                                deterministic=True)
    for got, ref in zip((dq, dk, dv), plain, strict=True):
        np.testing.assert_array_equal(got.view(np.uint16), ref.copy_to_host().view(np.uint16))
    assert (d_sink == 0).all()


def test_deterministic_sink_backward_repeats_dq_dk_dv(rng):
    """Deterministic mode: dq, dk, dv bit-identical from run to run (d_sink is summed with float32
    atomics: equal to the reference's, not necessarily bit for bit)."""
    q, k, v, dout = problem(rng, 2, 600, 600, 8, 2, 64, np.float16)
    sink = random_sink(rng, 8)
    first = run_sink_backward(q, k, v, dout, sink, True, causal=True)
    for _ in range(2):
        again = run_sink_backward(q, k, v, dout, sink, True, causal=True)
        for a, b in zip(first[:3], again[:3], strict=True):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
        np.testing.assert_allclose(first[3], again[3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sink_backward(rng, causal, bf16, head_dim):
    """Packed sequences, with an empty one and one whose keys are empty: dq, dk, dv sequence by
    sequence and d_sink (summed over the sequences) against float64."""
    from numba import cuda

    dtype = DTYPES["bfloat16" if bf16 else "float16"]
    lengths_q, lengths_k = (1, 77, 0, 130, 5, 300), (1, 64, 3, 200, 0, 129)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), 4, head_dim)).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), 2, head_dim)).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), 2, head_dim)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    sink = random_sink(rng, 4)
    args = [device(x) for x in (q, k, v)]
    cq, ck, sd = cuda.to_device(cu_q), cuda.to_device(cu_k), cuda.to_device(sink)
    out, lse = numbaflash.flash_attention_varlen(*args, cq, ck, max(lengths_q), max(lengths_k), causal=causal,
                                                 return_lse=True, learnable_sink=sd)
    grads = numbaflash.flash_attention_varlen_backward(device(dout), *args, out, lse, cq, ck, max(lengths_q),
                                                       max(lengths_k), causal=causal, learnable_sink=sd)
    assert len(grads) == 4
    ratio, problems = compare_varlen_gradients_with_reference(
        q, k, v, dout, cu_q, cu_k, tuple(g.copy_to_host() for g in grads), causal=causal, sink=sink)
    assert not problems, (ratio, problems)


def test_torch_autograd_with_a_sink():
    """torch CUDA tensors under autograd: q, k, v and the sink requiring grad; the sink's .grad
    is d_sink (float32 (heads_q,)); every gradient meets the criterion."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    rng = np.random.default_rng(7)
    q, k, v, dout = problem(rng, 2, 257, 200, 8, 2, 128, np.float16)
    sink = random_sink(rng, 8)
    leaves = [torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v, sink)]
    out = numbaflash.flash_attention(*leaves[:3], causal=True, learnable_sink=leaves[3])
    out.backward(torch.from_numpy(dout).cuda())
    grads = tuple(x.grad.cpu().numpy() for x in leaves)
    assert grads[3].dtype == np.float32 and grads[3].shape == (8,)
    _, problems = compare_gradients_with_reference(q, k, v, dout, grads, causal=True, sink=sink)
    assert not problems, problems
    only_sink = torch.from_numpy(sink).cuda().requires_grad_()
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    numbaflash.flash_attention(tq, tk, tv, causal=True, learnable_sink=only_sink).backward(
        torch.from_numpy(dout).cuda())
    ref = attention_backward_reference(q, k, v, dout, causal=True, sink=sink)[3]
    np.testing.assert_allclose(only_sink.grad.cpu().numpy(), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
