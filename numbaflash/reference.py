"""Reference attention in float64 (or any dtype) with numpy: the ground truth for tests."""

from __future__ import annotations

import numpy as np


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dtype=np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention computed in ``dtype``.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_q a multiple of heads_kv. Causal masking is bottom-right aligned: query i sees key
    j iff j <= i + seqlen_k - seqlen_q. Rows with no visible key give 0 (LSE -inf).
    With ``dtype`` float16 the matmuls and softmax are rounded to the input dtype at each
    step, as FlashAttention's error criterion does ("the same computation in the input dtype").

    Returns ``(out, lse)``: out (batch, seqlen_q, heads_q, head_dim) in ``dtype``,
    lse (batch, heads_q, seqlen_q) float64.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    group = hq // hkv
    qf = q.astype(dtype)
    kf = np.repeat(k.astype(dtype), group, axis=2)
    vf = np.repeat(v.astype(dtype), group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf).astype(dtype) * dtype(scale)
    if causal:
        visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp((s - m_safe).astype(np.float64)).astype(dtype)
    denom = p.astype(np.float64).sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = np.where(denom > 0, p / denom, 0).astype(dtype)
        lse = np.where(denom > 0, np.log(denom) + m_safe, -np.inf)[..., 0]
    out = np.einsum("bhqk,bkhd->bqhd", probs, vf).astype(dtype)
    return out, lse.astype(np.float64)
