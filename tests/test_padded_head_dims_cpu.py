"""Head dims with no kernel (``numbaflash.operations.head_dims``): the API runs them on the next larger
kernel with zero padding. No GPU: the kernel entries are replaced by float64 stand-ins that
accept only the head dims a kernel exists for, so these tests check the padding's glue (scale,
shapes, slices, given outputs, autograd through the padding) against float64 on the true dims."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numbaflash
from numbaflash import api
from numbaflash.configs import ASYMMETRIC_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from numbaflash.operations import head_dims
from numbaflash.tools.reference import attention_backward_reference, attention_reference, visible_keys


@pytest.mark.parametrize(("dims", "padded"), [
    ((80, 80), 96), ((40, 40), 64), ((72, 72), 96), ((160, 160), 256), ((192, 192), 256), ((8, 8), 32),
    ((1, 1), 32), ((96, 64), 96), ((192, 64), 256), ((24, 200), 256),
    ((256, 256), None), ((128, 128), None), ((192, 128), None), ((32, 32), None),  # kernels exist
    ((257, 257), None), ((0, 0), None), ((300, 64), None),  # no kernel can: the usual checks raise
])
def test_padded_head_dim(dims, padded):
    assert head_dims.padded_head_dim(*dims) == padded
    if padded is not None:
        assert padded in SUPPORTED_HEAD_DIMS and padded >= max(dims)
    elif 1 <= min(dims) and max(dims) <= 256:
        assert dims[0] == dims[1] and dims[0] in SUPPORTED_HEAD_DIMS or dims in ASYMMETRIC_HEAD_DIMS


def _native(*arrays):
    d_qk, d_v = arrays[0].shape[-1], arrays[2].shape[-1]
    assert (d_qk == d_v and d_qk in SUPPORTED_HEAD_DIMS) or (d_qk, d_v) in ASYMMETRIC_HEAD_DIMS, (d_qk, d_v)


def _forward_stub(calls):
    def direct(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap, sink=None):
        _native(q, k, v)
        assert out is None
        calls.append(q.shape[-1])
        o, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     window_size=window_size, softcap=softcap)
        o = o.astype(q.dtype)
        return (o, lse.astype(np.float32)) if return_lse else o

    return direct


def _backward_from_stored(dout, q, k, v, out, lse, causal, scale):
    """FlashAttention's backward in float64 from the forward's stored out and LSE (no GQA):
    P = exp(S - lse), D = rowsum(dout * out), so zero-padded dout and out must leave D alone."""
    qf, kf, vf, of, gf = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, out, dout))
    s = qf @ kf.transpose(0, 1, 3, 2) * scale
    seen = visible_keys(q.shape[1], k.shape[1], causal)
    p = np.where(seen, np.exp(s - np.asarray(lse, np.float64)[..., None]), 0.0)
    d = (gf * of).sum(-1, keepdims=True)
    ds = p * (gf @ vf.transpose(0, 1, 3, 2) - d)
    grads = (ds @ kf * scale, ds.transpose(0, 1, 3, 2) @ qf * scale, p.transpose(0, 1, 3, 2) @ gf)
    return tuple(np.ascontiguousarray(g.transpose(0, 2, 1, 3)).astype(q.dtype) for g in grads)


def _returned_into_given(dout, q, k, v, out, lse):
    """The causal backward with dq, dk and dv given: the very arrays come back (filled)."""
    given = [np.empty_like(x) for x in (q, k, v)]
    returned = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=True, dq=given[0],
                                                   dk=given[1], dv=given[2])
    assert all(a is b for a, b in zip(returned, given, strict=True))
    return given


def _stub_kernels(monkeypatch, record):
    """The forward's and backward's entries replaced by float64 stand-ins on supported dims only;
    the backward's calls recorded as ``record(q, k, v)`` says (the scale: given, else 1/sqrt(d_qk))."""
    calls: list = []
    monkeypatch.setattr(api, "direct_flash_attention", _forward_stub(calls))

    def backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv, window_size,
                 softcap, sink):
        _native(q, k, v)
        assert dout.shape == out.shape and out.shape[-1] == v.shape[-1] and dq is None
        assert all(x.flags.c_contiguous for x in (dout, v, out))
        calls.append(record(q, k, v))
        scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
        return _backward_from_stored(dout, q, k, v, out, lse, causal, scale)

    monkeypatch.setattr(api, "direct_flash_attention_backward", backward)
    return calls


@pytest.fixture
def stubs(monkeypatch):
    return _stub_kernels(monkeypatch, lambda q, k, v: q.shape[-1])


def _inputs(d_qk, d_v, seqlen_q=5, seqlen_k=7, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((2, seqlen_q, 3, d_qk), (2, seqlen_k, 3, d_qk), (2, seqlen_k, 3, d_v))
    return tuple(rng.standard_normal(s).astype(np.float16) for s in shapes)


@pytest.mark.parametrize(("d_qk", "d_v", "causal"), [(80, 80, True), (40, 40, False), (72, 48, True),
                                                    (160, 160, False)])
def test_forward_runs_padded_at_the_true_head_dims_scale(stubs, d_qk, d_v, causal):
    q, k, v = _inputs(d_qk, d_v)
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=np.True_)  # numpy's bool too
    assert stubs == [head_dims.padded_head_dim(d_qk, d_v)]
    ref, ref_lse = attention_reference(q, k, v, causal=causal)  # scale 1/sqrt(d_qk)
    assert out.shape == (2, 5, 3, d_v) and out.dtype == np.float16 and out.flags.c_contiguous
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    # the padded kernel's own default scale (1/sqrt(D)) would be wrong: the test can tell
    wrong, _ = attention_reference(q, k, v, causal=causal, softmax_scale=1 / math.sqrt(stubs[0]))
    assert np.abs(wrong - ref).max() > 1e-2


def test_forward_options_and_out_reach_the_padded_call(stubs):
    q, k, v = _inputs(80, 80, seqlen_q=6, seqlen_k=6)
    given = np.full((2, 6, 3, 80), np.nan, np.float16)
    got = numbaflash.flash_attention(q, k, v, softmax_scale=0.3, window_size=(2, 1), softcap=4.0, out=given)
    assert got is given
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3, window_size=(2, 1), softcap=4.0)
    np.testing.assert_allclose(given.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="out must have shape"):
        numbaflash.flash_attention(q, k, v, out=np.zeros((2, 6, 3, 96), np.float16))


@pytest.mark.parametrize(("d_qk", "d_v"), [(80, 80), (72, 48)])
def test_backward_runs_padded(stubs, d_qk, d_v):
    q, k, v = _inputs(d_qk, d_v, seqlen_q=6, seqlen_k=6, seed=1)
    dout = np.random.default_rng(2).standard_normal((2, 6, 3, d_v)).astype(np.float16)
    out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    ref = attention_backward_reference(q, k, v, dout, causal=True)
    for got, want, d in zip((dq, dk, dv), ref, (d_qk, d_qk, d_v), strict=True):
        assert got.shape[-1] == d and got.flags.c_contiguous
        np.testing.assert_allclose(got.astype(np.float64), want, atol=2e-2, rtol=2e-2)
    given = _returned_into_given(dout, q, k, v, out, lse)
    np.testing.assert_array_equal(given[0], dq)
    with pytest.raises(ValueError, match="dout must have v's head dim"):
        numbaflash.flash_attention_backward(dout[..., :-8], q, k, v, out, lse, causal=True)


def _varlen_stub(calls, monkeypatch, dim=0):
    """The packed forward's entry replaced by a float64 stand-in that takes supported dims only and
    records each call's head dim (``dim``: 0 q's, 2 v's)."""
    from numbaflash.operations import varlen
    from numbaflash.tools.reference import varlen_attention_reference

    def direct(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size, softcap, return_lse,
               out, sink=None):
        _native(q, k, v)
        calls.append((q, k, v)[dim].shape[-1])
        o, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale)
        return (o.astype(q.dtype), lse) if return_lse else o.astype(q.dtype)

    monkeypatch.setattr(varlen, "direct_flash_attention_varlen", direct)


def test_varlen_runs_padded(monkeypatch):
    from numbaflash.tools.reference import varlen_attention_reference

    calls = []
    _varlen_stub(calls, monkeypatch)
    rng = np.random.default_rng(3)
    cu = np.array([0, 3, 8], np.int32)
    q, k, v = (rng.standard_normal((8, 2, 80)).astype(np.float16) for _ in range(3))
    out = numbaflash.flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
    assert calls == [96] and out.shape == (8, 2, 80)
    ref, _ = varlen_attention_reference(q, k, v, cu, cu, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)


def test_inputs_the_padding_cannot_help_get_the_usual_errors():
    q, k, v = _inputs(80, 80)
    with pytest.raises(ValueError, match="q and k must have the same head_dim"):  # nothing is padded
        numbaflash.flash_attention(q, k[..., :72], v)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        numbaflash.flash_attention(*_inputs(264, 264))

    class DeviceArray:  # any other device array: the caller pads
        def __init__(self, shape):
            self.shape = shape
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f2", "data": (0, False),
                                             "version": 3}

    with pytest.raises(ValueError, match="pad these device arrays to head dim 96"):
        numbaflash.flash_attention(*(DeviceArray(x.shape) for x in (q, k, v)))

    class Unknown:  # no array numbaflash takes: its TypeError, not the padding's advice
        shape = (2, 5, 3, 80)

    with pytest.raises(TypeError):
        numbaflash.flash_attention(Unknown(), Unknown(), Unknown())


def test_kvcache_names_the_padded_calls():
    q, k, v = _inputs(80, 80)
    with pytest.raises(ValueError, match="flash_attention_varlen and their backwards pad"):
        numbaflash.flash_attention_with_kvcache(q[:, :1], k, v, np.array([7, 7], np.int32))


def _torch_attend(q, k, v, causal, softmax_scale, return_lse):
    """Attention in torch (GQA, causal; the default scale 1/sqrt(q's head dim)), differentiable."""
    import torch

    group = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(group, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * (softmax_scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        seen = torch.from_numpy(visible_keys(q.shape[1], k.shape[1], True))
        s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    return (o, lse) if return_lse else o


def _torch_route_stub(calls, monkeypatch, dim=0):
    """The API's torch route replaced by ``_torch_attend`` on supported dims only, recording each
    call's head dim (``dim``: 0 q's, 2 v's)."""

    def route(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap, sink=None):
        _native(q, k, v)
        calls.append((q, k, v)[dim].shape[-1])
        return _torch_attend(q, k, v, causal, softmax_scale, return_lse)

    monkeypatch.setattr(api, "_TORCH_ROUTE", [route])


def test_torch_autograd_flows_through_the_padding(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    _torch_route_stub(calls, monkeypatch)
    attend = _torch_attend
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 4, 80, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 7, 2, 80, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(2))
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert calls == [96] and out.shape == (1, 5, 4, 80)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    direct = attend(q, k, v, True, 1 / math.sqrt(80), False)  # the same attention, unpadded
    torch.testing.assert_close(out, direct)
    for got, want in zip(grads, torch.autograd.grad(direct.square().sum(), (q, k, v)), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        numbaflash.flash_attention(q, k, v, out=torch.empty(1, 5, 4, 80, dtype=torch.float64))
