"""The learnable sink (issue 56, FlashAttention-4's ``learnable_sink``) on the GPU against the float64
reference (``compare_with_reference(..., sink=)``: FlashAttention's criterion; rows that see no key
exactly 0 with LSE = the sink, within ``lse_tolerance``).

Device arrays (a sink takes no numpy inputs yet), outputs poisoned with NaN, so an element the
kernel never writes fails. Calls go through the dispatcher (the GPU's own family: on Hopper the TMA
kernel at head dims 64, 96, 128 and 256), and with the mma.sync family's config forced
(``test_sink_on_the_mma_sync_family``), so that on Hopper both families' sink builds run.

    NUMBAFLASH_REQUIRE_GPU=1 pytest -m gpu tests/test_sink_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import (
    attention_reference,
    compare_varlen_with_reference,
    compare_with_reference,
    lse_tolerance,
    visible_keys,
)

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): equal, seqlen_q above seqlen_k (causal: the first
# rows see no key) and below it, ragged (multiples of no tile), length 1, GQA and MQA.
SHAPES = [(2, 200, 200, 4, 2), (1, 333, 129, 4, 1), (1, 129, 517, 4, 4), (2, 1, 300, 4, 1),
          (1, 300, 1, 4, 2), (1, 1000, 1000, 4, 1)]


def random_qkv(rng, batch, sq, sk, hq, hkv, d, dtype, amplitude=1.0):
    q = (rng.standard_normal((batch, sq, hq, d)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, d)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    return q, k, v


def random_sink(rng, heads_q: int, scale: float = 2.0) -> np.ndarray:
    """float32 (heads_q,) logits: random, with head 0 dominant (+8: its rows' p_sink near 1),
    head 1 no sink at all (-inf) and head 2 small (-4)."""
    sink = (rng.standard_normal(heads_q) * scale).astype(np.float32)
    sink[:3] = (8.0, -np.inf, -4.0)[:heads_q]
    return sink


def run_sink(q, k, v, sink, **options):
    """One device call with the sink and a NaN-poisoned out: (out, lse) on the host."""
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer

    dq, dk, dv = (DeviceBuffer(x) for x in (q, k, v))
    dout = DeviceBuffer(np.full(q.shape, np.nan, q.dtype))
    result, lse = numbaflash.flash_attention(dq, dk, dv, out=dout, return_lse=True,
                                             learnable_sink=cuda.to_device(sink), **options)
    assert result is dout
    return dout.copy_to_host(), lse.copy_to_host()


def check(q, k, v, sink, **options):
    out, lse = run_sink(q, k, v, sink, **options)
    _, problems = compare_with_reference(q, k, v, out, lse, sink=sink, **options)
    assert not problems, f"{q.shape} {k.shape} {options}: " + "; ".join(problems)
    return out, lse


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_sink_matches_reference(rng, causal, dtype, head_dim):
    for shape in SHAPES:
        q, k, v = random_qkv(rng, *shape, head_dim, DTYPES[dtype])
        check(q, k, v, random_sink(rng, shape[3]), causal=causal)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_sink_on_the_mma_sync_family(rng, causal, dtype, head_dim):
    """The mma.sync kernel's sink build with its dispatched config forced (on Hopper, where the
    TMA kernel runs unforced at head dims 64 to 256)."""
    from numbaflash.runtime import device

    capability, _ = device.GPU.current()
    if capability[0] != 9:
        pytest.skip("the GPU's own family is the mma.sync one (test_sink_matches_reference)")
    config = configs.forward_config((8, 0), head_dim, causal)
    with configs.force_config(capability, causal, config):
        for shape in SHAPES[:3]:
            q, k, v = random_qkv(rng, *shape, head_dim, DTYPES[dtype])
            check(q, k, v, random_sink(rng, shape[3]), causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_sink_at_large_scores(rng, dtype, head_dim):
    """Scores far above and far below the sink: the running max starts at the sink and the
    rescales then carry its term (amplitude 4: scaled scores up to about 30)."""
    for scale in (0.5, 20.0):
        q, k, v = random_qkv(rng, 1, 300, 700, 4, 2, head_dim, DTYPES[dtype], amplitude=4.0)
        check(q, k, v, random_sink(rng, 4, scale), causal=False)
        check(q, k, v, np.full(4, 40.0, np.float32), causal=True)  # the sink dominates every row


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(("window", "softcap"), [((127, 0), 0.0), ((3, 50), 0.0), ((-1, -1), 30.0),
                                                 ((16, 0), 50.0)])
def test_sink_with_window_and_softcap(rng, window, softcap, head_dim, dtype):
    """The sink is neither scaled nor capped: softcap 30 and 50 on scores that reach the cap."""
    amplitude = 10.0 if softcap else 1.0
    for shape in ((2, 333, 517, 4, 2), (1, 517, 129, 4, 4)):
        q, k, v = random_qkv(rng, *shape, head_dim, DTYPES[dtype], amplitude=amplitude)
        check(q, k, v, random_sink(rng, 4), window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(("sq", "sk", "options"), [
    (700, 300, {"causal": True}), (1000, 200, {"causal": True}), (700, 300, {"window_size": (50, 10)})])
def test_rows_that_see_no_key_give_zero_and_the_sink(rng, sq, sk, options, head_dim, dtype):
    """seqlen_q > seqlen_k: the first rows see no key. They give exactly 0 and LSE = the sink
    (-inf for the head whose sink is -inf), three calls over one poisoned out."""
    q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, head_dim, DTYPES[dtype])
    sink = random_sink(rng, 4)
    window = options.get("window_size", (-1, -1))
    empty = ~visible_keys(sq, sk, options.get("causal", False), window).any(axis=1)
    assert empty.any()
    for _ in range(3):
        out, lse = check(q, k, v, sink, **options)
        assert (out[:, empty].astype(np.float32) == 0).all(), "rows with no key are not 0"
        expected = np.broadcast_to(sink[None, :, None], lse[:, :, empty].shape)
        finite = np.isfinite(expected)
        assert (np.isneginf(lse[:, :, empty]) == ~finite).all()
        tolerance = lse_tolerance(sink[np.isfinite(sink)])
        assert np.abs(lse[:, :, empty][finite] - expected[finite]).max() <= tolerance


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True])
def test_a_sink_of_minus_inf_is_no_sink_bit_for_bit(rng, causal, head_dim, dtype):
    """The sink build with every logit -inf gives the plain kernel's out and LSE bit for bit
    (the start it makes is the plain one: max -inf, sum 0)."""
    from numbaflash.runtime.buffers import DeviceBuffer

    q, k, v = random_qkv(rng, 2, 333, 517, 4, 2, head_dim, DTYPES[dtype])
    out, lse = run_sink(q, k, v, np.full(4, -np.inf, np.float32), causal=causal)
    plain, plain_lse = numbaflash.flash_attention(*(DeviceBuffer(x) for x in (q, k, v)), causal=causal,
                                                  return_lse=True)
    np.testing.assert_array_equal(out.view(np.uint16), plain.copy_to_host().view(np.uint16))
    np.testing.assert_array_equal(lse, plain_lse.copy_to_host())


@pytest.mark.parametrize("head_dim", [32, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sink(rng, causal, bf16, head_dim):
    """Packed sequences, with an empty one and one whose keys are empty (its rows: 0 and LSE = the
    sink), against float64 sequence by sequence."""
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer

    dtype = DTYPES["bfloat16" if bf16 else "float16"]
    lengths_q, lengths_k = (1, 77, 0, 130, 5, 300), (1, 64, 3, 200, 0, 129)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), 4, head_dim)).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), 2, head_dim)).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), 2, head_dim)).astype(dtype)
    sink = random_sink(rng, 4)
    dout = DeviceBuffer(np.full(q.shape, np.nan, q.dtype))
    _, lse = numbaflash.flash_attention_varlen(
        *(DeviceBuffer(x) for x in (q, k, v)), cuda.to_device(cu_q), cuda.to_device(cu_k), max(lengths_q),
        max(lengths_k), causal=causal, return_lse=True, out=dout, learnable_sink=cuda.to_device(sink))
    ratio, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, dout.copy_to_host(),
                                                    lse.copy_to_host(), causal=causal, sink=sink)
    assert not problems, (ratio, problems)


def test_torch_tensors_with_a_sink():
    """torch CUDA tensors: the sink call matches float64 (its autograd: test_sink_backward_gpu.py)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 257, 300, 4, 2, 128, np.float16)
    sink = random_sink(rng, 4)
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    out, lse = numbaflash.flash_attention(tq, tk, tv, causal=True, return_lse=True,
                                          learnable_sink=torch.from_numpy(sink).cuda())
    _, problems = compare_with_reference(q, k, v, out.cpu().numpy(), lse.cpu().numpy(), causal=True,
                                         sink=sink)
    assert not problems, problems
    ref, _ = attention_reference(q, k, v, causal=True, sink=sink)
    assert np.isfinite(ref).all()
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(heads_q,\) = \(4,\), got \(2,\)"):
        numbaflash.flash_attention(tq.detach(), tk, tv, learnable_sink=torch.zeros(2, device="cuda"))
