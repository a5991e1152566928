"""V's head dim apart from Q's and K's (issue 56 item 2: DeepSeek-V3's (192, 128)) in
``flash_attention``'s forward, on the GPU against the float64 reference (``compare_with_reference``:
FlashAttention's criterion; rows that see no key exactly 0).

Device arrays, outputs poisoned with NaN so that an element the kernel never writes fails. The pair
runs the mma.sync family's kernel on every GPU (``configs.ASYMMETRIC_DEFAULTS``) and its own on
Hopper (``configs.ASYMMETRIC_WS_DEFAULTS``): the dense and variant tests run each family's config
the GPU has, forced (``family``).

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_asymmetric_gpu.py
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.configs import ASYMMETRIC_HEAD_DIMS
from numbaflash.tools.reference import compare_with_reference
from tests.test_sink_gpu import DTYPES, SHAPES  # the same ragged, masked and GQA shapes, both dtypes

pytestmark = pytest.mark.gpu
# (family, pair): the mma.sync family's config of every pair, the Hopper kernel's where it has one
FAMILY_PAIRS = [("sm80", p) for p in ASYMMETRIC_HEAD_DIMS] + [
    ("sm90", p) for p in ASYMMETRIC_HEAD_DIMS if p in configs.ASYMMETRIC_WS_DEFAULTS]
PAIR_IDS = [f"{f}-d{p[0]}v{p[1]}" for f, p in FAMILY_PAIRS]


def random_qkv(rng, batch, sq, sk, hq, hkv, dims, dtype, amplitude=1.0):
    d, dv = dims
    q = (rng.standard_normal((batch, sq, hq, d)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, d)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, dv)).astype(dtype)
    return q, k, v


def run(q, k, v, sink=None, **options):
    """One device call with a NaN-poisoned out of v's head dim: (out, lse) on the host."""
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer

    dq, dk, dv = (DeviceBuffer(x) for x in (q, k, v))
    dout = DeviceBuffer(np.full((*q.shape[:3], v.shape[3]), np.nan, q.dtype))
    extra = {} if sink is None else {"learnable_sink": cuda.to_device(sink)}
    result, lse = numbaflash.flash_attention(dq, dk, dv, out=dout, return_lse=True, **options, **extra)
    assert result is dout
    return dout.copy_to_host(), lse.copy_to_host()


def check(q, k, v, sink=None, family="sm80", **options):
    """The call on ``family``'s config of the pair (forced for both causal flags: a window kernel
    takes either), against float64."""
    from numba import cuda

    from numbaflash.tools.selftest import pair_config

    capability = tuple(cuda.get_current_device().compute_capability)
    if family == "sm90" and capability[0] != 9:
        pytest.skip("the Hopper kernel of the pair needs an H100 or H200")
    config = pair_config(family, (q.shape[3], v.shape[3]))
    with contextlib.ExitStack() as stack:
        for causal in (False, True):
            stack.enter_context(configs.force_config(capability, causal, config))
        out, lse = run(q, k, v, sink, **options)
    _, problems = compare_with_reference(q, k, v, out, lse, sink=sink, **options)
    assert not problems, f"{q.shape} {v.shape} {options}: " + "; ".join(problems)


@pytest.mark.parametrize(("family", "dims"), FAMILY_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_asymmetric_forward_matches_reference(rng, causal, dtype, dims, family):
    for shape in SHAPES:
        check(*random_qkv(rng, *shape, dims, DTYPES[dtype]), family=family, causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("window", "softcap", "sink"), [((127, 0), 0.0, False), ((3, 50), 0.0, True),
                                                         ((-1, -1), 30.0, False), ((16, 0), 50.0, True)])
@pytest.mark.parametrize(("family", "dims"), FAMILY_PAIRS, ids=PAIR_IDS)
def test_asymmetric_forward_with_window_softcap_and_sink(rng, window, softcap, sink, dtype, dims, family):
    """The variants are the kernel's own builds: V's width does not touch them."""
    amplitude = 10.0 if softcap else 1.0
    for shape in ((2, 333, 517, 4, 2), (1, 517, 129, 4, 4)):
        q, k, v = random_qkv(rng, *shape, dims, DTYPES[dtype], amplitude=amplitude)
        logits = (rng.standard_normal(shape[3]) * 2).astype(np.float32) if sink else None
        check(q, k, v, logits, family, window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_asymmetric_forward_on_torch_tensors(rng, dtype):
    """Torch CUDA tensors that need no autograd: the direct path, then its cached plan (the second
    call); out has v's head dim; a strided q (a slice of its heads) too."""
    torch = pytest.importorskip("torch")
    d, dv = ASYMMETRIC_HEAD_DIMS[0]
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 300, 8, d, device="cuda", dtype=tdtype)[:, :, :4]
    k = torch.randn(2, 400, 2, d, device="cuda", dtype=tdtype)
    v = torch.randn(2, 400, 2, dv, device="cuda", dtype=tdtype)
    for _ in range(2):
        out = numbaflash.flash_attention(q, k, v, causal=True)
        assert out.shape == (2, 300, 4, dv) and out.dtype == tdtype
        host = [x.float().cpu().numpy().astype(DTYPES[dtype]) for x in (q, k, v)]
        ratio, problems = compare_with_reference(*host, out.float().cpu().numpy(), causal=True)
        assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_asymmetric_forward_on_numpy_arrays(rng, causal, dtype):
    """The chunked host pipeline, v and out at v's head dim: a result array, then a given out
    (poisoned), and a strided q (a slice of its heads)."""
    dims = ASYMMETRIC_HEAD_DIMS[0]
    for shape in ((2, 333, 517, 4, 2), (1, 1000, 129, 4, 1)):
        q, k, v = random_qkv(rng, *shape, dims, DTYPES[dtype])
        out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
        _, problems = compare_with_reference(q, k, v, out, lse, causal=causal)
        assert not problems, "; ".join(problems)
        given = np.full((*q.shape[:3], v.shape[3]), np.nan, q.dtype)
        assert numbaflash.flash_attention(q, k, v, causal=causal, out=given) is given
        _, problems = compare_with_reference(q, k, v, given, causal=causal)
        assert not problems, "; ".join(problems)
    wide = np.concatenate([q, q], axis=2)[:, :, ::2]
    _, problems = compare_with_reference(wide, k, v, numbaflash.flash_attention(wide, k, v), causal=False)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dims", ASYMMETRIC_HEAD_DIMS, ids=lambda p: f"d{p[0]}v{p[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("causal", "window", "softcap"), [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                           (False, (40, 7), 0.0), (True, (-1, -1), 30.0)])
def test_asymmetric_backward_matches_reference(rng, causal, window, softcap, dtype, dims):
    """dq, dk (Q's and K's head dim) and dv (V's) against float64 by FlashAttention's criterion,
    from the forward's out and LSE: device arrays (gradients poisoned with NaN, given as outputs)
    and numpy inputs (the LSE float32 in device memory)."""
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_gradients_with_reference

    amplitude = 10.0 if softcap else 1.0
    options = {"causal": causal, "window_size": window, "softcap": softcap}
    for shape in ((2, 200, 200, 4, 2), (1, 333, 129, 4, 1), (1, 129, 517, 4, 4)):
        q, k, v = random_qkv(rng, *shape, dims, DTYPES[dtype], amplitude=amplitude)
        dout = rng.standard_normal((*q.shape[:3], v.shape[3])).astype(DTYPES[dtype])
        out, lse = numbaflash.flash_attention(q, k, v, return_lse=True, **options)
        grads = numbaflash.flash_attention_backward(dout, q, k, v, out, lse, **options)
        _, problems = compare_gradients_with_reference(q, k, v, dout, grads, **options)
        assert not problems, f"numpy {shape}: " + "; ".join(problems)
        device = [DeviceBuffer(x) for x in (dout, q, k, v, out)]
        given = [DeviceBuffer(np.full(x.shape, np.nan, x.dtype)) for x in (q, k, v)]
        found = numbaflash.flash_attention_backward(*device, cuda.to_device(lse), dq=given[0], dk=given[1],
                                                    dv=given[2], **options)
        assert all(a is b for a, b in zip(found, given, strict=True))
        _, problems = compare_gradients_with_reference(q, k, v, dout, [g.copy_to_host() for g in given],
                                                       **options)
        assert not problems, f"device {shape}: " + "; ".join(problems)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_asymmetric_autograd_on_torch_tensors(rng, dtype):
    """q, k, v that require grad: the custom ops' forward and backward, the gradients held to
    FlashAttention's criterion against float64."""
    torch = pytest.importorskip("torch")
    from numbaflash.tools.reference import compare_gradients_with_reference

    d, dv = ASYMMETRIC_HEAD_DIMS[0]
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=tdtype, requires_grad=True)
    k = torch.randn(2, 400, 2, d, device="cuda", dtype=tdtype, requires_grad=True)
    v = torch.randn(2, 400, 2, dv, device="cuda", dtype=tdtype, requires_grad=True)
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert out.shape == (2, 300, 4, dv) and out.grad_fn is not None
    dout = torch.randn_like(out)
    out.backward(dout)
    host = [x.detach().float().cpu().numpy().astype(DTYPES[dtype]) for x in (q, k, v, dout)]
    grads = [x.grad.float().cpu().numpy() for x in (q, k, v)]
    _, problems = compare_gradients_with_reference(*host, grads, causal=True)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("shape", "causal"), [((1, 1000, 600, 4, 2), True), ((1, 3000, 300, 2, 2), True),
                                               ((1, 300, 3000, 2, 1), False), ((2, 97, 193, 3, 3), True)],
                         ids=["gqa", "long-q", "long-k", "ragged"])
def test_the_hopper_backward_of_the_pair(rng, shape, causal, dtype):
    """The pair's Hopper backward (``configs.ASYMMETRIC_BACKWARD_WS``: what dense calls on an H100 or
    H200 run) on long walks (GQA groups, many query blocks), key blocks no query sees (causal, seqlen_q
    far from seqlen_k: their dK and dV must be written as 0) and ragged blocks, in both modes: against
    float64, gradients poisoned with NaN, and deterministic mode bit for bit twice."""
    from numba import cuda

    from numbaflash.kernels.shapes import WsBackwardConfig
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_gradients_with_reference

    capability = tuple(cuda.get_current_device().compute_capability)
    if capability[0] != 9:
        pytest.skip("the pair's Hopper backward needs an H100 or H200")
    assert isinstance(configs.backward_config(capability, 192, causal, head_dim_v=128), WsBackwardConfig)
    q, k, v = random_qkv(rng, *shape, (192, 128), DTYPES[dtype])
    dout = rng.standard_normal((*q.shape[:3], 128)).astype(DTYPES[dtype])
    device = [DeviceBuffer(x) for x in (q, k, v)]
    out, lse = numbaflash.flash_attention(*device, causal=causal, return_lse=True)
    runs = []
    for deterministic in (False, True, True):
        grads = [DeviceBuffer(np.full(x.shape, np.nan, x.dtype)) for x in (q, k, v)]
        numbaflash.flash_attention_backward(DeviceBuffer(dout), *device, out, lse, causal=causal,
                                            deterministic=deterministic, dq=grads[0], dk=grads[1],
                                            dv=grads[2])
        runs.append([g.copy_to_host() for g in grads])
        _, problems = compare_gradients_with_reference(q, k, v, dout, tuple(runs[-1]), causal=causal)
        assert not problems, f"deterministic={deterministic}: " + "; ".join(problems)
    for a, b in zip(runs[1], runs[2], strict=True):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), "deterministic runs differ"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_asymmetric_varlen_forward_and_backward(rng, causal, dtype):
    """The packed calls with the pair: three sequences (one with no query, one query row with no
    key, a ragged one), numpy and device arrays, out and the gradients against float64."""
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import (
        compare_varlen_gradients_with_reference,
        compare_varlen_with_reference,
    )

    d, dv = ASYMMETRIC_HEAD_DIMS[0]
    lengths_q, lengths_k = (0, 1, 300), (5, 0, 217)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    dt = DTYPES[dtype]
    q = rng.standard_normal((int(cu_q[-1]), 4, d)).astype(dt)
    k = rng.standard_normal((int(cu_k[-1]), 2, d)).astype(dt)
    v = rng.standard_normal((int(cu_k[-1]), 2, dv)).astype(dt)
    dout = rng.standard_normal((int(cu_q[-1]), 4, dv)).astype(dt)
    for device in (False, True):
        wrap = DeviceBuffer if device else (lambda x: x)
        offsets = [cuda.to_device(x) if device else x for x in (cu_q, cu_k)]  # int32: not 16-bit buffers
        args = [wrap(x) for x in (q, k, v)] + offsets
        out, lse = numbaflash.flash_attention_varlen(*args, 300, 217, causal=causal, return_lse=True)
        host_out, host_lse = (x.copy_to_host() if device else x for x in (out, lse))
        _, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, host_out, host_lse, causal=causal)
        assert not problems, f"forward device={device}: " + "; ".join(problems)
        grads = numbaflash.flash_attention_varlen_backward(wrap(dout), *args[:3], out, lse, *args[3:], 300,
                                                           217, causal=causal)
        host = tuple(g.copy_to_host() if device else g for g in grads)
        _, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, host, causal=causal)
        assert not problems, f"backward device={device}: " + "; ".join(problems)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_asymmetric_decode_matches_reference(rng, dtype, paged, splits):
    """flash_attention_with_kvcache with k_cache at 192 columns and v_cache at 128: sequences of
    no key, one key and a full cache, new rows appended (the caches checked bit for bit against
    ``kvcache_reference``), GQA 4, seqlen_q 2, causal; out (poisoned) at 128."""
    torch = pytest.importorskip("torch")
    from numbaflash.tools.reference import kvcache_reference

    d, dv = ASYMMETRIC_HEAD_DIMS[0]
    tdtype = getattr(torch, dtype)
    batch, heads_kv, group, seqlen_q, new, page = 3, 2, 4, 2, 2, 64
    capacity = 320
    lens = np.array([0, 1, capacity - new], np.int32)
    table = None
    if paged:
        per_seq = capacity // page
        order = rng.permutation(batch * per_seq + 3)[:batch * per_seq]  # some pages no sequence owns
        table = order.reshape(batch, per_seq).astype(np.int32)
        lead = (batch * per_seq + 3, page)
    else:
        lead = (batch, capacity)
    host = [rng.standard_normal(shape).astype(DTYPES[dtype]) for shape in (
        (batch, seqlen_q, heads_kv * group, d), (*lead, heads_kv, d), (*lead, heads_kv, dv),
        (batch, new, heads_kv, d), (batch, new, heads_kv, dv))]
    q, kc, vc, kn, vn = (torch.from_numpy(x.view(np.uint16)).view(tdtype).cuda() for x in host)
    out = torch.full((batch, seqlen_q, heads_kv * group, dv), float("nan"), dtype=tdtype, device="cuda")
    result, lse = numbaflash.flash_attention_with_kvcache(
        q, kc, vc, torch.from_numpy(lens).cuda(), k_new=kn, v_new=vn,
        block_table=None if table is None else torch.from_numpy(table).cuda(), causal=True, num_splits=splits,
        return_lse=True, out=out)
    torch.cuda.synchronize()
    assert result is out
    want_out, want_lse, want_k, want_v = kvcache_reference(*host[:3], lens, k_new=host[3], v_new=host[4],
                                                           block_table=table, causal=True)

    def to_host(x):
        return x.view(torch.int16).cpu().numpy().view(np.uint16).view(DTYPES[dtype]).astype(np.float64)

    assert np.array_equal(to_host(kc), want_k.astype(np.float64))
    assert np.array_equal(to_host(vc), want_v.astype(np.float64))
    got = to_host(out)
    assert np.isfinite(got).all() and got.shape == want_out.shape
    for b in range(batch):  # each sequence against float64 on its own keys, by FlashAttention's criterion
        places = [(b, r) if table is None else (int(table[b, r // page]), r % page)
                  for r in range(int(lens[b]) + new)]
        k_seq = np.stack([want_k[p] for p in places])[None]
        v_seq = np.stack([want_v[p] for p in places])[None]
        _, problems = compare_with_reference(host[0][b:b + 1], k_seq, v_seq, got[b:b + 1],
                                             lse[b:b + 1].cpu().numpy(), causal=True)
        assert not problems, f"batch {b}: " + "; ".join(problems)
    assert want_lse.shape == tuple(lse.shape)
