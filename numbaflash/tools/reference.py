"""Reference attention with numpy: the ground truth for tests and tools."""

from __future__ import annotations

import math

import numpy as np


def _visible(sq: int, sk: int) -> np.ndarray:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + sk - sq."""
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)


def visible_keys(sq: int, sk: int, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1)) -> np.ndarray:
    """(sq, sk) bool: FlashAttention's rule, written out directly: query i sees key j iff
    i + sk - sq - left <= j <= i + sk - sq + right, -1 meaning unbounded, causal setting right
    to 0."""
    left, right = window_size
    if causal:
        right = 0
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    seen = np.ones((sq, sk), bool)
    if left >= 0:
        seen &= j >= i + sk - sq - left
    if right >= 0:
        seen &= j <= i + sk - sq + right
    return seen


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    rounding_dtype=None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sink: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention in float64.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_q a multiple of heads_kv. Rows with no visible key give 0 and LSE -inf (with a sink:
    the sink's logit).
    ``window_size`` and ``softcap`` as ``numbaflash.flash_attention`` (``visible_keys``; the
    scaled scores s become softcap · tanh(s / softcap); ``rounding_dtype`` rounds the tanh's output
    and the capped score, as ``torch.tanh`` and the product would in that dtype).

    ``rounding_dtype`` (e.g. ``np.float16`` or ``ml_dtypes.bfloat16``) rounds the scores,
    the probabilities and the output to that dtype, as a computation done in the input
    dtype would: FlashAttention's error yardstick.

    ``sink`` (heads_q,), float32 for the kernels (any float here, taken in float64): a learnable
    sink (FlashAttention-4's ``learnable_sink``, gpt-oss). Each row's softmax then runs over its
    scaled, softcapped, masked scores s_j plus the sink logit of its query head, which is neither
    scaled nor capped and has no value row: out = Σ_j p_j v_j with Σ_j p_j = 1 − p_sink, and the
    LSE includes it: lse = log(exp(sink[h]) + Σ_j exp(s_j)), natural log like every LSE here, so
    p_sink = exp(sink[h] − lse). A row that sees no key gives 0 and LSE = sink[h] (p_sink = 1), as
    FlashAttention-4 does; a sink of -inf is no sink, bit for bit.

    Returns ``(out, lse)``: out (batch, seqlen_q, heads_q, head_dim) float64 (values of
    ``rounding_dtype`` if given), lse (batch, heads_q, seqlen_q) float64.
    """
    rnd = _rounding(rounding_dtype)
    _, _, vf, probs, lse, _ = _probabilities(q, k, v, causal, softmax_scale, rnd, window_size, softcap,
                                             sink)
    out = rnd(probs @ vf).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(out), lse


def _rounding(dtype):
    """x -> x rounded to ``dtype`` (as float64), or x itself for None."""
    def rnd(x):
        return x if dtype is None else x.astype(dtype).astype(np.float64)

    return rnd


def sink_logits(sink, heads_q: int) -> np.ndarray | None:
    """``sink`` as float64 (heads_q,), or None for None; a ValueError naming the shape expected
    and the one given otherwise."""
    if sink is None:
        return None
    sink = np.asarray(sink, np.float64)
    if sink.shape != (heads_q,):
        raise ValueError(f"sink: expected shape ({heads_q},) (heads_q,), got {sink.shape}")
    return sink


def _probabilities(q, k, v, causal: bool, softmax_scale: float | None, rnd,
                   window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sink=None):
    """What the forward and backward references share, in float64: ``(qf, kf, vf, probs, lse,
    scale)`` with qf (b, h, seqlen_q, d), kf and vf (b, h, seqlen_k, d) repeated over each GQA
    group, probs = softmax(rnd(Q Kᵀ) · scale) rounded by ``rnd`` (0 on rows that see no key, whose
    LSE is -inf, or the sink's with a sink), lse (b, h, seqlen_q). With ``sink`` ((heads_q,)) the
    softmax's denominator also holds exp(sink[h]) (``attention_reference``)."""
    _, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    group = hq // hkv
    qf = np.asarray(q, np.float64).transpose(0, 2, 1, 3)
    kf = np.repeat(np.asarray(k, np.float64), group, axis=2).transpose(0, 2, 1, 3)
    vf = np.repeat(np.asarray(v, np.float64), group, axis=2).transpose(0, 2, 1, 3)
    s = rnd(qf @ kf.transpose(0, 1, 3, 2)) * scale
    if softcap > 0:  # tanh's output is a value of the dtype too (torch.tanh on float16 returns one)
        s = rnd(softcap * rnd(np.tanh(s / softcap)))
    if causal or tuple(window_size) != (-1, -1):
        s = np.where(visible_keys(sq, sk, causal, window_size), s, -np.inf)
    sink = sink_logits(sink, hq)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:  # the sink joins the max (a sink of -inf changes nothing)
        m = np.maximum(m, sink[None, :, None, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:  # + exp(-inf) = + 0.0: a sink of -inf leaves every bit as it was
        denom = denom + np.exp(sink[None, :, None, None] - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = rnd(np.where(denom > 0, p / denom, 0.0))
        lse = np.where(denom > 0, np.log(denom) + m_safe, -np.inf)[..., 0]
    return qf, kf, vf, probs, lse, scale


def lse_tolerance(ref_lse: np.ndarray) -> float:
    """Absolute LSE tolerance: 1e-3, plus 2^-15 of the largest finite |LSE| (about the largest
    scaled score, whose float32 accumulation over head_dim products errs in proportion)."""
    finite = ref_lse[np.isfinite(ref_lse)]
    return 1e-3 + 2.0**-15 * float(np.abs(finite).max(initial=0.0))


def compare_with_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                           lse: np.ndarray | None = None, *, causal: bool = False,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, sink: np.ndarray | None = None) -> tuple[float, list[str]]:
    """FlashAttention's criterion: ``(ratio, problems)`` of a result against float64.

    ``out`` (batch, seqlen_q, heads_q, head_dim) and ``lse`` (batch, heads_q, seqlen_q), any
    float dtype, computed from the float16/bfloat16 ``q, k, v``. The max error must be at most
    twice that of the same computation done in the input dtype, plus a rounding floor
    (``ratio`` = error / that bound, <= 1 passes); no NaN; rows that see no key exactly 0;
    LSE -inf exactly on those rows and within ``lse_tolerance`` elsewhere. ``problems`` is
    empty when everything holds. ``window_size``, ``softcap`` and ``sink`` (heads_q,): as
    ``attention_reference``; with a finite sink the LSE of rows that see no key is the sink's,
    finite, and held to ``lse_tolerance`` like the others.
    """
    kw = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap,
          "sink": sink}
    ref, ref_lse = attention_reference(q, k, v, **kw)
    out = np.asarray(out).astype(np.float64)
    if out.shape != ref.shape:
        return math.inf, [f"output shape {out.shape}, expected {ref.shape}"]
    low, _ = attention_reference(q, k, v, rounding_dtype=q.dtype, **kw)
    problems = []
    if np.isnan(out).any():
        problems.append(f"NaN in output ({int(np.isnan(out).sum())} elements)")
    err, err_low = float(np.nanmax(np.abs(out - ref), initial=0.0)), float(np.abs(low - ref).max())
    floor = 2.0 ** -(11 if q.dtype == np.float16 else 8) * max(1.0, float(np.abs(ref).max())) / 4
    ratio = err / (2 * err_low + floor)
    if not ratio <= 1:
        problems.append(f"max error {err:.3e} > 2 x {err_low:.3e} + {floor:.1e} (ratio {ratio:.2f})")
    no_key = ~visible_keys(q.shape[1], k.shape[1], causal, window_size).any(axis=1)  # (seqlen_q,)
    if not (out[:, no_key] == 0).all():
        problems.append("rows that see no key are not exactly 0")
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        if lse.shape != ref_lse.shape:
            return ratio, [*problems, f"LSE shape {lse.shape}, expected {ref_lse.shape}"]
        finite = np.isfinite(ref_lse)
        if np.isnan(lse).any() or not (np.isneginf(lse) == ~finite).all():
            problems.append("LSE is not -inf exactly where the reference is (or has NaN)")
        err_lse = float(np.abs(lse[finite] - ref_lse[finite]).max(initial=0.0))
        if not err_lse <= lse_tolerance(ref_lse):
            problems.append(f"LSE max abs error {err_lse:.2e} > {lse_tolerance(ref_lse):.2e}")
    return ratio, problems


def attention_backward_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    rounding_dtype=None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sink: np.ndarray | None = None,
    output_dtype=None,
) -> tuple[np.ndarray, ...]:
    """Gradients (dq, dk, dv) of ``sum(out * dout)`` for exact attention, in float64; with a
    ``sink``, (dq, dk, dv, d_sink).

    Shapes as ``attention_reference`` (v's head dim may differ from q's and k's: dout, out and dv
    have v's); ``dout`` has out's shape. dk and dv of a kv head sum over its
    query heads (GQA); rows that see no key get zero gradients, keys that no row sees get zero dk
    and dv. ``rounding_dtype`` rounds every product and P, dS to that dtype, as a backward done in
    the input dtype would (the yardstick of FlashAttention's criterion). ``window_size`` and
    ``softcap`` as ``attention_reference``: with a softcap the gradient goes through the tanh,
    dS = P ∘ (dP − D) ∘ (1 − t²) with t = tanh(QKᵀ · scale / softcap), t rounded by
    ``rounding_dtype`` as in the forward (the value autograd of a float16 computation keeps:
    FlashAttention's tests build their input-dtype yardstick that way).

    ``sink`` (heads_q,) as ``attention_reference``: P is the sink-including softmax (its rows sum
    to 1 − p_sink), with which dq, dk, dv keep their formulas (D = rowsum(dO ∘ O) is still
    Σ_j P_ij dP_ij, the sink having no value row), and d_sink (heads_q,) float64 (the kernels
    write float32) is d sum(out * dout) / d sink = −Σ over batch and the rows of head h of
    p_sink · D, p_sink = exp(sink[h] − lse) (FlashAttention-4's dSink without a dLSE term); a row
    that sees no key has O = 0, so D = 0 and it adds nothing. Returns the same 3-tuple as before
    when ``sink`` is None.

    ``output_dtype``: O rounded to that dtype before D = rowsum(dO ∘ O) is taken, the rest as
    ``rounding_dtype`` says: FlashAttention's backward, which takes D from the output as stored.
    """
    rnd = _rounding(rounding_dtype)
    b, _, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qf, kf, vf, p, lse, scale = _probabilities(q, k, v, causal, softmax_scale, rnd, window_size, softcap,
                                               sink)
    dof = np.asarray(dout, np.float64).transpose(0, 2, 1, 3)
    out = _rounding(output_dtype)(rnd(p @ vf))
    dv = rnd(p.transpose(0, 1, 3, 2) @ dof)
    dp = rnd(dof @ vf.transpose(0, 1, 3, 2))
    delta = (rnd(dof * out)).sum(axis=-1, keepdims=True)
    if softcap > 0:  # d(softcap · tanh(s / softcap)) / ds = 1 - t² (P is 0 where the window hides)
        t = rnd(np.tanh(rnd(qf @ kf.transpose(0, 1, 3, 2)) * scale / softcap))
        ds = rnd(p * (dp - delta) * (1.0 - t * t))
    else:
        ds = rnd(p * (dp - delta))
    dq = rnd(ds @ kf) * scale
    dk = rnd(ds.transpose(0, 1, 3, 2) @ qf) * scale

    def per_kv_head(x):  # (b, hq, sk, d or dv) -> (b, sk, hkv, d or dv), summing each group
        return x.reshape(b, hkv, group, sk, x.shape[-1]).sum(axis=2).transpose(0, 2, 1, 3)

    grads = (np.ascontiguousarray(dq.transpose(0, 2, 1, 3)), np.ascontiguousarray(per_kv_head(dk)),
             np.ascontiguousarray(per_kv_head(dv)))
    if sink is None:
        return grads
    return (*grads, sink_gradient(sink_logits(sink, hq), lse, delta[..., 0], rnd))


def sink_gradient(sink: np.ndarray, lse: np.ndarray, delta: np.ndarray, rnd=None) -> np.ndarray:
    """d_sink (heads_q,) float64 from the forward's ``lse`` (batch, heads_q, seqlen_q) (the
    sink-including one) and D = rowsum(dO ∘ O) ``delta`` of the same shape: −Σ_{batch, rows}
    p_sink · D with p_sink = exp(sink[h] − lse), 0 where lse is -inf (only with a sink of -inf,
    on a row that sees no key, where D is 0 anyway). Why: ∂p_j/∂sink = −p_j · p_sink, so
    ∂O/∂sink = −p_sink · O and ∂(dO · O)/∂sink = −p_sink · D, row by row.

    ``rnd`` (``_rounding(dtype)``; None: exact) makes it the input-dtype computation that
    FlashAttention-4's dSink check measures against (autograd of the sink column in that dtype):
    p_sink, D, each row's term −p_sink · D and the sum rounded to the dtype."""
    rnd = rnd or _rounding(None)
    with np.errstate(invalid="ignore"):
        p_sink = np.where(np.isneginf(lse), 0.0, rnd(np.exp(sink[None, :, None] - lse)))
    return rnd(-rnd(p_sink * rnd(delta)).sum(axis=(0, 2)))


def sink_yardstick(ref: np.ndarray, low: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """d_sink's input-dtype computation for FlashAttention's rule (heads_q,): per head, whichever
    of ``low`` (autograd in the input dtype) and ``stored`` (exact but for D taken from O as
    stored in the input dtype, as every FlashAttention backward takes it) is farther from
    ``ref``. Why both: d_sink is one number a head, so the rule compares one error with one; the
    rounding of the stored O alone moves D, hence d_sink, by as much as the whole input-dtype
    computation does, and which of the two lands nearer is chance. With ``low`` alone, d_sink
    from the exactly rounded O (better than any kernel can do) failed twice its error in 2-5% of
    random draws of a two-head, 30-key causal shape (docs/PERFORMANCE.md, "Asymmetric head dims")."""
    return np.where(np.abs(stored - ref) > np.abs(low - ref), stored, low)


def compare_gradients_with_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray,
                                     grads: tuple[np.ndarray, ...], *,
                                     causal: bool = False,
                                     softmax_scale: float | None = None,
                                     window_size: tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0,
                                     sink: np.ndarray | None = None) -> tuple[float, list[str]]:
    """FlashAttention's criterion for (dq, dk, dv) against float64: for each, the max error is at
    most twice that of the same backward done in the input dtype plus a floor of one unit in the
    last place of the largest |gradient| (2^-10 for float16, 2^-7 for bfloat16, times max(1, that
    gradient)); no NaN; dq exactly 0 on rows that see no key. Returns ``(worst ratio, problems)``,
    problems empty when all hold.

    The floor is one ulp, not the forward's quarter of one (``compare_with_reference``): the
    kernels recompute P from the forward's LSE, so where the input-dtype computation is exact
    (one key: P is exactly 1 there, and dv a sum of a few dout values) a P of 1 - 2^-11 still
    moves a gradient by up to one ulp (H100, 15 of 300 self-test cases, all with seqlen_k = 1:
    docs/PERFORMANCE.md, "The release gate"). ``window_size`` and ``softcap``: as ``attention_reference``;
    dk and dv are then also exactly 0 on keys that no row sees.

    ``sink`` (heads_q,): the gradients of attention with that sink (``attention_backward_reference``);
    ``grads`` may then hold a fourth, d_sink (heads_q,), held to the same rule (its input-dtype
    computation: ``sink_gradient`` rounded as FlashAttention-4's dSink yardstick, autograd in the
    input dtype with a sink of that dtype, is: p_sink, D, each row's term and the sum, or, where
    its error is the larger, the exact d_sink with D taken from O as stored in the input dtype:
    ``sink_yardstick``); with three, d_sink is not checked."""
    kw = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap,
          "sink": sink}
    refs = attention_backward_reference(q, k, v, dout, **kw)
    lows = attention_backward_reference(q, k, v, dout, rounding_dtype=q.dtype, **kw)
    if sink is not None:
        stored = attention_backward_reference(q, k, v, dout, output_dtype=q.dtype, **kw)[3]
        lows = (*lows[:3], sink_yardstick(refs[3], lows[3], stored))
    if len(grads) not in (3, len(refs)):
        return math.inf, [f"{len(grads)} gradients, expected 3 (dq, dk, dv)"
                          + (" or 4 (dq, dk, dv, d_sink)" if sink is not None else "")]
    problems, worst = [], 0.0
    for name, got, ref, low in zip(("dq", "dk", "dv", "d_sink"), grads, refs, lows, strict=False):
        got = np.asarray(got).astype(np.float64)
        if got.shape != ref.shape:
            return math.inf, [f"{name} shape {got.shape}, expected {ref.shape}"]
        ratio, found = gradient_ratio(name, got, ref, low, q.dtype)
        worst = max(worst, ratio)
        problems += found
    if causal or tuple(window_size) != (-1, -1):
        seen = visible_keys(q.shape[1], k.shape[1], causal, window_size)
        no_key = ~seen.any(axis=1)  # query rows that see no key
        if not (np.asarray(grads[0])[:, no_key] == 0).all():
            problems.append("dq of rows that see no key is not exactly 0")
        unseen = ~seen.any(axis=0)  # keys that no row sees
        dk, dv = np.asarray(grads[1]), np.asarray(grads[2])
        if not ((dk[:, unseen] == 0).all() and (dv[:, unseen] == 0).all()):
            problems.append("dk or dv of keys that no row sees is not exactly 0")
    return worst, problems


def gradient_ratio(name: str, got: np.ndarray, ref: np.ndarray, low: np.ndarray,
                   dtype) -> tuple[float, list[str]]:
    """FlashAttention's rule for one gradient: ``(ratio, problems)``, ratio = max |got − ref| over
    2 · max |low − ref| plus a floor of one ulp of ``dtype`` (float16: 2^-10, else 2^-7) times
    max(1, max |ref|); ``got``, ``ref`` (float64) and ``low`` (the input-dtype computation) of
    one shape. A problem for NaN and for a ratio above 1."""
    problems = []
    if np.isnan(got).any():
        problems.append(f"NaN in {name} ({int(np.isnan(got).sum())} elements)")
    err = float(np.nanmax(np.abs(got - ref), initial=0.0))
    err_low = float(np.abs(low - ref).max(initial=0.0))
    largest = max(1.0, float(np.abs(ref).max(initial=0.0)))
    floor = 2.0 ** -(10 if dtype == np.float16 else 7) * largest
    ratio = err / (2 * err_low + floor)
    if not ratio <= 1:
        problems.append(f"{name} max error {err:.3e} > 2 x {err_low:.3e} + {floor:.1e} (ratio {ratio:.2f})")
    return ratio, problems


def varlen_attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray,
                               cu_seqlens_k: np.ndarray, **options) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention of a packed batch (``numbaflash.flash_attention_varlen``) in float64: each
    sequence through ``attention_reference`` on its own (``options``: its keywords).

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); cu_seqlens_*: (batch + 1,)
    offsets. Returns ``(out, lse)``: out (total_q, heads_q, head_dim) float64, lse (heads_q,
    total_q) float64; a sequence without keys gives 0 and LSE -inf (with ``sink=`` (heads_q,):
    LSE = sink, as ``attention_reference``'s rows that see no key), an empty one nothing."""
    out = np.zeros((*q.shape[:2], v.shape[2]), np.float64)  # v's head dim
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    sink = sink_logits(options.get("sink"), q.shape[1])
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 > q0 and k1 == k0 and sink is not None:
            lse[:, q0:q1] = sink[:, None]
        if q1 == q0 or k1 == k0:
            continue
        o, s = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **options)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = s[0]
    return out, lse


def _is_the_sink(lse: np.ndarray, sink: np.ndarray) -> bool:
    """Whether ``lse`` (heads_q, rows) is ``sink`` (heads_q,) on every row: exactly where the sink
    is infinite, within ``lse_tolerance`` elsewhere (NaN is not)."""
    expected = np.broadcast_to(sink[:, None], lse.shape)
    finite = np.isfinite(expected)
    err = np.abs(lse[finite] - expected[finite])
    return bool((lse[~finite] == expected[~finite]).all() and not np.isnan(err).any()
                and err.max(initial=0.0) <= lse_tolerance(sink))


def compare_varlen_with_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray,
                                  cu_seqlens_k: np.ndarray, out: np.ndarray, lse: np.ndarray | None = None,
                                  **options) -> tuple[float, list[str]]:
    """``compare_with_reference`` on each sequence of a packed batch (as
    ``varlen_attention_reference`` computes it): ``(worst ratio, problems)``, each problem naming
    its sequence. ``out`` (total_q, heads_q, v's head_dim) and ``lse`` (heads_q, total_q), any float
    dtype; a sequence without keys must give exactly 0 (so no NaN) and LSE -inf (with ``sink=``:
    the sink's, within ``lse_tolerance``); an empty one owns no row. ``options``:
    ``compare_with_reference``'s keywords."""
    out = np.asarray(out).astype(np.float64)
    expected = (*q.shape[:2], v.shape[2])
    if out.shape != expected:
        return math.inf, [f"output shape {out.shape}, expected {expected}"]
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        if lse.shape != (q.shape[1], q.shape[0]):
            return math.inf, [f"LSE shape {lse.shape}, expected {(q.shape[1], q.shape[0])}"]
    worst, problems = 0.0, []
    sink = sink_logits(options.get("sink"), q.shape[1])
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        rows, rows_lse = out[q0:q1], None if lse is None else lse[:, q0:q1]
        if k1 == k0:
            ratio, found = 0.0, []
            if not (rows == 0).all():
                found.append("rows of a sequence without keys are not exactly 0")
            if rows_lse is not None and sink is None and not np.isneginf(rows_lse).all():
                found.append("LSE of a sequence without keys is not -inf")
            if rows_lse is not None and sink is not None and not _is_the_sink(rows_lse, sink):
                found.append("LSE of a sequence without keys is not the sink")
        else:
            ratio, found = compare_with_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], rows[None],
                                                  None if rows_lse is None else rows_lse[None], **options)
        worst = max(worst, ratio)
        problems += [f"sequence {b} (seqlen_q {q1 - q0}, seqlen_k {k1 - k0}): {p}" for p in found]
    return worst, problems


def varlen_attention_backward_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray,
                                        cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray,
                                        **options) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 gradients (dq, dk, dv) of a packed batch: ``attention_backward_reference`` on each
    sequence alone. q, dout (total_q, heads_q, d), k, v (total_k, heads_kv, d); returns dq like q
    and dk, dv like k (float64). A sequence without keys gives dq = 0, one without queries dk =
    dv = 0. ``options``: ``attention_backward_reference``'s keywords; with ``sink=`` (heads_q,)
    it returns (dq, dk, dv, d_sink), d_sink (heads_q,) float64 summed over the sequences (one
    without keys adds 0)."""
    dq = np.zeros(q.shape, np.float64)
    dk = np.zeros(k.shape, np.float64)
    dv = np.zeros(v.shape, np.float64)
    sink = sink_logits(options.get("sink"), q.shape[1])
    d_sink = None if sink is None else np.zeros(sink.shape, np.float64)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        g = attention_backward_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1],
                                         **options)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        if d_sink is not None:
            d_sink += g[3]
    return (dq, dk, dv) if d_sink is None else (dq, dk, dv, d_sink)


def compare_varlen_gradients_with_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray,
                                            cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray,
                                            grads: tuple[np.ndarray, ...],
                                            **options) -> tuple[float, list[str]]:
    """``compare_gradients_with_reference`` (FlashAttention's criterion) on each sequence of a
    packed batch: ``(worst ratio, problems)``, each problem naming its sequence. ``grads``: packed
    dq (total_q, heads_q, d), dk and dv (total_k, heads_kv, d), any float dtype. Gradients with no
    counterpart must be exactly 0: dq of a sequence without keys, dk and dv of one without
    queries. ``options``: ``compare_gradients_with_reference``'s keywords; with ``sink=``, ``grads``
    may hold a fourth, d_sink (heads_q,), summed over the sequences, checked against the packed
    batch's (``varlen_attention_backward_reference``) by the same rule."""
    grads = tuple(np.asarray(g).astype(np.float64) for g in grads)
    with_sink = options.get("sink") is not None
    if len(grads) not in ((3, 4) if with_sink else (3,)):
        return math.inf, [f"{len(grads)} gradients, expected 3 (dq, dk, dv)" + (" or 4 (dq, dk, dv, d_sink)"
                                                                                if with_sink else "")]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), strict=False):
        if got.shape != ref.shape:
            return math.inf, [f"{name} shape {got.shape}, expected {ref.shape}"]
    worst, problems = 0.0, []
    if len(grads) == 4:
        ref = varlen_attention_backward_reference(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, **options)[3]
        low = varlen_attention_backward_reference(q, k, v, dout, cu_seqlens_q, cu_seqlens_k,
                                                  rounding_dtype=q.dtype, **options)[3]
        stored = varlen_attention_backward_reference(q, k, v, dout, cu_seqlens_q, cu_seqlens_k,
                                                     output_dtype=q.dtype, **options)[3]
        low = sink_yardstick(ref, low, stored)
        if grads[3].shape != ref.shape:
            return math.inf, [f"d_sink shape {grads[3].shape}, expected {ref.shape}"]
        worst, problems = gradient_ratio("d_sink", grads[3], ref, low, q.dtype)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        dq, dk, dv = grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1]
        ratio, found = 0.0, []
        if q1 == q0 or k1 == k0:
            for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
                if not (g == 0).all():
                    found.append(f"{name} of a sequence without {'keys' if k1 == k0 else 'queries'} is not "
                                 f"exactly 0")
        else:
            ratio, found = compare_gradients_with_reference(
                q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1],
                (dq[None], dk[None], dv[None]), **options)
        worst = max(worst, ratio)
        problems += [f"sequence {b} (seqlen_q {q1 - q0}, seqlen_k {k1 - k0}): {p}" for p in found]
    return worst, problems


def rotary_embedding(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
                     interleaved: bool = False) -> np.ndarray:
    """FlashAttention's rotary embedding of rows ``x`` (n, heads, d) at ``positions`` (n,) (rows of
    ``cos`` and ``sin``, (seqlen_ro, rotary_dim / 2)): the first rotary_dim columns rotated, the
    rest as they are. Halves (GPT-NeoX): x1 = x[:r/2], x2 = x[r/2:r] become x1·cos - x2·sin and
    x2·cos + x1·sin; interleaved (GPT-J): the pairs (x[2i], x[2i+1]) the same with cos[:, i].
    Computed in float32 and rounded to x's dtype for 16-bit inputs (as the kernels do), in
    float64 otherwise; a position past the table takes its last row (as the kernels do). Returns
    an array of x's dtype."""
    work = np.float32 if np.dtype(x.dtype).itemsize == 2 else np.float64
    positions = np.minimum(positions, cos.shape[0] - 1)
    half = cos.shape[1]
    dim = 2 * half
    c = np.asarray(cos)[positions].astype(work)[:, None, :]
    s = np.asarray(sin)[positions].astype(work)[:, None, :]
    xf = np.asarray(x).astype(work)
    out = xf.copy()
    if interleaved:
        a, b = xf[..., 0:dim:2], xf[..., 1:dim:2]
        out[..., 0:dim:2], out[..., 1:dim:2] = a * c - b * s, b * c + a * s
    else:
        a, b = xf[..., :half], xf[..., half:dim]
        out[..., :half], out[..., half:dim] = a * c - b * s, b * c + a * s
    return out.astype(x.dtype)


def rotary_query_step(causal: bool, window_size: tuple[int, int], room: int) -> int:
    """FlashAttention's positions of the query rows under a rotary embedding: 1 (query i at
    cache_seqlens[b] + i) in a causal or windowed call, 0 (every query at cache_seqlens[b])
    otherwise; a window side of at least ``room`` (the cache's rows a sequence) counts as none."""
    left, right = window_size
    right = 0 if causal else right
    left, right = (-1 if side >= room else side for side in (left, right))
    return int(causal or left >= 0 or right >= 0)


def kvcache_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, cache_seqlens: np.ndarray, *,
                      k_new: np.ndarray | None = None, v_new: np.ndarray | None = None,
                      block_table: np.ndarray | None = None, cache_batch_idx: np.ndarray | None = None,
                      cache_leftpad: np.ndarray | None = None, causal: bool = True,
                      rotary_cos: np.ndarray | None = None, rotary_sin: np.ndarray | None = None,
                      rotary_interleaved: bool = False,
                      **options) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``numbaflash.flash_attention_with_kvcache`` (FlashAttention's ``flash_attn_with_kvcache``)
    in float64, written out sequence by sequence; ``options``: ``attention_reference``'s keywords
    (softmax_scale, window_size, softcap, sink, rounding_dtype).

    q: (batch, seqlen_q, heads_q, head_dim); k_cache, v_cache: (cache_batch, capacity, heads_kv,
    head_dim), or with ``block_table`` (rows, max_pages) a paged cache (num_pages, page_size,
    heads_kv, head_dim); cache_seqlens, cache_batch_idx, cache_leftpad: ints (batch,); k_new, v_new:
    (batch, seqlen_new, heads_kv, head_dim). Sequence b uses the cache's batch row (paged: the
    table's row) cache_batch_idx[b] (else b); its keys are that row's cache rows cache_leftpad[b]
    (else 0) .. cache_seqlens[b] - 1, then its new rows, L of them in all; the new rows are written
    at cache rows cache_seqlens[b] .. (those the cache has room for: below the capacity, or in a
    page of the table, entry >= 0), and attended to from k_new / v_new themselves. The causal
    diagonal and the window are ``attention_reference``'s over the L keys (bottom-right). With
    ``rotary_cos`` and ``rotary_sin`` (``rotary_embedding``), q and k_new are rotated first (the
    cache gets the rotated rows): new row t at position cache_seqlens[b] + t, query i at
    cache_seqlens[b] + i·``rotary_query_step``.

    Returns ``(out, lse, k_cache_after, v_cache_after)``: out (batch, seqlen_q, heads_q, v's
    head_dim: v_cache's and v_new's last dimension may differ from q's and k's) and lse (batch,
    heads_q, seqlen_q) float64 (a sequence of no key: 0 and -inf, or the sink), and copies of the
    caches with the new rows written (the inputs are left as they are)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    k_after, v_after = np.array(k_cache), np.array(v_cache)
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    out = np.zeros((*q.shape[:3], v_cache.shape[3]), np.float64)  # v's head dim
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    sink = sink_logits(options.get("sink"), heads_q)
    room = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    q_step = rotary_query_step(causal, options.get("window_size", (-1, -1)), room)
    for b in range(batch):
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        end = int(cache_seqlens[b])
        q_b, new_b = q[b], None if k_new is None else k_new[b]
        if rotary_cos is not None:
            q_b = rotary_embedding(q_b, rotary_cos, rotary_sin, end + np.arange(seqlen_q) * q_step,
                                   rotary_interleaved)
            new_b = rotary_embedding(new_b, rotary_cos, rotary_sin, end + np.arange(seqlen_new),
                                     rotary_interleaved)

        def place(r: int, row: int = row) -> tuple[int, int] | None:
            """(unit, row in it) of the sequence's cache row r, None where the cache has no room."""
            if block_table is None:
                return (row, r) if r < k_cache.shape[1] else None
            page, at = divmod(r, k_cache.shape[1])
            unit = int(block_table[row, page]) if page < block_table.shape[1] else -1
            return (unit, at) if unit >= 0 else None

        keys = [k_cache[place(r)] for r in range(start, end)]
        values = [v_cache[place(r)] for r in range(start, end)]
        for t in range(seqlen_new):
            at = place(end + t)
            if at is not None:
                k_after[at], v_after[at] = new_b[t], v_new[b, t]
            keys.append(new_b[t])
            values.append(v_new[b, t])
        if not keys:
            if sink is not None:
                lse[b] = sink[:, None]
            continue
        o, s = attention_reference(q_b[None], np.stack(keys)[None], np.stack(values)[None], causal=causal,
                                   **options)
        out[b], lse[b] = o[0], s[0]
    return out, lse, k_after, v_after


def compare_mla_with_reference(q: np.ndarray, kv_cache: np.ndarray, cache_seqlens: np.ndarray,
                               out: np.ndarray, lse: np.ndarray | None = None, *,
                               block_table: np.ndarray | None = None,
                               head_dim_v: int = 512, causal: bool = False,
                               softmax_scale: float | None = None) -> list[str]:
    """``numbaflash.flash_mla_with_kvcache``'s result against float64, sequence by sequence, with
    ``compare_with_reference``'s criterion: sequence b's keys are the first cache_seqlens[b] rows
    of its cache (``kv_cache`` (batch, capacity, 1, d), or paged (num_pages, page_size, 1, d)
    through ``block_table``), its values their first ``head_dim_v`` columns. A sequence of no key
    must give exactly 0 and LSE -inf. Returns the problems, each naming its sequence (empty: all
    hold)."""
    problems = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        if block_table is None:
            rows = kv_cache[b, :n]
        else:
            page = kv_cache.shape[1]
            pages = block_table[b, :-(-n // page)]
            rows = np.concatenate([kv_cache[int(p)] for p in pages])[:n] if n else None
        if not n:
            if not (np.asarray(out[b], np.float64) == 0).all():
                problems.append(f"sequence {b} (no key): output not exactly 0")
            if lse is not None and not np.isneginf(np.asarray(lse[b], np.float64)).all():
                problems.append(f"sequence {b} (no key): LSE not -inf")
            continue
        _, found = compare_with_reference(q[b:b + 1], rows[None], rows[None, ..., :head_dim_v], out[b:b + 1],
                                          None if lse is None else lse[b:b + 1], causal=causal,
                                          softmax_scale=softmax_scale)
        problems += [f"sequence {b} ({n} keys): {p}" for p in found]
    return problems
