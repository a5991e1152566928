"""Sliding window and softcap (issue 35) on the GPU against the float64 reference, with the
forward GPU tests' criterion (``compare_with_reference``: FlashAttention's, error at most twice
that of the same computation in the input dtype; rows that see no key exactly 0, LSE -inf).

Every call goes through the dispatcher unforced: a window or a softcap runs the GPU's own kernel
family with the config the table gives it (on Hopper the TMA kernel at head dims 64, 96, 128 and
256, the mma.sync kernel at 32; the sanitizer runs each family's variants on every config). Outputs are
poisoned with NaN (``out=``), so an element the kernel never writes fails. Inputs are fresh random
draws per test (``rng``: seeded by the test id).

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_window_softcap_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import compare_with_reference, visible_keys

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
pytestmark = pytest.mark.gpu

# Window sizes 0, 1, 127, 4096, asymmetric ones and one side unbounded.
WINDOWS = [(0, 0), (1, 1), (1, 0), (0, 1), (127, 127), (127, 0), (4096, 4096), (4096, 0), (3, 50), (50, 3),
           (-1, 7), (20, -1), (300, 40)]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): equal, seqlen_q above and below seqlen_k, ragged
# (multiples of no tile), length 1, GQA and MQA.
SHAPES = [(2, 200, 200, 4, 2), (1, 333, 129, 2, 1), (1, 129, 517, 4, 4), (2, 1, 300, 2, 1), (1, 300, 1, 2, 2),
          (1, 1000, 1000, 2, 1)]


def random_qkv(rng, batch, sq, sk, hq, hkv, d, dtype, amplitude=1.0):
    q = (rng.standard_normal((batch, sq, hq, d)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, d)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    return q, k, v


def run_and_check(q, k, v, causal, window_size=(-1, -1), softcap=0.0, softmax_scale=None):
    """One call on numpy arrays with a NaN-poisoned ``out``, checked against float64."""
    out = np.full(q.shape, np.nan, q.dtype)
    result, lse = numbaflash.flash_attention(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                             softmax_scale=softmax_scale, return_lse=True, out=out)
    assert result is out
    _, problems = compare_with_reference(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                         window_size=window_size, softcap=softcap)
    assert not problems, f"window={window_size} softcap={softcap} causal={causal}: " + "; ".join(problems)
    return out, lse


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_window_matches_reference(rng, causal, dtype, head_dim):
    """Every window on two of the shapes (they rotate, so each shape meets about four windows;
    all of them 78 float64 references a test took minutes)."""
    inputs = [random_qkv(rng, *shape, head_dim, DTYPES[dtype]) for shape in SHAPES]
    for i, window in enumerate(WINDOWS):
        for j in (i % len(SHAPES), (i + 3) % len(SHAPES)):
            run_and_check(*inputs[j], causal, window)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_matches_reference_at_large_scores(rng, causal, dtype, head_dim):
    """Softcap 30 and 50 on inputs scaled by 10-30, where the cap bites (scaled scores far past
    it), alone and with a window; in float16 the scale shrinks above head dim 128 as in
    ``test_forward_gpu.test_forward_large_scores`` (the float16 baseline would overflow)."""
    amplitude = 30.0 if dtype == "bfloat16" or head_dim <= 128 else 30.0 * (128 / head_dim) ** 0.5
    windows = ((-1, -1), (127, 0), (3, 50))
    for i, shape in enumerate([(2, 333, 517, 4, 2), (1, 200, 200, 2, 1), (1, 517, 129, 2, 2)]):
        for amp in (amplitude, 10.0):
            q, k, v = random_qkv(rng, *shape, head_dim, DTYPES[dtype], amplitude=amp)
            for n, softcap in enumerate((30.0, 50.0)):  # each window with each cap and amplitude
                run_and_check(q, k, v, causal, windows[(i + n) % 3], softcap)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_softcap_with_other_scales(rng, dtype, head_dim):
    q, k, v = random_qkv(rng, 1, 300, 400, 4, 2, head_dim, DTYPES[dtype], amplitude=5.0)
    for scale in (0.02, 0.3, 1.0):
        for softcap in (2.0, 30.0):
            run_and_check(q, k, v, False, (-1, -1), softcap, softmax_scale=scale)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(("sq", "sk", "window"), [(700, 300, (0, 0)), (700, 300, (50, 10)),
                                                  (1000, 200, (5, 2)), (3000, 1500, (4096, 0))])
def test_rows_that_see_no_key(rng, sq, sk, window, head_dim, dtype):
    """seqlen_q > seqlen_k: the first rows' windows end before key 0. They give exactly 0 and
    LSE -inf, on the device path too (poisoned, three calls: a race need not show at once)."""
    from numbaflash.runtime.buffers import DeviceBuffer

    q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, head_dim, DTYPES[dtype])
    empty = ~visible_keys(sq, sk, False, window).any(axis=1)
    assert empty.any()
    run_and_check(q, k, v, False, window)
    dq, dk, dv = (DeviceBuffer(x) for x in (q, k, v))
    dout = DeviceBuffer(np.full(q.shape, np.nan, q.dtype))
    for _ in range(3):
        _, lse = numbaflash.flash_attention(dq, dk, dv, window_size=window, out=dout, return_lse=True)
        out, lse = dout.copy_to_host(), lse.copy_to_host()
        assert (out[:, empty].astype(np.float32) == 0).all(), "rows with no key are not 0"
        assert np.isneginf(lse[:, :, empty]).all()
    _, problems = compare_with_reference(q, k, v, out, lse, window_size=window)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_long_sequence_sliding_window(rng, dtype):
    """A 4096-key window over 8192 tokens (the long-sequence config's span), causal as
    FlashAttention's (4096, -1) with causal=True, and the same as (4096, 0)."""
    q, k, v = random_qkv(rng, 1, 8192, 8192, 2, 1, 128, DTYPES[dtype])
    a, _ = run_and_check(q, k, v, True, (4096, -1))
    b = numbaflash.flash_attention(q, k, v, window_size=(4096, 0))
    assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_plain_and_variant_calls_of_one_layout(rng, dtype):
    """Calls of one layout with and without a window or a softcap keep their own plans: each
    result is its own computation's, in any order."""
    q, k, v = random_qkv(rng, 2, 257, 391, 4, 2, 64, DTYPES[dtype], amplitude=4.0)
    for window, softcap in [((-1, -1), 0.0), ((10, 0), 0.0), ((-1, -1), 30.0), ((10, 0), 30.0),
                            ((-1, -1), 0.0), ((10, 0), 0.0)]:
        for causal in (False, True):
            run_and_check(q, k, v, causal, window, softcap)


def test_torch_window_and_softcap(rng):
    """torch CUDA tensors: zero copy without grad (the direct path and, under a dispatch mode,
    the op); with grad the backward runs (its accuracy: tests/test_backward_window_gpu.py)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    q, k, v = random_qkv(rng, 2, 300, 500, 4, 2, 128, np.float16, amplitude=8.0)
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    for _ in range(2):  # the second call: the plan's hot path
        out, lse = numbaflash.flash_attention(tq, tk, tv, window_size=(64, 8), softcap=30.0,
                                              return_lse=True)
        _, problems = compare_with_reference(q, k, v, out.cpu().numpy(), lse.cpu().numpy(),
                                             window_size=(64, 8), softcap=30.0)
        assert not problems, "; ".join(problems)
    out, lse = torch.ops.numbaflash.flash_attention_forward(tq, tk, tv, True, 0.125, 64, -1, 50.0)
    _, problems = compare_with_reference(q, k, v, out.cpu().numpy(), lse.cpu().numpy(), causal=True,
                                         softmax_scale=0.125, window_size=(64, -1), softcap=50.0)
    assert not problems, "; ".join(problems)
    tq.requires_grad_()
    numbaflash.flash_attention(tq, tk, tv, window_size=(64, 0)).float().sum().backward()
    assert tq.grad is not None and bool(torch.isfinite(tq.grad).all())
