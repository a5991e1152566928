"""The backward (``flash_attention_backward``) on the GPU against the float64 numpy backward.

Criterion (FlashAttention's, ``tools.reference.compare_gradients_with_reference``): for each of
dq, dk, dv the max error is at most twice that of the same backward done in the input dtype,
plus a rounding floor; no NaN; dq exactly 0 on rows that see no key. Every head dim, both
dtypes, causal or not, GQA and MQA, seqlen_q far from seqlen_k, length 1, large inputs, a
long query sequence (the long-sequence config);
deterministic mode bit-identical run to run; given dq/dk/dv written in place (poisoned first);
every config autotune may pick, forced.
"""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import compare_gradients_with_reference

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
gpu = pytest.mark.gpu


def problem(rng, batch, sq, sk, hq, hkv, d, dtype, amplitude=1.0):
    """q, k, v, dout as numpy arrays of ``dtype``."""
    q = (rng.standard_normal((batch, sq, hq, d)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, d)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    dout = rng.standard_normal((batch, sq, hq, d)).astype(dtype)
    return q, k, v, dout


def device(x):
    """A numpy array as a device array (a DeviceBuffer: float16 and bfloat16 alike)."""
    from numbaflash.runtime.buffers import DeviceBuffer

    return DeviceBuffer(np.ascontiguousarray(x))


def host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.copy_to_host()


def run_backward(q, k, v, dout, causal, on_device=True, softmax_scale=None, deterministic=False, outs=None):
    """Forward (out, LSE) then backward; returns (dq, dk, dv) as numpy arrays."""
    args = [device(x) for x in (q, k, v)] if on_device else [q, k, v]
    dout_in = device(dout) if on_device else dout
    out, lse = numbaflash.flash_attention(*args, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    grads = numbaflash.flash_attention_backward(dout_in, *args, out, lse, causal=causal,
                                                softmax_scale=softmax_scale, deterministic=deterministic,
                                                **(outs or {}))
    return tuple(host(g) for g in grads), grads


def check(q, k, v, dout, causal, grads, softmax_scale=None):
    _, problems = compare_gradients_with_reference(q, k, v, dout, grads, causal=causal,
                                                   softmax_scale=softmax_scale)
    assert not problems, "; ".join(problems)


@gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_head_dim_ragged_gqa(rng, head_dim, causal, dtype):
    q, k, v, dout = problem(rng, 2, 137, 201, 4, 2, head_dim, DTYPES[dtype])
    grads, _ = run_backward(q, k, v, dout, causal)
    check(q, k, v, dout, causal, grads)


@gpu
@pytest.mark.parametrize(
    "shape",
    [
        (1, 700, 150, 2, 1, 128),  # seqlen_q >> seqlen_k: causal rows that see no key
        (1, 40, 900, 8, 1, 64),  # MQA 8:1, seqlen_q << seqlen_k
        (2, 1, 1, 2, 2, 64),  # length 1
        (1, 300, 300, 8, 1, 96),  # GQA 8:1
        (1, 129, 257, 2, 2, 256),  # ragged past two key blocks
        (3, 64, 128, 3, 3, 32),  # whole blocks
    ],
    ids=["sq>>sk", "mqa", "one", "gqa8", "d256", "d32"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes(rng, shape, causal):
    b, sq, sk, hq, hkv, d = shape
    q, k, v, dout = problem(rng, b, sq, sk, hq, hkv, d, np.float16)
    grads, _ = run_backward(q, k, v, dout, causal)
    check(q, k, v, dout, causal, grads)


@gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_large_inputs_and_scale(rng, dtype):
    q, k, v, dout = problem(rng, 1, 333, 222, 2, 1, 128, DTYPES[dtype], amplitude=6.0)
    grads, _ = run_backward(q, k, v, dout, True, softmax_scale=0.05)
    check(q, k, v, dout, True, grads, softmax_scale=0.05)


@gpu
def test_numpy_inputs(rng):
    q, k, v, dout = problem(rng, 2, 90, 130, 4, 2, 64, np.float16)
    grads, raw = run_backward(q, k, v, dout, True, on_device=False)
    assert all(isinstance(g, np.ndarray) for g in raw)
    check(q, k, v, dout, True, grads)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_is_bit_identical(rng, causal):
    q, k, v, dout = problem(rng, 2, 513, 700, 4, 1, 128, ml_dtypes.bfloat16)
    first, _ = run_backward(q, k, v, dout, causal, deterministic=True)
    for _ in range(2):
        again, _ = run_backward(q, k, v, dout, causal, deterministic=True)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(q, k, v, dout, causal, first)


@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_causal_launch_order_with_a_plain_head_and_an_interleaved_tail(rng, deterministic):
    """Enough (batch, KV head) pairs that the main kernel's launch has both parts of
    ``blocks.key_block_of``'s order: 24 pairs of 17 key blocks (128 keys), of which
    ``ceil(2 * SMs / 17)`` (16 on a 132-SM H100) launch interleaved at the end."""
    q, k, v, dout = problem(rng, 3, 300, 2100, 8, 8, 64, np.float16)
    grads, _ = run_backward(q, k, v, dout, True, deterministic=deterministic)
    check(q, k, v, dout, True, grads)


@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_query_sequences(rng, causal, deterministic):
    """A query sequence of ``configs.BACKWARD_LONG_SEQLEN`` rows or more, unforced: on Hopper at d128
    the long-sequence config (80 query rows a step, dQ transposed), whose last query block is
    ragged (16437 = 205 x 80 + 37 rows), GQA 4:1; few keys keep the float64 reference cheap."""
    from numba import cuda

    sq = configs.BACKWARD_LONG_SEQLEN + 53
    capability = tuple(cuda.get_current_device().compute_capability)
    if capability[0] == 9:
        assert configs.backward_config(capability, 128, causal, long=True) in configs.BACKWARD_WS_LONG[128]
    q, k, v, dout = problem(rng, 1, sq, 333, 4, 1, 128, ml_dtypes.bfloat16)
    grads, _ = run_backward(q, k, v, dout, causal, deterministic=deterministic)
    check(q, k, v, dout, causal, grads)


@gpu
def test_given_outputs_are_written_in_place(rng):
    q, k, v, dout = problem(rng, 1, 100, 80, 4, 2, 64, np.float16)
    outs = {name: device(np.full(x.shape, np.nan, x.dtype)) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    grads, raw = run_backward(q, k, v, dout, True, outs=outs)
    assert all(g is outs[n] for g, n in zip(raw, ("dq", "dk", "dv"), strict=True))
    check(q, k, v, dout, True, grads)


TUNABLE = sorted({c for cands in configs.BACKWARD_CANDIDATES.values() for c in cands}
                 | {c for _, _, c in configs.shipped_backward_configs()}, key=str)


@gpu
@pytest.mark.parametrize("cfg", TUNABLE, ids=str)
def test_every_tunable_config(rng, cfg):
    """Each backward config autotune may pick, and each shipped one, forced: correct on ragged GQA
    shapes, non-causal in fp16 and causal in bf16 with whole query blocks that see no key
    (seqlen_q = seqlen_k + 2 block_m + 17: zero dq there)."""
    from numba import cuda

    device_ = cuda.get_current_device()
    if not configs.backward_runnable(cfg, tuple(device_.compute_capability)):
        pytest.skip(f"{cfg} runs on Hopper only")
    if cfg.shared_bytes > device_.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
        pytest.skip(f"{cfg} needs {cfg.shared_bytes} bytes of shared memory; this GPU allows "
                    f"{device_.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN}")
    masked_q = 45 + 2 * cfg.block_m + 17
    for causal, dtype, sq, sk in ((False, np.float16, 211, 333), (True, ml_dtypes.bfloat16, masked_q, 45)):
        q, k, v, dout = problem(rng, 2, sq, sk, 4, 2, cfg.head_dim, dtype)
        with configs.force_config(tuple(device_.compute_capability), causal, cfg):
            grads, _ = run_backward(q, k, v, dout, causal)
        check(q, k, v, dout, causal, grads)
