"""The self-test's case drawing and command line, without a GPU (plus one GPU run of it)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import numpy as np
import pytest

from numbaflash.configs import FAMILY_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from numbaflash.tools import selftest
from numbaflash.tools.reference import varlen_attention_reference

BOTH = ["sm90", "sm80"]


@pytest.mark.parametrize("quick", [False, True])
def test_draw_case_is_deterministic_and_independent(quick):
    forward = [selftest.draw_case(42, i, BOTH, quick) for i in range(40)]
    backward = [selftest.draw_case(42, i, BOTH, quick) for i in reversed(range(40))][::-1]
    assert forward == backward
    assert selftest.draw_case(42, 17, BOTH, quick) == forward[17]
    assert [dataclasses.astuple(c)[1:] for c in forward] != [
        dataclasses.astuple(selftest.draw_case(43, i, BOTH, quick))[1:] for i in range(40)
    ]


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
@pytest.mark.parametrize("families", [BOTH, ["sm80"], ["sm90"]])
def test_consecutive_cases_cover_every_combination(seed, families):
    """Each family at its own kernel's head dims: the sm80 family at every supported one."""
    want = {(f, d, c, t) for f in families for d, c, t in
            itertools.product(FAMILY_HEAD_DIMS[f], (False, True), selftest.DTYPE_NAMES)}
    cases = [selftest.draw_case(seed, i, families) for i in range(len(want))]
    assert {(c.family, c.head_dim, c.causal, c.dtype) for c in cases} == want
    if "sm80" in families:
        assert {c.head_dim for c in cases if c.family == "sm80"} == set(SUPPORTED_HEAD_DIMS)


@pytest.mark.parametrize("quick", [False, True])
def test_sizes_within_bounds(quick):
    max_seq, cap, max_batch, max_hkv = selftest.LIMITS[quick]
    cases = [selftest.draw_case(7, i, BOTH, quick) for i in range(400)]
    for c in cases:
        assert 1 <= c.seqlen_q <= max_seq and 1 <= c.seqlen_k <= max_seq, c.describe()
        assert 1 <= c.batch <= (selftest.VARLEN_MAX_SEQUENCES if c.varlen else max_batch), c.describe()
        assert 1 <= c.heads_kv <= max_hkv, c.describe()
        assert c.heads_q % c.heads_kv == 0, c.describe()
        assert selftest.reference_cost(c) <= cap, c.describe()
        assert c.kind in selftest.KINDS and c.amplitude >= 1
    dense = [c for c in cases if not c.varlen]
    assert all(selftest.reference_cost(c) == c.batch * c.heads_q * c.seqlen_q * c.seqlen_k for c in dense)
    assert any(c.seqlen_q == 1 for c in cases) and any(c.seqlen_k == 1 for c in cases)
    assert any(c.seqlen_q % 64 and c.seqlen_q > 64 for c in cases)
    assert any(c.heads_kv == 1 and c.heads_q > 1 for c in cases)  # MQA
    assert any(c.seqlen_q > c.seqlen_k for c in cases) and any(c.seqlen_q < c.seqlen_k for c in cases)
    assert any(c.causal and c.seqlen_q >= c.seqlen_k + 2 * selftest.block_m(c.family, c.head_dim, True)
               for c in cases)
    assert any(c.amplitude >= 10 for c in cases) and any(c.softmax_scale is not None for c in cases)
    assert {c.kind for c in cases} == set(selftest.KINDS)
    assert {c.return_lse for c in cases} == {c.use_out for c in cases} == {False, True}
    if not quick:
        assert max(max(c.seqlen_q, c.seqlen_k) for c in cases) > 1000


@pytest.mark.parametrize("quick", [False, True])
def test_varlen_cases(quick):
    """About a fifth of each family's cases are packed: 1 to 6 sequences of lengths 0, 1, ragged and
    tile-sized, key lengths equal to or apart from the query lengths, within the reference budget,
    with every other parameter (GQA, causal, window, softcap, kind, LSE, out) as drawn."""
    max_seq, cap = selftest.LIMITS[quick][:2]
    cases = [selftest.draw_case(seed, i, BOTH, quick) for seed in (0, 1, 99) for i in range(400)]
    for family in BOTH:
        own = [c for c in cases if c.family == family]
        assert 0.15 <= sum(c.varlen for c in own) / len(own) <= 0.25, family
    varlen = [c for c in cases if c.varlen]
    for c in varlen:
        assert len(c.seqlens_q) == len(c.seqlens_k) == c.batch, c.describe()
        assert sum(c.seqlens_q) >= 1 and sum(c.seqlens_k) >= 1, c.describe()  # never an empty array
        assert max(c.seqlens_q) <= c.seqlen_q <= max_seq and max(c.seqlens_k) <= c.seqlen_k <= max_seq
        assert selftest.reference_cost(c) <= cap, c.describe()
        assert f"seqlens_q={','.join(map(str, c.seqlens_q))}" in c.describe()
    lengths_q = [n for c in varlen for n in c.seqlens_q]
    lengths_k = [n for c in varlen for n in c.seqlens_k]
    for lengths in (lengths_q, lengths_k):
        assert {0, 1} <= set(lengths)
        assert any(n > 64 and n % 64 for n in lengths) and any(n >= 64 and n % 64 == 0 for n in lengths)
    pairs = [(a, b) for c in varlen for a, b in zip(c.seqlens_q, c.seqlens_k, strict=True)]
    assert any(a == b > 1 for a, b in pairs) and any(a > b for a, b in pairs) and any(a < b for a, b in pairs)
    assert any(a > 0 and b == 0 for a, b in pairs) and any(a == 0 and b > 0 for a, b in pairs)
    assert {c.batch for c in varlen} == set(range(1, selftest.VARLEN_MAX_SEQUENCES + 1))
    assert any(c.seqlen_q > max(c.seqlens_q) for c in varlen)  # maxima above the longest sequence
    assert {c.causal for c in varlen} == {c.return_lse for c in varlen} == {c.use_out for c in varlen} == {
        False, True}
    assert any(c.heads_q > c.heads_kv for c in varlen) and {c.dtype for c in varlen} == set(
        selftest.DTYPE_NAMES)
    assert any(c.window_size != (-1, -1) for c in varlen) and any(c.softcap for c in varlen)
    assert {c.kind for c in varlen} == set(selftest.KINDS)
    if not quick:
        assert max(lengths_q) > 1000


def test_varlen_drawing_is_reproducible():
    """The varlen draw has its own stream, from (seed, index) alone: replaying one index gives the
    same case, and ``draw_varlen`` alone gives its sequences."""
    for i in range(200):
        c = selftest.draw_case(11, i, ["sm80"])
        assert selftest.draw_case(11, i, ["sm80"]) == c
        drawn = selftest.draw_varlen(11, i, c.heads_q)
        assert drawn == ((c.seqlens_q, c.seqlens_k, c.seqlen_q, c.seqlen_k) if c.varlen else None)


def test_varlen_inputs_and_offsets():
    c = next(c for i in range(400) if (c := selftest.draw_case(3, i, ["sm80"])).varlen and 0 in c.seqlens_q)
    q, k, v = selftest.make_inputs(c)
    cu_q, cu_k = selftest.varlen_offsets(c)
    assert cu_q.dtype == cu_k.dtype == np.int32 and len(cu_q) == len(cu_k) == c.batch + 1
    assert q.shape == (cu_q[-1], c.heads_q, c.head_dim) and k.shape == v.shape == (cu_k[-1], c.heads_kv,
                                                                                    c.head_dim)
    assert list(np.diff(cu_q)) == list(c.seqlens_q) and list(np.diff(cu_k)) == list(c.seqlens_k)
    np.testing.assert_array_equal(selftest.make_inputs(c)[0], q)


def _varlen_case(**want):
    """The first sm80 varlen case of seed 5 with a sequence without keys and these fields."""
    for i in range(2000):
        c = selftest.draw_case(5, i, ["sm80"])
        if (c.varlen and any(a and not b for a, b in zip(c.seqlens_q, c.seqlens_k, strict=True))
                and all(getattr(c, f) == x for f, x in want.items())):
            return c
    raise AssertionError(f"no such case: {want}")


@pytest.mark.parametrize("use_out", [False, True])
def test_run_varlen_case_with_a_stand_in(monkeypatch, use_out):
    """``run_case`` on a numpy varlen case calls ``flash_attention_varlen`` with numpy int32
    offsets, the case's maxima and options and a NaN-poisoned out, and checks each sequence: a
    stand-in computing float64 passes, one that leaves a row of a keyless sequence unwritten fails."""
    import numbaflash

    case = _varlen_case(kind="numpy", use_out=use_out, return_lse=True, dtype="float16")
    calls = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, window_size, softcap,
                 return_lse, out, broken=False):
        assert isinstance(cu_q, np.ndarray) and cu_q.dtype == np.int32 and cu_k.dtype == np.int32
        assert (max_q, max_k) == (case.seqlen_q, case.seqlen_k)
        assert (out is not None) == case.use_out and (out is None or np.isnan(out.astype(np.float32)).all())
        options = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size,
                   "softcap": softcap}
        got, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, rounding_dtype=q.dtype, **options)
        _, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, **options)
        got = got.astype(q.dtype)
        if broken:
            b = next(b for b in range(len(cu_q) - 1) if cu_q[b + 1] > cu_q[b] and cu_k[b + 1] == cu_k[b])
            got[cu_q[b]] = np.nan
        if out is not None:
            out[...] = got
            got = out
        calls.append(1)
        return (got, lse.astype(np.float32)) if return_lse else got

    monkeypatch.setattr(numbaflash, "flash_attention_varlen", stand_in)
    result = selftest.run_case(case, (8, 0))
    assert result.ok and calls, (case.describe(), result.message)
    monkeypatch.setattr(numbaflash, "flash_attention_varlen",
                        lambda *a, **kw: stand_in(*a, **kw, broken=True))
    result = selftest.run_case(case, (8, 0))
    assert not result.ok and "without keys are not exactly 0" in result.message, result.message


def test_describe_names_the_parameters():
    c = selftest.draw_case(5, 3, BOTH)
    text = c.describe()
    for part in (c.family, f"d{c.head_dim}", c.dtype, f"sq{c.seqlen_q}", f"sk{c.seqlen_k}", c.kind):
        assert part in text


def test_case_list_parsing():
    parser = selftest.build_parser()
    args = parser.parse_args(["--case", "3,17", "--case", "5", "--seed", "9", "--quick", "-v"])
    assert args.case == [[3, 17], [5]] and args.seed == 9 and args.quick and args.verbose
    assert selftest.parse_case_list("4") == [4]
    assert selftest.parse_case_list("1, 2,3") == [1, 2, 3]
    for bad in ("x", "-1", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            selftest.parse_case_list(bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["--case", "a,b"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--family", "sm70"])


def test_replay_command():
    args = selftest.build_parser().parse_args(["--quick", "--family", "sm80"])
    assert selftest.replay_command(args, 77, 4) == (
        "python -m numbaflash.selftest --seed 77 --quick --family sm80 --case 4"
    )


def test_main_without_gpu_returns_2(monkeypatch, capsys):
    import numba.cuda

    monkeypatch.setattr(numba.cuda, "is_available", lambda: False)
    assert selftest.main(["--quick", "--seed", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_selftest_passes_on_gpu():
    assert selftest.main(["--quick", "--seed", "1234"]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variants", [False, True])
def test_quick_decode_selftest_passes_on_gpu(variants):
    assert selftest.main(["--decode", "--quick", "--seed", "1234", "--cases", "30"]
                         + (["--variants"] if variants else [])) == 0
