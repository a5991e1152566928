"""The Hopper backward with its GQA groups split over CTAs (``backward_group_splits`` > 1: grids
under two waves), on the GPU against the float64 backward with FlashAttention's criterion
(``tools.reference.compare_gradients_with_reference``, as ``test_backward_gpu.py``): batch 1,
16 / 4 and 8 / 1 heads, head dims 64 and 128, causal or not, seqlen_q != seqlen_k, ragged
lengths; each case first checks that its call does split. Deterministic mode never splits, and
is bit-identical run to run. Hopper only (the mma.sync backward never splits)."""

from __future__ import annotations

import numpy as np
import pytest
from test_backward_gpu import DTYPES, check, problem, run_backward

from numbaflash.operations.launch_backward import backward_group_splits

pytestmark = pytest.mark.hopper

BLOCK_N = 128  # every WsBackwardConfig's key block


def splits_of(seqlen_k: int, heads_q: int, heads_kv: int, batch: int = 1, deterministic: bool = False) -> int:
    """The split this device's call takes (its SM count, the Hopper backward's 128-key blocks)."""
    from numbaflash.runtime import device as gpu_state

    _, ordinal = gpu_state.GPU.current()
    return backward_group_splits(-(-seqlen_k // BLOCK_N), heads_kv, batch, heads_q // heads_kv,
                                 gpu_state.GPU.sm_count(ordinal), deterministic)


SHAPES = [  # (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
    (1024, 1024, 16, 4, 128),
    (2048, 2048, 16, 4, 64),
    (1024, 1024, 8, 1, 128),
    (1000, 1500, 8, 1, 64),  # seqlen_q < seqlen_k, ragged
    (1500, 700, 16, 4, 128),  # seqlen_q > seqlen_k: causal rows that see no key
    (777, 1333, 16, 4, 128),  # ragged both
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}_k{}_h{}/{}_d{}".format(*s))
def test_split_groups_match_the_reference(rng, shape, causal):
    sq, sk, hq, hkv, d = shape
    assert splits_of(sk, hq, hkv) > 1  # the call splits its groups
    q, k, v, dout = problem(rng, 1, sq, sk, hq, hkv, d, DTYPES["bfloat16"])
    grads, _ = run_backward(q, k, v, dout, causal)
    check(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_llama_shape(rng, dtype):
    """Batch 1, seqlen 4096, 16 / 4 heads, d128, causal: 32 x 4 CTAs unsplit, 4 splits on an H200."""
    assert splits_of(4096, 16, 4) > 1
    q, k, v, dout = problem(rng, 1, 4096, 4096, 16, 4, 128, DTYPES[dtype])
    grads, _ = run_backward(q, k, v, dout, True)
    check(q, k, v, dout, True, grads)


def test_split_runs_again_and_in_place(rng):
    """A second call on the same shapes (the sums and tickets zeroed again by its launch), and given
    dq / dk / dv poisoned with NaN: every element written."""
    from test_backward_gpu import device

    q, k, v, dout = problem(rng, 1, 900, 1100, 16, 4, 128, DTYPES["float16"])
    assert splits_of(1100, 16, 4) > 1
    first, _ = run_backward(q, k, v, dout, True)
    outs = {name: device(np.full(x.shape, np.nan, x.dtype)) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    again, _ = run_backward(q, k, v, dout, True, outs=outs)
    check(q, k, v, dout, True, again)
    for a, b in zip(first[1:], again[1:], strict=True):  # dk, dv: the same sums, maybe in another order
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_does_not_split_and_is_bit_identical(rng, causal):
    assert splits_of(1024, 16, 4, deterministic=True) == 1 < splits_of(1024, 16, 4)
    q, k, v, dout = problem(rng, 1, 1024, 1024, 16, 4, 128, DTYPES["bfloat16"])
    first, _ = run_backward(q, k, v, dout, causal, deterministic=True)
    again, _ = run_backward(q, k, v, dout, causal, deterministic=True)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    check(q, k, v, dout, causal, first)
