"""The FP8 self-test mode's pure parts on the CPU (``tools.selftest_fp8``): reproducible draws within
their limits, and its float64 reference against ``fp8.attention_reference`` (the same numerics:
P times 256 rounded to e4m3, the row sums before the rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from numbaflash.tools.selftest_fp8 import LIMITS, _reference, draw_fp8_case


def test_draws_are_reproducible_and_bounded():
    for index in range(60):
        case = draw_fp8_case(7, index)
        assert case == draw_fp8_case(7, index)
        longest, cap = LIMITS[False]
        assert max(case.seqlen_q, case.seqlen_k) <= longest
        assert case.batch * case.heads_q * case.seqlen_q * case.seqlen_k <= cap
        assert case.heads_q % case.heads_kv == 0 and case.head_dim in (64, 128, 256)
        assert not (case.causal and case.window_size != (-1, -1))
    variants = [draw_fp8_case(7, i, variants=True) for i in range(30)]
    assert all(c.window_size != (-1, -1) or c.softcap > 0 for c in variants)


def test_reference_matches_fp8_attention_reference():
    torch = pytest.importorskip("torch")
    from numbaflash import fp8

    case = draw_fp8_case(3, 1)
    case.softcap, case.window_size, case.sink = 0.0, (-1, -1), ()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, h, 64, generator=g) for s, h in ((37, 4), (50, 2), (50, 2)))
    x = fp8.quantize(q, k, v)
    for causal in (False, True):
        case.causal = causal
        exact, rounded, lse, magnitude = _reference(*(t.double().numpy() for t in x.dequantize()), case)
        np.testing.assert_allclose(rounded, fp8.attention_reference(x, causal=causal).numpy(), atol=1e-12)
        np.testing.assert_allclose(exact, fp8.attention_reference(x, causal=causal, p_fp8=False).numpy(),
                                   atol=1e-12)
        assert lse.shape == (2, 4, 37) and 0 < magnitude


def test_packed_draws():
    cases = [draw_fp8_case(11, i) for i in range(200)]
    packed = [c for c in cases if c.q_lengths]
    assert 30 < len(packed) < 90  # about 30%
    longest, cap = LIMITS[False]
    for c in packed:
        assert len(c.q_lengths) == len(c.k_lengths) == c.batch and 2 <= c.batch <= 4
        assert max(c.q_lengths) == c.seqlen_q and max(c.k_lengths) == c.seqlen_k
        assert min(c.q_lengths + c.k_lengths) >= 0
        assert c.batch * c.heads_q * c.seqlen_q * c.seqlen_k <= cap
    plain = [c for c in cases if not c.q_lengths]
    assert all(c == draw_fp8_case(11, c.index) for c in plain)
