"""The float64 ground truth of learnable sinks (issue 56, FlashAttention-4's ``learnable_sink``):
``attention_reference``, ``attention_backward_reference`` and their varlen forms with ``sink=``.

The conventions checked: the sink (heads_q,) is indexed by query head, joins each row's softmax
unscaled and uncapped, has no value row; the LSE (natural log) includes it; a row that sees no key
gives 0 and LSE = sink; a sink of -inf is no sink, bit for bit; the gradients agree with central
finite differences of sum(out * dout)."""

import numpy as np
import pytest

from numbaflash.tools.reference import (
    attention_backward_reference,
    attention_reference,
    compare_gradients_with_reference,
    compare_varlen_gradients_with_reference,
    compare_varlen_with_reference,
    compare_with_reference,
    sink_gradient,
    varlen_attention_backward_reference,
    varlen_attention_reference,
    visible_keys,
)


def problem(seed=0, batch=2, seqlen_q=3, seqlen_k=4, heads_q=4, heads_kv=2, d=3):
    """q, k, v, dout float64 and a sink (heads_q,) float32 of mixed signs."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, heads_q, d))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, d))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, d))
    dout = rng.standard_normal((batch, seqlen_q, heads_q, d))
    sink = rng.standard_normal(heads_q).astype(np.float32)
    return q, k, v, dout, sink


MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (1, 0)},
    "softcap": {"softcap": 1.5},
    "causal+softcap": {"causal": True, "softcap": 0.7},
    "window+softcap": {"window_size": (0, 1), "softcap": 2.0},
}


@pytest.mark.parametrize("options", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("shape", [(3, 4), (5, 2)], ids=["sq<sk", "sq>sk"])
@pytest.mark.parametrize("rounding", [None, np.float16], ids=["f64", "f16"])
def test_a_sink_of_minus_inf_is_no_sink_bit_for_bit(options, shape, rounding):
    q, k, v, dout, _ = problem(seqlen_q=shape[0], seqlen_k=shape[1])
    none = np.full(q.shape[2], -np.inf, np.float32)
    kw = {"rounding_dtype": rounding, **options}
    out, lse = attention_reference(q, k, v, **kw)
    out_s, lse_s = attention_reference(q, k, v, sink=none, **kw)
    assert np.array_equal(out, out_s) and np.array_equal(lse, lse_s)
    grads = attention_backward_reference(q, k, v, dout, **kw)
    *grads_s, d_sink = attention_backward_reference(q, k, v, dout, sink=none, **kw)
    for g, g_s in zip(grads, grads_s, strict=True):
        assert np.array_equal(g, g_s)
    assert np.array_equal(d_sink, np.zeros(q.shape[2]))


def test_a_large_sink_drives_out_to_zero_and_the_lse_to_the_sink():
    q, k, v, _, _ = problem()
    sink = np.full(q.shape[2], 60.0, np.float32)
    out, lse = attention_reference(q, k, v, sink=sink)
    assert np.abs(out).max() < 1e-20
    np.testing.assert_allclose(lse, 60.0, rtol=0, atol=1e-20)
    # and a huge one, past exp's range relative to the scores, gives exactly 0
    out, lse = attention_reference(q, k, v, sink=np.full(q.shape[2], 1e4, np.float32))
    assert (out == 0).all() and (lse == 1e4).all()


@pytest.mark.parametrize("options", MASKS.values(), ids=MASKS.keys())
def test_the_lse_includes_the_sink_and_the_rows_shrink_by_one_minus_p_sink(options):
    q, k, v, _, sink = problem(seqlen_q=5, seqlen_k=4)
    out, lse = attention_reference(q, k, v, **options)
    out_s, lse_s = attention_reference(q, k, v, sink=sink, **options)
    s = sink.astype(np.float64)[None, :, None]
    np.testing.assert_allclose(lse_s, np.logaddexp(lse, s), rtol=1e-14, atol=1e-14)
    keep = np.exp(lse - lse_s).transpose(0, 2, 1)[..., None]  # 1 - p_sink, (b, sq, hq, 1)
    np.testing.assert_allclose(out_s, out * keep, rtol=1e-12, atol=1e-14)
    assert (lse_s >= s - 1e-15).all()


def test_the_sink_is_neither_scaled_nor_capped():
    """Doubling softmax_scale or adding a softcap leaves the sink's logit as it is: with every
    score 0 (q = 0), p_sink = e^sink / (e^sink + seqlen_k) whatever the scale and cap."""
    _, k, v, _, sink = problem()
    q = np.zeros((2, 3, 4, 3))
    s = sink.astype(np.float64)[None, :, None]
    expected = s - np.log(np.exp(s) + k.shape[1])  # log p_sink
    for kw in ({}, {"softmax_scale": 2.0}, {"softcap": 0.3}, {"softmax_scale": 5.0, "softcap": 0.1}):
        _, lse = attention_reference(q, k, v, sink=sink, **kw)
        np.testing.assert_allclose(s - lse, np.broadcast_to(expected, lse.shape), rtol=1e-14, atol=1e-14)


def test_the_sink_is_indexed_by_query_head_under_gqa():
    """GQA with a sink is MHA over the repeated K and V with the same sink per query head; moving
    one head's sink changes that head's rows and no other."""
    q, k, v, dout, sink = problem(heads_q=6, heads_kv=2)
    group = 3
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    for options in ({}, {"causal": True}):
        out, lse = attention_reference(q, k, v, sink=sink, **options)
        out_mha, lse_mha = attention_reference(q, k_rep, v_rep, sink=sink, **options)
        np.testing.assert_array_equal(out, out_mha)
        np.testing.assert_array_equal(lse, lse_mha)
        dq, dk, dv, d_sink = attention_backward_reference(q, k, v, dout, sink=sink, **options)
        dq_m, dk_m, dv_m, d_sink_m = attention_backward_reference(q, k_rep, v_rep, dout, sink=sink, **options)
        np.testing.assert_allclose(dq, dq_m, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(dk, dk_m.reshape(*k.shape[:2], 2, group, 3).sum(axis=3), rtol=1e-13,
                                   atol=1e-14)
        np.testing.assert_allclose(dv, dv_m.reshape(*v.shape[:2], 2, group, 3).sum(axis=3), rtol=1e-13,
                                   atol=1e-14)
        np.testing.assert_allclose(d_sink, d_sink_m, rtol=1e-13, atol=1e-14)
    moved = sink.copy()
    moved[4] += 1.0
    out, lse = attention_reference(q, k, v, sink=sink)
    out_m, lse_m = attention_reference(q, k, v, sink=moved)
    changed = [h for h in range(6) if not np.array_equal(out[:, :, h], out_m[:, :, h])]
    assert changed == [4] and [h for h in range(6) if not np.array_equal(lse[:, h], lse_m[:, h])] == [4]


@pytest.mark.parametrize("options", [{"causal": True}, {"window_size": (0, 0)}, {"window_size": (1, 1)},
                                     {"causal": True, "softcap": 1.0}],
                         ids=["causal", "window(0,0)", "window(1,1)", "causal+softcap"])
def test_rows_that_see_no_key_give_zero_and_the_sinks_lse(options):
    """seqlen_q > seqlen_k: the first rows see no key. They give out exactly 0 and LSE exactly the
    sink (FlashAttention-4: softmax.py ``finalize`` starts such a row's max at the sink, whose
    exp2(0) = 1 is then the row sum), and zero dq; the others keep a finite LSE above it."""
    q, k, v, dout, sink = problem(seqlen_q=7, seqlen_k=3)
    seen = visible_keys(7, 3, options.get("causal", False), options.get("window_size", (-1, -1)))
    no_key = ~seen.any(axis=1)
    assert no_key.any() and not no_key.all()
    out, lse = attention_reference(q, k, v, sink=sink, **options)
    assert (out[:, no_key] == 0).all()
    assert (lse[:, :, no_key] == sink.astype(np.float64)[None, :, None]).all()
    assert (lse[:, :, ~no_key] > sink.astype(np.float64)[None, :, None]).all()
    dq, dk, dv, _ = attention_backward_reference(q, k, v, dout, sink=sink, **options)
    assert (dq[:, no_key] == 0).all()
    unseen = ~seen.any(axis=0)
    assert (dk[:, unseen] == 0).all() and (dv[:, unseen] == 0).all()


def test_empty_key_sequences_of_a_packed_batch_take_the_sinks_lse():
    """Varlen: a sequence without keys gives 0 and LSE = sink (FlashAttention-4's interface fills
    the LSE with the sink when seqlen_k is 0); the others are the dense reference on their own, and
    the backward's d_sink is the sum of each sequence's."""
    rng = np.random.default_rng(3)
    cu_q, cu_k = np.array([0, 3, 5, 5, 9]), np.array([0, 4, 4, 6, 11])  # sequence 1: no keys; 2: no queries
    hq, hkv, d = 4, 2, 3
    q = rng.standard_normal((9, hq, d))
    k, v = rng.standard_normal((11, hkv, d)), rng.standard_normal((11, hkv, d))
    dout = rng.standard_normal((9, hq, d))
    sink = rng.standard_normal(hq).astype(np.float32)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, sink=sink, causal=True)
    assert (out[3:5] == 0).all() and (lse[:, 3:5] == sink.astype(np.float64)[:, None]).all()
    d_sink = np.zeros(hq)
    grads = varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k, sink=sink, causal=True)
    for b in (0, 3):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        o, s = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sink=sink, causal=True)
        np.testing.assert_array_equal(out[q0:q1], o[0])
        np.testing.assert_array_equal(lse[:, q0:q1], s[0])
        g = attention_backward_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1],
                                         sink=sink, causal=True)
        np.testing.assert_array_equal(grads[0][q0:q1], g[0][0])
        d_sink += g[3]
    assert (grads[0][3:5] == 0).all()
    np.testing.assert_allclose(grads[3], d_sink, rtol=1e-14, atol=1e-15)
    # without a sink the empty sequence keeps LSE -inf, as before
    _, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=True)
    assert np.isneginf(lse[:, 3:5]).all()
    assert len(varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k, causal=True)) == 3


def loss(q, k, v, dout, sink, options):
    out, _ = attention_reference(q, k, v, sink=sink, **options)
    return float((out * dout).sum())


def central_differences(x, f, h=1e-6):
    """d f / d x for every element of x (float64, changed in place and restored)."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        x0 = x[i]
        x[i] = x0 + h
        up = f()
        x[i] = x0 - h
        down = f()
        x[i] = x0
        grad[i] = (up - down) / (2 * h)
    return grad


@pytest.mark.parametrize("options", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("shape", [(3, 4), (5, 3)], ids=["sq<sk", "sq>sk"])
def test_gradients_match_central_differences(options, shape):
    q, k, v, dout, sink32 = problem(seed=7, seqlen_q=shape[0], seqlen_k=shape[1])
    sink = sink32.astype(np.float64)
    sink[1] = 2.5  # one head where the sink takes most of the mass

    def f():
        return loss(q, k, v, dout, sink, options)

    dq, dk, dv, d_sink = attention_backward_reference(q, k, v, dout, sink=sink, **options)
    for name, x, got in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv), ("d_sink", sink, d_sink)):
        np.testing.assert_allclose(got, central_differences(x, f), rtol=1e-6, atol=1e-8, err_msg=name)
    assert np.abs(d_sink).min() > 1e-3  # the check above is not vacuous


@pytest.mark.parametrize("options", MASKS.values(), ids=MASKS.keys())
def test_d_sink_closed_form(options):
    """d_sink[h] = −Σ_{batch, rows of head h} p_sink · rowsum(dO ∘ O), p_sink = exp(sink − lse),
    from the forward's outputs alone (FlashAttention-4's flash_bwd_postprocess reduction, with
    dLSE = 0); ``sink_gradient`` is that formula."""
    q, k, v, dout, sink = problem(seed=11, seqlen_q=6, seqlen_k=4)
    out, lse = attention_reference(q, k, v, sink=sink, **options)
    delta = (dout * out).sum(axis=-1).transpose(0, 2, 1)  # (b, hq, sq)
    p_sink = np.exp(sink.astype(np.float64)[None, :, None] - lse)
    expected = -(p_sink * delta).sum(axis=(0, 2))
    *_, d_sink = attention_backward_reference(q, k, v, dout, sink=sink, **options)
    np.testing.assert_allclose(d_sink, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sink_gradient(sink.astype(np.float64), lse, delta), expected, rtol=1e-15)


def test_a_sink_of_the_wrong_shape_is_refused():
    q, k, v, dout, _ = problem(heads_q=4)
    with pytest.raises(ValueError, match=r"expected shape \(4,\).*got \(2,\)"):
        attention_reference(q, k, v, sink=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(4,\).*got \(1, 4\)"):
        attention_backward_reference(q, k, v, dout, sink=np.zeros((1, 4), np.float32))


# ------------------------------------------------------------------ the pass criterion with a sink


def half_problem(seed=5, seqlen_q=40, seqlen_k=24, heads_q=4, heads_kv=2, d=32):
    """float16 inputs and a float32 sink, at a size where float16's rounding shows."""
    q, k, v, dout, sink = problem(seed, 2, seqlen_q, seqlen_k, heads_q, heads_kv, d)
    return (*(x.astype(np.float16) for x in (q, k, v, dout)), sink)


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (3, 0), "softcap": 2.0}],
                         ids=["full", "causal", "window+softcap"])
def test_compare_passes_a_float16_result_with_the_sink_and_rejects_one_without(options):
    """A result computed in float16 with the sink (as a kernel would give: its LSE in float32, the
    sink's on rows that see no key) passes; the same without the sink, or with LSE -inf on those
    rows (the no-sink convention), does not."""
    q, k, v, dout, sink = half_problem()
    out, lse = attention_reference(q, k, v, sink=sink, rounding_dtype=np.float16, **options)
    out, lse = out.astype(np.float16), lse.astype(np.float32)
    ratio, problems = compare_with_reference(q, k, v, out, lse, sink=sink, **options)
    assert problems == [] and ratio <= 1
    no_sink, no_sink_lse = attention_reference(q, k, v, rounding_dtype=np.float16, **options)
    ratio, problems = compare_with_reference(q, k, v, no_sink.astype(np.float16), no_sink_lse, sink=sink,
                                             **options)
    assert ratio > 1 and any("LSE" in p for p in problems)
    if options.get("causal"):
        assert compare_with_reference(q, k, v, out, lse, **options)[1]  # without sink= it fails too
    grads = attention_backward_reference(q, k, v, dout, sink=sink, rounding_dtype=np.float16, **options)
    grads = (*(g.astype(np.float16) for g in grads[:3]), grads[3].astype(np.float32))
    ratio, problems = compare_gradients_with_reference(q, k, v, dout, grads, sink=sink, **options)
    assert problems == [] and ratio <= 1
    assert compare_gradients_with_reference(q, k, v, dout, grads[:3], sink=sink, **options)[1] == []
    ratio, problems = compare_gradients_with_reference(q, k, v, dout, (*grads[:3], -grads[3]), sink=sink,
                                                       **options)
    assert ratio > 1 and problems and all(p.startswith("d_sink ") for p in problems)
    no_sink_grads = attention_backward_reference(q, k, v, dout, rounding_dtype=np.float16, **options)
    ratio, problems = compare_gradients_with_reference(q, k, v, dout, no_sink_grads, sink=sink, **options)
    assert ratio > 1 and problems
    ratio, problems = compare_gradients_with_reference(q, k, v, dout, grads, **options)
    assert ratio == np.inf and problems == ["4 gradients, expected 3 (dq, dk, dv)"]


def test_rows_without_keys_must_give_the_sinks_lse():
    q, k, v, _, sink = half_problem(seqlen_q=40, seqlen_k=24)
    out, lse = attention_reference(q, k, v, sink=sink, causal=True)
    no_key = ~visible_keys(40, 24, True).any(axis=1)
    assert no_key.sum() == 16 and (lse[:, :, no_key] == sink.astype(np.float64)[None, :, None]).all()
    assert compare_with_reference(q, k, v, out, lse.astype(np.float32), sink=sink, causal=True)[1] == []
    minus_inf = lse.copy()
    minus_inf[:, :, no_key] = -np.inf
    _, problems = compare_with_reference(q, k, v, out, minus_inf, sink=sink, causal=True)
    assert "LSE is not -inf exactly where the reference is (or has NaN)" in problems
    nonzero = out.copy()
    nonzero[:, 0] = 1e-3
    _, problems = compare_with_reference(q, k, v, nonzero, lse, sink=sink, causal=True)
    assert "rows that see no key are not exactly 0" in problems


def test_varlen_compare_with_a_sink():
    """Packed batch: a sequence without keys must give 0 and the sink's LSE (within
    ``lse_tolerance``); d_sink, summed over the sequences, is checked as a whole."""
    rng = np.random.default_rng(9)
    cu_q, cu_k = np.array([0, 20, 26, 26, 50]), np.array([0, 30, 30, 33, 60])
    hq, hkv, d = 4, 2, 32
    q = rng.standard_normal((50, hq, d)).astype(np.float16)
    k = rng.standard_normal((60, hkv, d)).astype(np.float16)
    v = rng.standard_normal((60, hkv, d)).astype(np.float16)
    dout = rng.standard_normal((50, hq, d)).astype(np.float16)
    sink = rng.standard_normal(hq).astype(np.float32)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, sink=sink, causal=True,
                                          rounding_dtype=np.float16)
    out, lse = out.astype(np.float16), lse.astype(np.float32)
    ratio, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, lse, sink=sink, causal=True)
    assert problems == [] and ratio <= 1
    bad = lse.copy()
    bad[:, 20:26] = -np.inf
    _, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, bad, sink=sink, causal=True)
    assert problems == ["sequence 1 (seqlen_q 6, seqlen_k 0): LSE of a sequence without keys is not the sink"]
    _, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, lse, causal=True)
    assert "sequence 1 (seqlen_q 6, seqlen_k 0): LSE of a sequence without keys is not -inf" in problems
    grads = varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k, sink=sink, causal=True,
                                                rounding_dtype=np.float16)
    grads = (*(g.astype(np.float16) for g in grads[:3]), grads[3].astype(np.float32))
    ratio, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, grads, sink=sink,
                                                              causal=True)
    assert problems == [] and ratio <= 1
    wrong = grads[3].copy()
    wrong[2] *= 1.5
    ratio, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, (*grads[:3], wrong),
                                                              sink=sink, causal=True)
    assert ratio > 1 and len(problems) == 1 and problems[0].startswith("d_sink max error")
    ratio, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, grads, causal=True)
    assert ratio == np.inf and problems == ["4 gradients, expected 3 (dq, dk, dv)"]


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_the_input_dtype_d_sink_is_rounded_as_autograd_in_that_dtype_would(dtype):
    """The yardstick of d_sink (``rounding_dtype=``) is FlashAttention-4's dSink one: the input-dtype
    computation ends in a value of that dtype (a sink of the input dtype gets its gradient in it),
    each row's term rounded on the way; the float64 one is not rounded."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v, dout, sink = problem(seed=5, seqlen_q=40, seqlen_k=33)
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    *_, exact = attention_backward_reference(q, k, v, dout, sink=sink)
    *_, low = attention_backward_reference(q, k, v, dout, sink=sink, rounding_dtype=dtype)
    np.testing.assert_array_equal(low, low.astype(dtype).astype(np.float64))
    assert not np.array_equal(exact, exact.astype(dtype).astype(np.float64))
    np.testing.assert_allclose(low, exact, rtol=2.0 ** -6, atol=2.0 ** -6)


def test_d_sink_from_the_stored_output_passes_and_three_times_its_error_does_not():
    """d_sink is one number a head, so FlashAttention's rule compares one error with one: taken
    from O rounded exactly to bfloat16 (D as every FlashAttention backward takes it, better than a
    kernel can do), it lands 1.48x twice the autograd computation's error on this draw (seed 75
    of 200); the yardstick is the farther of the two (``sink_yardstick``), so that passes, and an
    error three times the stored output's does not (nor one of the opposite sign)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(75)
    q, k, v, dout = (rng.standard_normal(s).astype(bf16) for s in ((1, 40, 1, 64), (1, 12, 1, 64),
                                                                       (1, 12, 1, 64), (1, 40, 1, 64)))
    sink = np.array([0.5], np.float32)
    kw = {"causal": True, "sink": sink}
    ref = attention_backward_reference(q, k, v, dout, **kw)
    stored = attention_backward_reference(q, k, v, dout, output_dtype=bf16, **kw)[3]
    low = attention_backward_reference(q, k, v, dout, rounding_dtype=bf16, **kw)[3]
    assert abs(stored - ref[3])[0] > 2 * abs(low - ref[3])[0] + 2 ** -7 * max(1.0, abs(ref[3]).max())

    def check(d_sink):
        return compare_gradients_with_reference(q, k, v, dout, (*ref[:3], d_sink), **kw)[1]

    assert check(stored.astype(np.float32)) == []
    error = stored - ref[3]
    for wrong in (ref[3] + 3 * error, ref[3] - 3 * error):
        assert any(p.startswith("d_sink max error") for p in check(wrong.astype(np.float32)))
