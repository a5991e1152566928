"""The numpy pipeline on a GPU: bit-identical to the device-array path on a matrix of shapes
(many chunks forced on small problems), non-contiguous inputs, ``out=``, LSE, a failure in the
middle of a call, and calls from several threads at once."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import numbaflash
from numbaflash.operations import forward
from numbaflash.runtime import host_memory as hm
from numbaflash.runtime import pipeline as pl


@pytest.fixture
def many_chunks(monkeypatch):
    """Cut even small problems into many chunks, so that every lane and stream is used."""
    monkeypatch.setattr(pl, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(pl, "TARGET_CHUNKS", 7)


def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def make(shape_q, shape_kv, dtype, seed):
    rng = np.random.default_rng(seed)
    np_dtype = np.float16
    if dtype == "bf16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        np_dtype = ml_dtypes.bfloat16
    q = rng.standard_normal(shape_q).astype(np_dtype)
    k = rng.standard_normal(shape_kv).astype(np_dtype)
    v = rng.standard_normal(shape_kv).astype(np_dtype)
    return q, k, v


def device_path(q, k, v, causal, return_lse, **options):
    """The same call on torch device tensors (zero copy), back to numpy bits (``options``: the
    window and softcap)."""
    torch = torch_cuda()
    tdtype = torch.float16 if q.dtype == np.float16 else torch.bfloat16
    dq, dk, dv = (torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(tdtype)
                  for x in (q, k, v))
    r = numbaflash.flash_attention(dq, dk, dv, causal=causal, return_lse=return_lse, **options)
    o, lse = r if return_lse else (r, None)
    bits = o.view(torch.int16).cpu().numpy().view(np.uint16)
    return bits, (lse.cpu().numpy() if return_lse else None)


@pytest.fixture(params=["copy", "pooled", "registered"])
def host_mode(request, monkeypatch):
    """How host arrays move: ``copy`` through the pinned slots both ways (no pool, nothing
    registered); ``pooled`` results in pool blocks; ``registered`` also inputs and ``out``
    registered in place (every size; a test calls twice, since the first use only copies)."""
    if request.param == "copy":
        monkeypatch.setattr(pl, "pinned_empty", lambda shape, dtype: np.empty(shape, dtype))
    monkeypatch.setattr(hm, "REGISTER_MIN_BYTES", 0 if request.param == "registered" else 1 << 62)
    yield request.param
    numbaflash.release_staging()


CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim), causal
    ((3, 200, 333, 6, 3, 64), True),
    ((1, 1000, 257, 8, 2, 128), False),
    ((2, 2000, 1000, 4, 4, 64), True),  # rows that see no key
    ((5, 77, 77, 2, 1, 128), True),  # MQA
    ((1, 1, 1, 1, 1, 64), False),
    ((8, 128, 512, 4, 4, 128), False),  # chunks of whole batches
    ((1, 1000, 257, 4, 1, 64), False),  # one pair: cut into query-row ranges
    ((1, 2000, 300, 2, 1, 128), True),  # row ranges, the first ones seeing no key at all
    ((2, 700, 1500, 6, 2, 64), True),  # row ranges with keys up to their diagonal
]


# Each case once, the dtype and the LSE taking the cases in turn (every pair of them occurs).
CASE_KINDS = [(case, ("f16", "bf16")[i % 2], i // 2 % 2 == 1) for i, case in enumerate(CASES)]


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "dtype", "return_lse"), CASE_KINDS, ids=str)
def test_numpy_path_is_bit_identical_to_device_path(many_chunks, host_mode, case, return_lse, dtype):
    (b, sq, sk, hq, hkv, d), causal = case
    q, k, v = make((b, sq, hq, d), (b, sk, hkv, d), dtype, seed=sq * 31 + sk)
    if host_mode == "registered":
        numbaflash.flash_attention(q, k, v, causal=causal, return_lse=return_lse)
    failures = hm.REGISTRATIONS.failures
    r = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=return_lse)
    if host_mode == "registered" and hm.REGISTRATIONS.failures == failures:
        assert {id(x) for x in (q, k, v)} <= set(hm.REGISTRATIONS.live)
    o, lse = r if return_lse else (r, None)
    ref_bits, ref_lse = device_path(q, k, v, causal, return_lse)
    assert o.dtype == q.dtype and o.shape == q.shape
    np.testing.assert_array_equal(o.view(np.uint16), ref_bits)
    if return_lse:
        np.testing.assert_array_equal(lse, ref_lse)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim), window_size, causal: row ranges under
# a window whose keys end past the diagonal (the chunk's kernel takes shifted sides), end at it,
# or do not end; the first is the selftest's case 281 of seed 4063807155 (761 rows see no key).
WINDOW_CASES = [
    ((1, 1104, 305, 32, 4, 256), (546, 38), False),
    ((1, 1000, 257, 4, 1, 64), (-1, 38), False),
    ((1, 1000, 257, 4, 1, 128), (300, -1), False),
    ((1, 2000, 300, 2, 1, 128), (200, 0), False),
    ((1, 700, 1500, 6, 2, 64), (64, 100), True),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "window_size", "causal"), WINDOW_CASES, ids=str)
def test_numpy_path_keeps_the_window_in_row_ranges(many_chunks, case, window_size, causal):
    """Cut into query-row ranges, the numpy path gives the device path's bits and passes the
    float64 criterion, rows that see no key 0."""
    from numbaflash.tools.reference import compare_with_reference

    (b, sq, sk, hq, hkv, d), dtype = case, "f16"
    q, k, v = make((b, sq, hq, d), (b, sk, hkv, d), dtype, seed=sq * 17 + sk)
    chunks = pl.plan_chunks(pl.Problem(b, sq, sk, hq, hkv, d, True))
    assert any(c.r1 - c.r0 < sq for c in chunks), "the case is cut into row ranges"
    out = np.full(q.shape, np.nan, q.dtype)
    o, lse = numbaflash.flash_attention(q, k, v, causal=causal, window_size=window_size, return_lse=True,
                                        out=out)
    ratio, problems = compare_with_reference(q, k, v, o, lse, causal=causal, window_size=window_size)
    assert not problems, problems
    ref_bits, ref_lse = device_path(q, k, v, causal, True, window_size=window_size)
    np.testing.assert_array_equal(o.view(np.uint16), ref_bits)
    np.testing.assert_array_equal(lse, ref_lse)


@pytest.mark.gpu
def test_pitched_views_registered_in_place(many_chunks, host_mode):
    """Head ranges and every-other-row views: copied in place by 2-D copies when registered."""
    big_q, big_k, big_v = make((3, 400, 10, 128), (3, 600, 6, 128), "f16", seed=11)
    q, k, v = big_q[:, ::2, 3:7], big_k[:, 1::2, 1:3], big_v[:, :300, 4:6]
    assert pl._pitched(q) and pl._pitched(k) and not q.flags.c_contiguous
    out_big = np.full((3, 200, 12, 128), np.nan, np.float16)
    out = out_big[:, :, 2:6]
    ref_bits, ref_lse = device_path(q, k, v, True, True)
    for _ in range(2):  # the second call finds the owners registered (in "registered" mode)
        out[...] = np.nan
        got, lse = numbaflash.flash_attention(q, k, v, causal=True, out=out, return_lse=True)
        assert got is out
        np.testing.assert_array_equal(out.view(np.uint16), ref_bits)
        np.testing.assert_array_equal(lse, ref_lse)
    assert np.isnan(out_big[:, :, :2]).all() and np.isnan(out_big[:, :, 6:]).all(), "wrote outside out"


@pytest.mark.gpu
def test_registrations_end_with_their_arrays_and_pool_blocks_are_reused(monkeypatch):
    monkeypatch.setattr(hm, "REGISTER_MIN_BYTES", 0)
    q, k, v = make((2, 1024, 8, 128), (2, 1024, 8, 128), "f16", seed=3)
    expected = numbaflash.flash_attention(q, k, v)  # holds one block while it lives
    assert_same_bits(numbaflash.flash_attention(q, k, v), expected)  # a second block, given back
    held = hm.POOL.held
    for _ in range(4):
        assert_same_bits(numbaflash.flash_attention(q, k, v), expected)
    assert hm.POOL.held == held, "each result's block came back and was reused"
    keys = {id(x) for x in (q, k, v)}
    assert keys <= set(hm.REGISTRATIONS.live)
    del q, k, v
    gc.collect()
    assert not keys & set(hm.REGISTRATIONS.live), "deallocating an array unregisters it"
    numbaflash.release_staging()
    assert not hm.REGISTRATIONS.live


@pytest.mark.gpu
def test_non_contiguous_inputs_and_out(many_chunks):
    q0, k0, v0 = make((2, 300, 8, 64), (2, 300, 8, 64), "f16", seed=5)
    q, k, v = q0[:, :, ::2], k0[:, :, 1::2], v0[::-1][:, :, ::2]  # strided, reversed views
    assert not q.flags.c_contiguous
    out = np.full(q.shape, np.nan, np.float16)
    got = numbaflash.flash_attention(q, k, v, causal=True, out=out)
    assert got is out
    ref_bits, _ = device_path(q, k, v, True, False)
    np.testing.assert_array_equal(out.view(np.uint16), ref_bits)
    # out aliasing q (in place) goes through a temporary and gives the same bits
    q_copy = np.array(q)
    numbaflash.flash_attention(q_copy, k, v, causal=True, out=q_copy)
    np.testing.assert_array_equal(q_copy.view(np.uint16), ref_bits)


def assert_same_bits(a, b):
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.gpu
def test_failure_midway_leaves_the_next_call_right(many_chunks, monkeypatch):
    q, k, v = make((4, 256, 4, 64), (4, 256, 4, 64), "f16", seed=9)
    expected = numbaflash.flash_attention(q, k, v)
    kernel = forward.forward_kernel
    calls = []

    def failing_kernel(*args, **kwargs):
        launcher, config, launch = kernel(*args, **kwargs)

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt  # as if the user pressed Ctrl-C during the call
            return launch(*args, **kwargs)

        return launcher, config, failing

    monkeypatch.setattr(forward, "forward_kernel", failing_kernel)
    with pytest.raises(KeyboardInterrupt):
        numbaflash.flash_attention(q, k, v)
    monkeypatch.setattr(forward, "forward_kernel", kernel)
    assert_same_bits(numbaflash.flash_attention(q, k, v), expected)
    numbaflash.release_staging()  # and after freeing the staging memory, calls allocate again
    assert_same_bits(numbaflash.flash_attention(q, k, v), expected)


@pytest.mark.gpu
def test_calls_from_several_threads(many_chunks):
    problems = [make((2, 100 + 37 * i, 4, 64), (2, 90 + 11 * i, 2, 64), "f16", seed=i) for i in range(6)]
    expected = [numbaflash.flash_attention(*p, causal=True) for p in problems]
    errors, results = [], {}

    def worker(i):
        try:
            for _ in range(3):
                results[i] = numbaflash.flash_attention(*problems[i], causal=True)
                np.testing.assert_array_equal(results[i].view(np.uint16), expected[i].view(np.uint16))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
