"""Forward attention on the GPU against the float64 numpy reference.

Criterion (FlashAttention's): the max error of numbaflash is at most twice the max error
of the same computation done in the input dtype (numpy, rounding scores, probabilities
and output to that dtype), plus a rounding floor; LSE within 1e-3 relative; no NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash.configs import CANDIDATES
from numbaflash.reference import attention_reference

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def random_qkv(rng, batch, sq, sk, hq, hkv, d, dtype, amplitude=1.0):
    q = (rng.standard_normal((batch, sq, hq, d)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, d)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    return q, k, v


def check_attention(q, k, v, causal, out, lse=None, softmax_scale=None):
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    low, _ = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, rounding_dtype=q.dtype)
    got = np.asarray(out).astype(np.float64)
    assert not np.isnan(got).any(), "NaN in output"
    err = np.abs(got - ref).max()
    err_low = np.abs(low - ref).max()
    floor = 2.0 ** -(11 if q.dtype == np.float16 else 8) * max(1.0, np.abs(ref).max()) / 4
    assert err <= 2 * err_low + floor, f"max error {err:.3e} > 2 x {err_low:.3e} + {floor:.1e}"
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        assert lse.shape == ref_lse.shape
        finite = np.isfinite(ref_lse)
        assert (np.isneginf(lse) == ~finite).all(), "LSE -inf must mark exactly the rows that see no key"
        rel = np.abs(lse[finite] - ref_lse[finite]) / np.maximum(np.abs(ref_lse[finite]), 1.0)
        assert rel.max(initial=0) <= 1e-3, f"LSE relative error {rel.max():.2e}"


CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv
    (2, 1, 1, 2, 2),
    (1, 17, 17, 3, 3),
    (2, 127, 127, 2, 1),
    (1, 129, 129, 16, 2),  # GQA 8:1
    (1, 1000, 1000, 2, 2),
    (1, 4097, 4097, 1, 1),
    (2, 100, 300, 4, 1),  # MQA, seqlen_q < seqlen_k
    (2, 300, 100, 2, 2),  # seqlen_q > seqlen_k: causal rows with no key
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_q{}_k{}_h{}-{}".format(*c))
def test_forward_matches_reference(rng, case, causal, head_dim, dtype):
    batch, sq, sk, hq, hkv = case
    q, k, v = random_qkv(rng, batch, sq, sk, hq, hkv, head_dim, DTYPES[dtype])
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_attention(q, k, v, causal, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_large_scores(rng, causal, head_dim, dtype):
    """Inputs scaled by 30: peaked softmax, large exponent range."""
    q, k, v = random_qkv(rng, 2, 333, 517, 4, 2, head_dim, DTYPES[dtype], amplitude=30.0)
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(q, k, v, causal, out, lse)


@pytest.mark.gpu
def test_softmax_scale_and_out(rng):
    q, k, v = random_qkv(rng, 1, 70, 90, 2, 2, 64, np.float16)
    out = np.full(q.shape, np.nan, np.float16)
    res = numbaflash.flash_attention(q, k, v, softmax_scale=0.3, out=out)
    assert res is out
    check_attention(q, k, v, False, out, softmax_scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic(rng, causal):
    q, k, v = random_qkv(rng, 2, 513, 700, 4, 2, 128, np.float16)
    a, la = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    b, lb = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert a.view(np.uint16).tobytes() == b.view(np.uint16).tobytes()
    assert la.tobytes() == lb.tobytes()


@pytest.mark.gpu
def test_numba_device_arrays_zero_copy(rng):
    from numba import cuda

    q, k, v = random_qkv(rng, 2, 200, 150, 4, 4, 128, np.float16)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dout = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    res, lse = numbaflash.flash_attention(dq, dk, dv, causal=True, out=dout, return_lse=True)
    assert res is dout
    check_attention(q, k, v, True, dout.copy_to_host(), lse.copy_to_host())


class _WithStream:
    """A CUDA array interface that names a stream (as CuPy's does): 1 = legacy default."""

    def __init__(self, array, stream: int) -> None:
        self.array, self.stream = array, stream

    @property
    def __cuda_array_interface__(self):
        return {**self.array.__cuda_array_interface__, "stream": self.stream}


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["legacy-default", "own-stream"])
def test_array_interface_stream(rng, which):
    from numba import cuda

    q, k, v = random_qkv(rng, 1, 130, 140, 2, 2, 64, np.float16)
    stream = cuda.stream()
    handle = 1 if which == "legacy-default" else int(stream.handle)
    dq, dk, dv = (_WithStream(cuda.to_device(x), handle) for x in (q, k, v))
    dout = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    numbaflash.flash_attention(dq, dk, dv, out=_WithStream(dout, handle))
    stream.synchronize()
    cuda.synchronize()
    check_attention(q, k, v, False, dout.copy_to_host(), None)


@pytest.mark.gpu
def test_strided_device_inputs(rng):
    """q, k, v as views into one packed (batch, seqlen, 3, heads, head_dim) buffer."""
    from numba import cuda

    qkv = rng.standard_normal((2, 190, 3, 4, 64)).astype(np.float16)
    d = cuda.to_device(qkv)
    out = numbaflash.flash_attention(d[:, :, 0], d[:, :, 1], d[:, :, 2])
    check_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], False, out.copy_to_host())


@pytest.mark.gpu
def test_misaligned_strided_input_rejected(rng):
    from numba import cuda

    x = cuda.to_device(rng.standard_normal((1, 8, 2, 72)).astype(np.float16))
    view = x[:, :, :, 4:68]  # head_dim 64, rows start 8 bytes in
    with pytest.raises(ValueError, match="16-byte"):
        numbaflash.flash_attention(view, view, view)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_tensors(rng, dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=tdtype)
    k = torch.randn(2, 260, 2, 128, device="cuda", dtype=tdtype)
    v = torch.randn(2, 260, 2, 128, device="cuda", dtype=tdtype)
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.shape == q.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
    kt = kt.repeat_interleave(4, dim=1)
    vt = vt.repeat_interleave(4, dim=1)
    mask = torch.ones(300, 260, dtype=torch.bool, device="cuda").tril(260 - 300)
    ref = sdpa(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    ref = torch.nan_to_num(ref)  # rows with no key: SDPA gives NaN, we give 0
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    assert (out.float() - ref).abs().max().item() < tol * 4
    assert not torch.isnan(out).any()




TUNABLE = sorted({(key[1], cfg) for key, cands in CANDIDATES.items() for cfg in cands}, key=str)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, cfg", TUNABLE, ids=str)
def test_every_tunable_config(rng, monkeypatch, head_dim, cfg):
    """Each configuration the autotuner may pick is correct on ragged, causal, GQA shapes,
    in both dtypes."""
    from numba import cuda

    from numbaflash import configs

    family = configs.arch_family(cuda.get_current_device().compute_capability)
    if cfg not in CANDIDATES[(family, head_dim)]:
        pytest.skip(f"{cfg} is not a candidate on {family}")
    for causal, dtype in ((False, np.float16), (True, ml_dtypes.bfloat16)):
        monkeypatch.setitem(configs.OVERRIDES, configs.table_key(family, head_dim, causal), cfg)
        q, k, v = random_qkv(rng, 2, 211, 333, 4, 2, head_dim, dtype)
        out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
        check_attention(q, k, v, causal, out, lse)
