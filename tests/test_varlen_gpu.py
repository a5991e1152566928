"""The packed variable-length forward on the GPU: every sequence of a varlen call equals a dense
``flash_attention`` call on that sequence alone, bit for bit when the dense call runs the same
config (forced), and matches float64 (``compare_with_reference``).

    OMP_NUM_THREADS=2 NUMBAFLASH_REQUIRE_GPU=1 pytest -n 8 -m gpu tests/test_varlen_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.operations.varlen import varlen_kernel
from numbaflash.runtime import device as gpu_state
from numbaflash.tools.reference import compare_with_reference

pytestmark = pytest.mark.gpu

LENGTHS = [((1, 77, 0, 130, 5), (1, 64, 3, 200, 0)), ((129, 1, 33), (129, 300, 1))]


def _dtype(bf16: bool):
    if bf16:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return ml_dtypes.bfloat16
    return np.float16


def _packed(lengths_q, lengths_k, heads, d, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = (scale * rng.standard_normal((int(cu_q[-1]), heads[0], d))).astype(dtype)
    k = (scale * rng.standard_normal((int(cu_k[-1]), heads[1], d))).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), heads[1], d)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _check(lengths_q, lengths_k, heads, d, bf16, causal, window_size=(-1, -1), softcap=0.0, scale=1.0):
    dtype = _dtype(bf16)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, d, dtype, scale=scale)
    options = {"causal": causal, "window_size": window_size, "softcap": softcap}
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse = numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                                 **options)
    assert out.shape == q.shape and lse.shape == (heads[0], q.shape[0])
    capability, device = gpu_state.GPU.current()
    _, (_, config, _) = varlen_kernel(capability, device, d, bf16, causal, window_size, softcap,
                                      q.shape[-1] ** -0.5, max_q, max_k)
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: zeros and -inf
            assert (np.asarray(out[q0:q1], np.float32) == 0).all() and np.isneginf(lse[:, q0:q1]).all()
            continue
        args = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        ratio, problems = compare_with_reference(*args, out[None, q0:q1], lse[None, :, q0:q1], **options)
        assert not problems, (b, ratio, problems)
        kernel_causal = causal and window_size == (-1, -1)
        with configs.force_config(capability, kernel_causal, config):
            dense, dense_lse = numbaflash.flash_attention(*args, return_lse=True, **options)
        bits = np.asarray(out[q0:q1]).view(np.uint16)
        np.testing.assert_array_equal(bits, np.asarray(dense[0]).view(np.uint16))
        np.testing.assert_array_equal(lse[:, q0:q1], dense_lse[0])


@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_and_float64(d, bf16, causal):
    _check(*LENGTHS[0], (4, 2), d, bf16, causal)


@pytest.mark.parametrize(("window_size", "softcap"), [((0, 0), 0.0), ((127, 1), 0.0), ((-1, -1), 30.0),
                                                       ((16, 0), 50.0)])
def test_window_softcap(window_size, softcap):
    _check(*LENGTHS[1], (2, 1), 128, False, False, window_size, softcap, scale=3.0 if softcap else 1.0)


def test_torch_and_poisoned_out():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = (torch.from_numpy(x).cuda() for x in _packed(*LENGTHS[0], (4, 4), 64, np.float16))
    out = torch.full_like(q, float("nan"))
    result = numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, 130, 200, causal=True, out=out)
    assert result.data_ptr() == out.data_ptr()
    lengths_k = np.diff(cu_k.cpu().numpy())
    cu = cu_q.cpu().numpy()
    for b, n_k in enumerate(lengths_k):  # every row of a sequence with keys is written, and finite
        rows = out[int(cu[b]):int(cu[b + 1])]
        assert torch.isfinite(rows).all() and (n_k > 0 or (rows == 0).all())
    compiled = torch.compile(lambda *a: numbaflash.flash_attention_varlen(*a, 130, 200, causal=True),
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k), out, rtol=0, atol=0)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_past_the_last_sequence_stay_untouched(d, causal):
    """Device offsets that end before the packed length (not read on the host, so not checked):
    the rows past the last sequence are nobody's, and no tile writes them, though the Hopper
    kernel's tiles load them (its stores stop at each sequence's end)."""
    torch = pytest.importorskip("torch")
    lengths = (130, 5, 77)
    q, k, v, cu_q, cu_k = (torch.from_numpy(x).cuda()
                           for x in _packed(lengths, lengths, (4, 2), d, np.float16))
    pad = 200  # rows past the last sequence, in every tensor
    q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], device="cuda", dtype=x.dtype)])
               for x in (q, k, v))
    out = torch.full_like(q, float("nan"))
    numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, 130, 130, causal=causal, out=out)
    total = int(cu_q[-1])
    assert torch.isnan(out[total:]).all(), "rows past the last sequence were written"
    assert torch.isfinite(out[:total]).all()
    reference, _ = (numbaflash.flash_attention_varlen(q[:total], k[:total], v[:total], cu_q, cu_k, 130, 130,
                                                      causal=causal, return_lse=True))
    torch.testing.assert_close(out[:total], reference, rtol=0, atol=0)
