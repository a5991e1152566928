"""Reference attention with numpy: the ground truth for tests and tools."""

from __future__ import annotations

import numpy as np


def _visible(sq: int, sk: int) -> np.ndarray:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + sk - sq."""
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    rounding_dtype=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention in float64.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_q a multiple of heads_kv. Rows with no visible key give 0 and LSE -inf.

    ``rounding_dtype`` (e.g. ``np.float16`` or ``ml_dtypes.bfloat16``) rounds the scores,
    the probabilities and the output to that dtype, as a computation done in the input
    dtype would: FlashAttention's error yardstick.

    Returns ``(out, lse)``: out (batch, seqlen_q, heads_q, head_dim) float64 (values of
    ``rounding_dtype`` if given), lse (batch, heads_q, seqlen_q) float64.
    """
    def rnd(x):
        return x if rounding_dtype is None else x.astype(rounding_dtype).astype(np.float64)

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    group = hq // hkv
    qf = np.asarray(q, np.float64).transpose(0, 2, 1, 3)  # (b, h, sq, d)
    kf = np.repeat(np.asarray(k, np.float64), group, axis=2).transpose(0, 2, 3, 1)  # (b, h, d, sk)
    vf = np.repeat(np.asarray(v, np.float64), group, axis=2).transpose(0, 2, 1, 3)  # (b, h, sk, d)
    s = rnd(qf @ kf) * scale
    if causal:
        s = np.where(_visible(sq, sk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = rnd(np.where(denom > 0, p / denom, 0.0))
        lse = np.where(denom > 0, np.log(denom) + m_safe, -np.inf)[..., 0]
    out = rnd(probs @ vf).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(out), lse
