"""The backward's sliding window and softcap (issue 35) on the CPU: the key block's walk range
(``blocks.band_query_blocks``) against brute force and as the inverse of the forward's tile range,
deterministic mode's turns simulated to completion (no deadlock, each query block's dQ summed in
key-block order), the transposed edge mask, the float64 reference against torch autograd of the
formula, which main kernel a call runs with which arguments, and validation before anything is
compiled."""

from __future__ import annotations

import numpy as np
import pytest
from test_window_softcap_cpu import BAND_CASES, backward_args, band_of, no_compile  # noqa: F401

import numbaflash
from numbaflash.kernels import backward_mma, blocks
from numbaflash.kernels.families import kernel_abi, make_kernel, spec_of
from numbaflash.operations import backward, forward
from numbaflash.tools.reference import attention_backward_reference, visible_keys

band_query_blocks = blocks.band_query_blocks.py_func
band_kv_tiles = blocks.band_kv_tiles.py_func
band_needs_mask = blocks.band_needs_mask.py_func
key_block_of = blocks.key_block_of.py_func
mask_band_transposed = blocks.mask_band_transposed.py_func

BLOCKS = [(64, 128), (128, 128), (64, 64)]  # (block_m, block_n) of the backward's configs
# The forward's band cases (edges and a few random draws), each with one of the tiles in turn.
BLOCK_CASES = [(*case, *BLOCKS[i % len(BLOCKS)]) for i, case in enumerate(BAND_CASES)]


# ------------------------------------------------------------------ the walk's range


@pytest.mark.parametrize(("sq", "sk", "window", "block_m", "block_n"), BLOCK_CASES)
def test_band_query_blocks(sq, sk, window, block_m, block_n):
    """Every row that sees a key of the block lies in the range; the first and the last block of
    the range each hold such a row; a key block no row sees gets an empty range; and it is the
    inverse of ``band_kv_tiles`` (the forward's range), each side with its real extent."""
    seen = visible_keys(sq, sk, False, window)
    band = band_of(sq, sk, window)
    for n0 in range(0, sk, block_n):
        keys = min(block_n, sk - n0)
        first, end = band_query_blocks(n0, keys, block_m, sq, band)
        rows = np.flatnonzero(seen[:, n0:n0 + keys].any(axis=1))
        if rows.size == 0:
            assert first == end
        else:
            assert rows[0] // block_m == first and rows[-1] // block_m == end - 1
        for m0 in range(0, sq, block_m):
            kv_first, kv_end = band_kv_tiles(m0, min(block_m, sq - m0), block_n, band)
            assert (first <= m0 // block_m < end) == (kv_first <= n0 // block_n < kv_end), (m0, n0)


# ------------------------------------------------------------------ deterministic mode's turns


def simulate_turns(sq, sk, window, block_m, block_n, pairs, tail_pairs, resident):
    """The main kernel's CTAs in launch order (``key_block_of``), at most ``resident`` at a time
    (a new one starts only when one finishes, as a GPU's CTAs do), each walking its query blocks
    top-down and, at each, waiting until the block's counter equals its turn (its key block less
    the block's ``band_kv_tiles`` first), then adding and advancing it. Returns, per (pair, query
    block), the key blocks in the order they added; fails on a deadlock."""
    band = band_of(sq, sk, window)
    key_blocks = -(-sk // block_n)
    ctas = [key_block_of(c, key_blocks, pairs, tail_pairs) for c in range(key_blocks * pairs)]

    def walk(n_block):
        n0 = n_block * block_n
        first, end = band_query_blocks(n0, min(block_n, sk - n0), block_m, sq, band)
        return list(range(end - 1, first - 1, -1))

    counters, order = {}, {}
    running, waiting = [], list(ctas)
    while waiting or running:
        while waiting and len(running) < resident:
            n_block, pair = waiting.pop(0)
            running.append([n_block, pair, walk(n_block)])
        progressed = False
        for cta in list(running):
            n_block, pair, todo = cta
            while todo:
                m = todo[0]
                m0 = m * block_m
                turn = n_block - band_kv_tiles(m0, min(block_m, sq - m0), block_n, band)[0]
                if counters.get((pair, m), 0) != turn:
                    break
                counters[(pair, m)] = turn + 1
                order.setdefault((pair, m), []).append(n_block)
                todo.pop(0)
                progressed = True
            if not todo:
                running.remove(cta)
                progressed = True
        assert progressed, f"deadlock: {running}"
    return order


@pytest.mark.parametrize(("sq", "sk", "window"), [
    (300, 129, (0, 0)), (129, 300, (1, 0)), (500, 500, (127, 0)), (64, 700, (5, 90)), (700, 64, (-1, 3)),
    (500, 500, (70, -1)), (129, 300, (200, 200)), (700, 64, (0, 0))])  # each window once, sq < / = / > sk
@pytest.mark.parametrize("resident", [1, 3, 100])
def test_deterministic_turns_complete_in_key_block_order(sq, sk, window, resident):
    """With CTAs skipping the query blocks outside the window, every query block is added to by
    the key blocks that see it, each once, in increasing order, and no CTA waits forever, for
    any number of resident CTAs (1: each CTA must finish alone, after those launched before it),
    in the plain and the interleaved launch orders."""
    block_m, block_n = 64, 128
    seen = visible_keys(sq, sk, False, window)
    for pairs, tail_pairs in ((2, 0), (3, 2)):
        order = simulate_turns(sq, sk, window, block_m, block_n, pairs, tail_pairs, resident)
        for pair in range(pairs):
            for m0 in range(0, sq, block_m):
                keys = np.flatnonzero(seen[m0:m0 + block_m].any(axis=0))
                expected = sorted({int(j) // block_n for j in keys})
                assert order.get((pair, m0 // block_m), []) == expected


# ------------------------------------------------------------------ the transposed mask


@pytest.mark.parametrize(("sq", "sk"), [(40, 200), (200, 40), (100, 100)])
@pytest.mark.parametrize("window", [(0, 0), (3, 1), (17, -1), (-1, 5), (2, 40)])
def test_mask_band_transposed_matches_the_rule(sq, sk, window):
    """Every lane's fragment of a 16-key m-tile against 64 queries: -inf exactly where the rule
    hides the key from the query (keys past the end hidden from every query); where
    ``band_needs_mask`` (keys as columns) says a warp's tile needs none, all of it is seen."""
    seen = np.zeros((sq + 64, sk + 16), bool)
    seen[:sq, :sk] = visible_keys(sq, sk, False, window)
    band = band_of(sq, sk, window)
    n_tiles = 8  # 64 queries
    for key0 in range(0, sk, 16):
        for col0 in range(0, sq, 64):
            if not band_needs_mask(key0, 16, col0, 64, band):
                assert seen[col0:col0 + 64, key0:key0 + 16][: sq - col0].all()
            for lane in range(32):
                s = np.ones((n_tiles, 4), np.float32)
                mask_band_transposed(s, n_tiles, key0, col0, lane, band)
                g, t = lane // 4, lane % 4
                for j in range(n_tiles):
                    for e in range(4):
                        key, query = key0 + g + 8 * (e // 2), col0 + 2 * t + 8 * j + e % 2
                        if query < sq:
                            assert (s[j, e] == 1) == seen[query, key], (key0, col0, lane, j, e)


# ------------------------------------------------------------------ the float64 reference


@pytest.mark.parametrize(("causal", "window", "softcap"), [
    (False, (3, 1), 0.0), (True, (5, -1), 0.0), (False, (-1, -1), 2.0), (False, (2, 7), 1.5),
    (True, (0, 0), 0.0), (False, (0, -1), 3.0),
])
def test_backward_reference_matches_torch_autograd(causal, window, softcap):
    """``attention_backward_reference`` with a window and a softcap against torch float64 autograd
    of the plain formula (rows that see nothing: zero gradients)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    b, sq, sk, hq, hkv, d = 2, 13, 21, 4, 2, 16
    q = rng.normal(size=(b, sq, hq, d)) * 2
    k = rng.normal(size=(b, sk, hkv, d)) * 2
    v = rng.normal(size=(b, sk, hkv, d))
    dout = rng.normal(size=(b, sq, hq, d))
    scale = 0.3
    dq, dk, dv = attention_backward_reference(q, k, v, dout, causal=causal, softmax_scale=scale,
                                              window_size=window, softcap=softcap)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    kk = tk.repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    vv = tv.repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    s = tq.transpose(1, 2) @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = torch.tensor(visible_keys(sq, sk, causal, window))
    s = s.masked_fill(~seen, -torch.inf)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    out = (p @ vv).transpose(1, 2)
    out.backward(torch.tensor(dout))
    for got, want in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-9, atol=1e-12)


def _softcap_gradients(q, k, v, dout, scale, cap, t_error=0.0, slope=True):
    """Dense softcapped gradients (one head per kv head) in float64, t = tanh(QKᵀ·scale/cap)
    times (1 + t_error) in the derivative, or no derivative at all (``slope`` False)."""
    qf, kf, vf, dof = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    t = np.tanh(qf @ kf.transpose(0, 1, 3, 2) * scale / cap)
    p = np.exp(cap * t - (cap * t).max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = dof @ vf.transpose(0, 1, 3, 2)
    delta = (dof * (p @ vf)).sum(-1, keepdims=True)
    tb = t * (1 + t_error)
    ds = p * (dp - delta) * ((1 - tb * tb) if slope else 1.0)
    grads = (ds @ kf * scale, ds.transpose(0, 1, 3, 2) @ qf * scale, p.transpose(0, 1, 3, 2) @ dof)
    return tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in grads)


def test_softcap_yardstick_rounds_t_and_still_rejects_wrong_slopes():
    """FlashAttention's criterion with a softcap: the input-dtype yardstick rounds t = tanh(.) to
    the dtype, as ``torch.tanh`` on float16 does in the autograd reference FlashAttention's own
    tests use, so its error reflects t's rounding (near saturation 1 - t² loses digits). The
    criterion still passes exact gradients and rejects a backward without the tanh's derivative
    and one whose t is off by 2^-10 (twice tanh.approx's worst case)."""
    from numbaflash.tools.reference import compare_gradients_with_reference
    rng = np.random.default_rng(45)
    b, s, h, d, scale, cap = 1, 7, 2, 64, 0.125, 4.0
    q, k = (rng.normal(size=(b, s, h, d)) * 5.6 for _ in range(2))  # scores deep in saturation
    v, dout = (rng.normal(size=(b, s, h, d)) for _ in range(2))
    q, k, v, dout = (x.astype(np.float16) for x in (q, k, v, dout))
    kw = {"softmax_scale": scale, "softcap": cap}
    exact = _softcap_gradients(q, k, v, dout, scale, cap)
    for got, want in zip(exact, attention_backward_reference(q, k, v, dout, **kw), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    low = attention_backward_reference(q, k, v, dout, rounding_dtype=np.float16, **kw)
    t = np.tanh(np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale / cap)
    assert np.abs(t).max() > 0.99  # the case tests saturation
    assert compare_gradients_with_reference(q, k, v, dout, low, **kw)[0] <= 0.5
    for wrong in (_softcap_gradients(q, k, v, dout, scale, cap, slope=False),
                  _softcap_gradients(q, k, v, dout, scale, cap, t_error=2.0**-10)):
        ratio, problems = compare_gradients_with_reference(q, k, v, dout, wrong, **kw)
        assert ratio > 1 and problems


# ------------------------------------------------------------------ the variant a call runs


@pytest.mark.parametrize(("causal", "window", "softcap", "variant", "config_causal", "sides"), [
    (False, (-1, -1), 0.0, (False, False), False, (0, 0)),
    (True, (-1, -1), 0.0, (False, False), True, (0, 0)),
    (False, (64, 0), 0.0, (True, False), True, (64, 0)),
    (True, (64, 5), 0.0, (True, False), True, (64, 0)),
    (False, (-1, 3), 0.0, (True, False), True, (forward.WINDOW_UNBOUNDED, 3)),
    (False, (7, -1), 0.0, (True, False), False, (7, forward.WINDOW_UNBOUNDED)),
    (False, (-1, -1), 30.0, (False, True), False, (0, 0)),
    (True, (-1, -1), 30.0, (False, True), True, (0, 0)),
    (False, (10, 10), 50.0, (True, True), True, (10, 10)),
    (False, (5000, 5000), 0.0, (False, False), False, (0, 0)),  # wider than the problem: no window
])
def test_backward_variant(causal, window, softcap, variant, config_causal, sides):
    """The forward's choice (``variant_of``) with the backward's main kernel; plain calls keep
    their exponent factor (softmax_scale·log2(e)), softcap ones get softcap·log2(e)."""
    scale = 0.125
    var = backward.backward_variant(causal, window, softcap, scale, 300, 400)
    assert (var.window, var.softcap) == variant and var.causal == config_causal
    assert (var.window_left, var.window_right) == sides
    factor = softcap if softcap else scale
    assert var.scale_log2 == np.float32(factor * backward.LOG2_E)
    assert var.cap_scale == np.float32(scale / softcap if softcap else 0.0)


def test_backward_variant_specs():
    config = backward.configs.backward_config((8, 0), 64, True, 163 * 1024)
    specs = [spec_of(config, "backward", causal=True, window=w, softcap=c) for w in (True, False)
             for c in (True, False)]
    assert {kernel_abi(s) for s in specs} == {kernel_abi(spec_of(config, "backward"))}
    assert [s.causal for s in specs] == [False, False, True, True]  # a window kernel: built non-causal


def test_window_kernel_is_built_non_causal():
    config = backward.configs.backward_config((8, 0), 64, True, 163 * 1024)
    with pytest.raises(ValueError, match="right edge 0"):
        backward_mma.make_backward_kernel(config, True, False, window=True)
    window = spec_of(config, "backward", False, causal=True, window=True)
    assert make_kernel(window).__name__.endswith("_window_f16")
    name = make_kernel(spec_of(config, "backward", True, causal=True, softcap=True)).__name__
    assert name.endswith("_causal_softcap_bf16")


# ------------------------------------------------------------------ validation before anything


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"window_size": (-2, 0)}, ValueError, "window_size must be"),
    ({"window_size": (0, -5)}, ValueError, "window_size must be"),
    ({"window_size": (1, 2, 3)}, TypeError, "window_size must be a pair"),
    ({"window_size": (1.5, 0)}, TypeError, "window_size must be a pair"),
    ({"window_size": None}, TypeError, "window_size must be a pair"),
    ({"softcap": -1.0}, ValueError, "softcap must be 0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be 0"),
    ({"softcap": "30"}, TypeError, "softcap must be a real number"),
    ({"softcap": True}, TypeError, "softcap must be a real number"),
    ({"softcap": 1e-45}, ValueError, "normal float32"),
])
def test_backward_rejects_bad_window_and_softcap(kwargs, error, match, no_compile):  # noqa: F811
    with pytest.raises(error, match=match):
        numbaflash.flash_attention_backward(*backward_args(), **kwargs)


@pytest.mark.parametrize("kwargs", [{"window_size": (0, 0)}, {"window_size": [3, -1]},
                                    {"window_size": (np.int64(4), 0), "softcap": np.float32(30)},
                                    {"softcap": 50}, {"causal": True, "window_size": (2, 9)}])
def test_backward_good_window_and_softcap_reach_the_kernels(kwargs, no_compile):  # noqa: F811
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention_backward(*backward_args(), **kwargs)


def test_backward_passes_window_and_softcap_on(monkeypatch):
    """The API hands the validated window and softcap to the operation (numpy path)."""
    seen = []

    def run_numpy(*args):
        seen.append(args[-2:])
        raise AssertionError("would compile")

    monkeypatch.setattr(backward.gpu_state.GPU, "current", lambda: ((8, 0), 0))
    monkeypatch.setattr(backward, "run_numpy", run_numpy)
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention_backward(*backward_args(), window_size=[3, np.int64(-1)],
                                            softcap=np.float32(30))
    assert seen == [((3, -1), 30.0)] and type(seen[0][1]) is float
