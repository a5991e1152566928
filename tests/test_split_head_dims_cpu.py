"""Head dim 512 (``numbaflash.operations.head_dims``): the API runs it as one call of the pair
(512, 256) per half of V. No GPU: the kernel entries are float64 stand-ins that accept only the
head dims a kernel exists for (``tests/test_padded_head_dims_cpu``), so these tests check the
split's glue (halves, the LSE, given outputs, the gradients' sums, a sink's gradient, autograd)
against float64 on the whole head dim."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numbaflash
from numbaflash import api
from numbaflash.operations import head_dims
from numbaflash.tools.reference import attention_backward_reference, attention_reference
from tests.test_padded_head_dims_cpu import (
    _backward_from_stored,
    _native,
    _returned_into_given,
    _stub_kernels,
    _torch_attend,
    _torch_route_stub,
    _varlen_stub,
)


@pytest.mark.parametrize(("dims", "part"), [((512, 512), 256), ((512, 256), None), ((256, 512), None),
                                            ((384, 384), None), ((1024, 1024), None), ((128, 128), None)])
def test_split_part(dims, part):
    assert head_dims.split_part(*dims) == part
    assert head_dims.runs(*dims) == (part is not None or head_dims.native(*dims))
    assert head_dims.padded_head_dim(*dims) is None  # never both


@pytest.fixture
def stubs(monkeypatch):
    return _stub_kernels(monkeypatch, lambda q, k, v: (q.shape[-1], v.shape[-1]))


def _inputs(seqlen_q=5, seqlen_k=7, seed=0, d=512):
    rng = np.random.default_rng(seed)
    shapes = ((2, seqlen_q, 3, d), (2, seqlen_k, 3, d), (2, seqlen_k, 3, d))
    return tuple((rng.standard_normal(s) * 0.5).astype(np.float16) for s in shapes)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_runs_each_half_of_v_and_joins_them(stubs, causal):
    q, k, v = _inputs(seqlen_q=9, seqlen_k=6)  # causal: rows that see no key
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert stubs == [512, 512]  # two calls of (512, 256)
    ref, ref_lse = attention_reference(q, k, v, causal=causal)  # scale 1/sqrt(512)
    assert out.shape == (2, 9, 3, 512) and out.dtype == np.float16 and out.flags.c_contiguous
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    given = np.full((2, 9, 3, 512), np.nan, np.float16)
    assert numbaflash.flash_attention(q, k, v, causal=causal, out=given) is given
    np.testing.assert_array_equal(given, out)


def test_forward_options_reach_both_calls(stubs):
    q, k, v = _inputs(seqlen_q=6, seqlen_k=6)
    out = numbaflash.flash_attention(q, k, v, softmax_scale=0.05, window_size=(2, 1), softcap=4.0)
    ref, _ = attention_reference(q, k, v, softmax_scale=0.05, window_size=(2, 1), softcap=4.0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="out must have shape"):
        numbaflash.flash_attention(q, k, v, out=np.zeros((2, 6, 3, 256), np.float16))


def test_backward_sums_dq_and_dk_and_joins_dv(stubs):
    q, k, v = _inputs(seqlen_q=6, seqlen_k=8, seed=1)
    dout = np.random.default_rng(2).standard_normal((2, 6, 3, 512)).astype(np.float16)
    out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
    del stubs[:]
    dq, dk, dv = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert stubs == [(512, 256), (512, 256)]
    ref = attention_backward_reference(q, k, v, dout, causal=True)
    for got, want in zip((dq, dk, dv), ref, strict=True):
        assert got.shape == want.shape and got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), want, atol=2e-2, rtol=2e-2)
    # one half's call alone is not the gradient: the sums matter
    half = _backward_from_stored(dout[..., :256], q, k, v[..., :256], out[..., :256], lse, True,
                                 1 / math.sqrt(512))
    assert np.abs(half[0].astype(np.float64) - ref[0]).max() > 1e-2
    given = _returned_into_given(dout, q, k, v, out, lse)
    np.testing.assert_array_equal(given[1], dk)
    with pytest.raises(ValueError, match="dout must have v's head dim 512"):
        numbaflash.flash_attention_backward(dout[..., :256], q, k, v, out, lse, causal=True)


def test_a_sinks_gradient_is_the_calls_sum(monkeypatch):
    """d_sink = -Σ p_sink · rowsum(dout ∘ out) is linear in the halves of dout and out."""
    calls = []

    def backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv, window_size,
                 softcap, sink):
        _native(q, k, v)
        calls.append(v.shape[-1])
        grads = _backward_from_stored(dout, q, k, v, out, lse, causal, softmax_scale or 1 / math.sqrt(512))
        p_sink = np.exp(np.asarray(sink, np.float64)[None, :, None] - np.asarray(lse, np.float64))
        rows = (dout.astype(np.float64) * out.astype(np.float64)).sum(-1).transpose(0, 2, 1)
        return (*grads, -(p_sink * rows).sum((0, 2)).astype(np.float32))

    monkeypatch.setattr(api, "direct_flash_attention_backward", backward)
    q, k, v = _inputs(seqlen_q=4, seqlen_k=4, seed=3)
    rng = np.random.default_rng(4)
    dout, out = (rng.standard_normal((2, 4, 3, 512)).astype(np.float16) for _ in range(2))
    lse = rng.standard_normal((2, 3, 4)).astype(np.float32) + 3
    sink = np.array([0.5, -1.0, 2.0], np.float32)
    *_, d_sink = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, learnable_sink=sink)
    assert calls == [256, 256]
    rows = (dout.astype(np.float64) * out.astype(np.float64)).sum(-1).transpose(0, 2, 1)
    want = -(np.exp(sink.astype(np.float64)[None, :, None] - lse) * rows).sum((0, 2))
    np.testing.assert_allclose(d_sink, want, rtol=1e-5)


def test_varlen_runs_split(monkeypatch):
    from numbaflash.tools.reference import varlen_attention_reference

    calls = []
    _varlen_stub(calls, monkeypatch, dim=2)
    rng = np.random.default_rng(5)
    cu = np.array([0, 3, 8], np.int32)
    q, k, v = ((rng.standard_normal((8, 2, 512)) * 0.5).astype(np.float16) for _ in range(3))
    out, lse = numbaflash.flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True, return_lse=True)
    assert calls == [256, 256] and out.shape == (8, 2, 512) and lse.shape == (2, 8)
    ref, _ = varlen_attention_reference(q, k, v, cu, cu, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)


def test_other_device_arrays_are_told_what_to_do():
    class DeviceArray:
        def __init__(self, shape):
            self.shape = shape
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f2", "data": (0, False),
                                             "version": 3}

    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"call it on v\[\.\.\., i:i \+ 256\] for each i"):
        numbaflash.flash_attention(*(DeviceArray(x.shape) for x in (q, k, v)))
    with pytest.raises(ValueError, match="the KV-cache call does neither"):  # no decode kernel of 512
        numbaflash.flash_attention_with_kvcache(q[:, :1], k, v, np.array([7, 7], np.int32))


def test_torch_autograd_composes_the_halves(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    _torch_route_stub(calls, monkeypatch, dim=2)
    attend = _torch_attend
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 512, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert calls == [256, 256] and out.shape == (1, 6, 2, 512)
    direct = attend(q, k, v, True, 1 / math.sqrt(512), False)
    torch.testing.assert_close(out, direct)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for g, want in zip(got, torch.autograd.grad((direct * weights).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, want)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        numbaflash.flash_attention(q, k, v, out=torch.empty(1, 6, 2, 512, dtype=torch.float64))


@pytest.mark.parametrize(("capability", "shape"), [
    ((9, 0), (128, 64)), ((10, 0), (128, 64)), ((8, 0), (64, 64)), ((8, 6), (64, 16)), ((8, 9), (64, 16)),
    ((12, 0), (64, 16))])
def test_each_gpu_gets_the_pairs_largest_forward_tile_that_fits(capability, shape):
    from numbaflash import configs

    for causal in (False, True):
        config = configs.forward_config(capability, 512, causal, head_dim_v=256)
        assert (config.block_m, config.block_n, config.value_dim) == (*shape, 256)
        assert config.shared_bytes <= configs.max_shared_bytes(capability)
        config.check()
