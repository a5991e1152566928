"""The self-test's ``--variants`` mode (issue 35: every case varlen, windowed or softcapped) and the
default mode's draws, pinned: all without a GPU."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from numbaflash import configs
from numbaflash.kernels.families import family_of
from numbaflash.tools import selftest
from numbaflash.tools.selftest_common import DRAWN_HEAD_DIMS

BOTH = ["sm90", "sm80"]
SEEDS = (0, 1, 12345, 2**32 - 1)


def _is_variant(c) -> bool:
    return c.varlen or c.window_size != (-1, -1) or c.softcap > 0


def _variant_cases(quick: bool) -> dict[str, list]:
    runs = [(s, i) for s in SEEDS for i in range(300)]
    return {"forward": [selftest.draw_case(s, i, BOTH, quick, variants=True) for s, i in runs],
            "backward": [selftest.draw_backward_case(s, i, quick, variants=True) for s, i in runs]}


@pytest.mark.parametrize("quick", [False, True])
def test_every_variants_case_is_varlen_windowed_or_softcapped(quick):
    """300 cases of a few seeds, forward and backward: each a variant, with a spread of them: about
    a third varlen, windows and softcaps often, combined, the side() sizes and one side unbounded."""
    for name, cases in _variant_cases(quick).items():
        assert all(_is_variant(c) and c.variant for c in cases), name
        n = len(cases)
        varlen = [c for c in cases if c.varlen]
        window = [c for c in cases if c.window_size != (-1, -1)]
        softcap = [c for c in cases if c.softcap > 0]
        mma = [c for c in cases if name == "backward" or c.family in selftest.VARLEN_FAMILIES]
        assert 0.25 <= len(varlen) / len(mma) <= 0.45, name  # of the cases whose family has varlen
        assert len(window) / n >= 0.5 and len(softcap) / n >= 0.3, name
        assert any(c.window_size != (-1, -1) or c.softcap for c in varlen), name  # combined
        assert any(not (c.window_size != (-1, -1) or c.softcap) for c in varlen), name  # varlen alone
        assert any(c.window_size != (-1, -1) and c.softcap for c in cases), name
        sides = {x for c in window for x in c.window_size}
        assert {0, 1, 127, 4096, -1} <= sides, name
        assert any(-1 in c.window_size for c in window), name
        assert {30.0, 50.0} <= {c.softcap for c in softcap} and len({c.softcap for c in softcap}) > 10, name
        assert any(c.amplitude > 1 for c in cases) and any(c.amplitude == 1 for c in cases), name
        assert {c.dtype for c in cases} == set(selftest.DTYPE_NAMES) and {c.causal for c in cases} == {
            False, True}, name
        max_seq, cap = selftest.LIMITS[quick][:2]
        for c in cases:
            long = c.family == "backward" and c.seqlen_q >= configs.BACKWARD_LONG_SEQLEN and c.batch == 1
            assert selftest.reference_cost(c) <= cap and (1 <= c.seqlen_q <= max_seq or long), c.describe()


def test_variants_draw_only_the_families_with_those_kernels(monkeypatch):
    """The strata hold only the families named in ``WINDOW_SOFTCAP_FAMILIES`` / ``VARLEN_FAMILIES``
    (as shipped: both families have every variant); a family with window/softcap kernels but no
    varlen one draws only windows and softcaps."""
    assert selftest.WINDOW_SOFTCAP_FAMILIES == selftest.VARLEN_FAMILIES == ("sm80", "sm90")
    shipped = [selftest.draw_case(s, i, BOTH, variants=True) for s in SEEDS for i in range(300)]
    assert all(_is_variant(c) for c in shipped)
    assert all(any(c.varlen for c in shipped if c.family == f) for f in BOTH)
    assert {selftest.draw_case(3, i, BOTH).family for i in range(300)} == set(BOTH)  # default: both
    monkeypatch.setattr(selftest, "VARLEN_FAMILIES", ("sm80",))
    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", ("sm80",))  # a family with neither
    assert selftest.variant_families(BOTH) == ["sm80"]
    assert {selftest.draw_case(3, i, BOTH, variants=True).family for i in range(300)} == {"sm80"}
    with pytest.raises(ValueError, match="window/softcap or varlen"):
        selftest.draw_case(3, 0, ["sm90"], variants=True)

    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", ("sm80", "sm90"))  # sm90: no varlen
    cases = [selftest.draw_case(s, i, BOTH, variants=True) for s in SEEDS for i in range(300)]
    assert {c.family for c in cases} == set(BOTH) and all(_is_variant(c) for c in cases)
    hopper = [c for c in cases if c.family == "sm90"]
    assert not any(c.varlen for c in hopper) and any(c.softcap for c in hopper)
    assert any(c.varlen for c in cases if c.family == "sm80")
    default = [selftest.draw_case(s, i, BOTH) for s in SEEDS for i in range(300)]
    assert any(c.window_size != (-1, -1) for c in default if c.family == "sm90")
    assert not any(c.varlen for c in default if c.family == "sm90")

    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", ())
    cases = [selftest.draw_case(1, i, BOTH, variants=True) for i in range(200)]
    assert all(c.varlen and c.window_size == (-1, -1) and not c.softcap for c in cases)


@pytest.mark.parametrize("quick", [False, True])
def test_variants_draws_are_reproducible(quick):
    """Pure in (seed, index, flags): any order gives the same case; the flag changes the case."""
    for draw in (lambda s, i: selftest.draw_case(s, i, BOTH, quick, variants=True),
                 lambda s, i: selftest.draw_backward_case(s, i, quick, variants=True)):
        forward = [draw(7, i) for i in range(100)]
        assert forward == [draw(7, i) for i in reversed(range(100))][::-1]
        assert [dataclasses.astuple(c)[1:] for c in forward] != [
            dataclasses.astuple(draw(8, i))[1:] for i in range(100)]
    assert [selftest.draw_case(7, i, BOTH, quick) for i in range(100)] != [
        selftest.draw_case(7, i, BOTH, quick, variants=True) for i in range(100)]


# Drawn by the code before --variants (commit d6060f9): the default mode must keep them bit for bit.
PINNED_FORWARD = {
    (0, 0, False, ("sm90", "sm80")): (0, 0, "sm90", 64, False, "float16", 4, 1, 867, 9, 3, "numba", 1.0, None,
                                      False, False, "long", (-1, -1), 0.0, (), ()),
    (0, 16, False, ("sm90", "sm80")): (0, 16, "sm80", 32, False, "float16", 1, 1, 5, 6, 3, "numpy",
                                       19.10036252566995, 0.11466969134690755, True, False, "", (-1, -1), 0.0,
                                       (), ()),
    (0, 17, False, ("sm90", "sm80")): (0, 17, "sm80", 32, False, "bfloat16", 5, 62, 157, 3, 1, "numba", 1.0,
                                       None, True, False, "short", (0, 49), 50.0, (0, 1, 45, 1, 62),
                                       (42, 1, 157, 1, 62)),
    (0, 18, False, ("sm90", "sm80")): (0, 18, "sm80", 32, True, "float16", 2, 10, 29, 32, 4, "numpy", 1.0,
                                       None, True, True, "", (-1, -1), 68.16304261635715, (), ()),
    (0, 24, False, ("sm90", "sm80")): (0, 24, "sm80", 96, False, "float16", 5, 256, 192, 4, 1, "torch", 1.0,
                                       0.2318038642865227, False, False, "long", (4096, 127), 0.0,
                                       (32, 256, 0, 50, 1), (40, 8, 192, 3, 1)),
    (1, 5, True, ("sm80",)): (1, 5, "sm80", 64, True, "float16", 4, 57, 57, 2, 1, "torch", 1.0, None, False,
                              False, "short", (18, 127), 0.0, (57, 53, 9, 0), (57, 53, 9, 1)),
}
PINNED_BACKWARD = {
    (0, 0, False): (0, 0, 32, False, "float16", 1, 1, 245, 6, 3, "numpy", 1.0, None, False, False, "backward",
                    (-1, -1), 0.0, (), ()),
    (0, 1, False): (0, 1, 32, False, "bfloat16", 1, 65, 92, 8, 4, "numpy", 1.0, 0.0767620780590346, False,
                    False, "backward", (127, 33), 0.0, (18,), (18,)),
    (0, 9, False): (0, 9, 96, False, "bfloat16", 4, 20, 44, 4, 4, "numpy", 1.0, 0.20281970355263237, False,
                    True, "backward", (-1, -1), 30.0, (9, 1, 20, 1), (9, 1, 1, 44)),
    (0, 11, False): (0, 11, 96, True, "bfloat16", 1, 2430, 403, 6, 2, "numpy", 1.0, 0.1997929696675276, False,
                     True, "backward", (0, 4096), 30.0, (), ()),
    (1, 3, True): (1, 3, 64, False, "float16", 1, 50, 578, 1, 1, "numpy", 1.0, 0.07756114817791994, True,
                   False, "backward", (22, -1), 0.0, (), ()),
}
# sha256 (first 16 hex digits) of the repr of every field of 300 cases x seeds 0, 1 x quick or not,
# forward (block_m fixed at 128, so that a retuned config does not move it) and backward.
PINNED_DIGESTS = ("721014eb539fc133", "c288861f867eb913")


def before_sinks(case) -> tuple:
    """A case's fields but the learnable sink (drawn from a stream of its own since issue 56: every
    other field is what it was before) and V's head dim after it (its pairs are drawn with
    ``VALUE_DIM_SHARE`` 0 where this is read)."""
    return dataclasses.astuple(case)[:-2]


def test_sinks_are_drawn_for_device_cases_of_the_forward_families_only():
    for variants, share in ((False, selftest.SINK_SHARE), (True, selftest.SINK_SHARE_VARIANTS)):
        cases = [selftest.draw_case(s, i, BOTH, False, variants) for s in (0, 1) for i in range(600)]
        with_sink = [c for c in cases if c.sink]
        assert all(c.kind != "numpy" and len(c.sink) == c.heads_q for c in with_sink)
        device = [c for c in cases if c.kind != "numpy"]
        assert abs(len(with_sink) / len(device) - share) < 0.06
        assert {c.family for c in with_sink} == set(BOTH) and any(c.varlen for c in with_sink)
        logits = np.concatenate([c.sink for c in with_sink])
        assert np.isneginf(logits).any() and (logits > 5).any()
        assert (logits == logits.astype(np.float32)).all()
        assert "sink=" in with_sink[0].describe()
    assert selftest.draw_case(0, 3, BOTH) == selftest.draw_case(0, 3, BOTH)  # pure in (seed, index)


def test_sinks_are_drawn_for_device_cases_of_the_backward():
    for variants, share in ((False, selftest.SINK_SHARE), (True, selftest.SINK_SHARE_VARIANTS)):
        cases = [selftest.draw_backward_case(s, i, False, variants) for s in (0, 1) for i in range(600)]
        with_sink = [c for c in cases if c.sink]
        assert all(c.kind != "numpy" and len(c.sink) == c.heads_q for c in with_sink)
        device = [c for c in cases if c.kind != "numpy"]
        assert abs(len(with_sink) / len(device) - share) < 0.06
        assert any(c.varlen for c in with_sink) and any(c.causal for c in with_sink)
        assert any(c.heads_q > c.heads_kv for c in with_sink)  # GQA
        assert "sink=" in with_sink[0].describe()
    assert selftest.draw_backward_case(0, 3) == selftest.draw_backward_case(0, 3)


def test_value_dims_are_drawn_for_cases_of_both_forward_families_and_the_backward(monkeypatch):
    """A share of the sm80 and sm90 families' cases (and of the backward's) take a pair of head
    dims (``configs.ASYMMETRIC_HEAD_DIMS``), on a stream of their own: with the share at 0 every
    case is what it is with pairs, but for the pair. Each family's pair cases run its config of
    the pair (``pair_config``)."""
    cases = [selftest.draw_case(s, i, BOTH) for s in (0, 1) for i in range(600)]
    pairs = [c for c in cases if c.value_dims]
    assert pairs and all(c.value_dims in DRAWN_HEAD_DIMS for c in pairs)
    assert {c.value_dims for c in pairs} == set(DRAWN_HEAD_DIMS)  # (512, 512) too: run split
    plain_case = next(c for c in cases if not c.value_dims)
    assert all(c.dims == c.value_dims for c in pairs) and plain_case.dims == (plain_case.head_dim,) * 2
    assert {c.family for c in pairs} == set(selftest.VALUE_DIM_FAMILIES) and any(c.varlen for c in pairs)
    assert {c.kind for c in pairs} == {"numpy", "numba", "torch"}
    for family in selftest.VALUE_DIM_FAMILIES:
        config = selftest.pair_config(family, (192, 128))
        assert family_of(config).name == family and (config.head_dim, config.value_dim) == (192, 128)
    eligible = [c for c in cases if c.family in selftest.VALUE_DIM_FAMILIES]
    assert abs(len(pairs) / len(eligible) - selftest.VALUE_DIM_SHARE) < 0.06
    assert "d192v128" in pairs[0].describe() and any(c.causal for c in pairs) and any(c.sink for c in pairs)
    backward = [selftest.draw_backward_case(s, i) for s in (0, 1) for i in range(600)]
    bpairs = [c for c in backward if c.value_dims]
    assert bpairs and any(c.varlen for c in bpairs)
    assert {c.kind for c in bpairs} == {"numpy", "numba", "torch"}
    assert abs(len(bpairs) / len(backward) - selftest.VALUE_DIM_SHARE) < 0.06
    monkeypatch.setattr(selftest, "VALUE_DIM_SHARE", 0.0)
    plain = [selftest.draw_case(s, i, BOTH) for s in (0, 1) for i in range(600)]
    for a, b in zip(cases, plain, strict=True):
        assert dataclasses.replace(a, value_dims=()) == b
    plain = [selftest.draw_backward_case(s, i) for s in (0, 1) for i in range(600)]
    for a, b in zip(backward, plain, strict=True):
        assert dataclasses.replace(a, value_dims=()) == b


def test_default_mode_draws_are_unchanged(monkeypatch):
    """The default mode draws what it drew before ``--variants`` (with the families of then: only
    sm80 had windows, softcaps and varlen), and with the Hopper kernel's every case is the same but
    for the window, softcap and packed sequences (which replace the dense shape) of its sm90 cases."""
    shipped = selftest.WINDOW_SOFTCAP_FAMILIES, selftest.VARLEN_FAMILIES
    monkeypatch.setattr(selftest, "VALUE_DIM_SHARE", 0.0)  # the pairs of head dims came after
    monkeypatch.setattr(selftest, "LONG_SHARE", 0.0)  # and the long query sequences
    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", ("sm80",))
    monkeypatch.setattr(selftest, "VARLEN_FAMILIES", ("sm80",))
    then = [selftest.draw_case(s, i, BOTH) for s in SEEDS for i in range(300)]
    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", shipped[0])
    monkeypatch.setattr(selftest, "VARLEN_FAMILIES", shipped[1])
    now = [selftest.draw_case(s, i, BOTH) for s in SEEDS for i in range(300)]
    variant_fields = ("window_size", "softcap", "batch", "seqlen_q", "seqlen_k", "seqlens_q", "seqlens_k")
    for a, b in zip(then, now, strict=True):
        if a.family == "sm90":
            a = dataclasses.replace(a, **{f: getattr(b, f) for f in variant_fields})
        assert a == b, (a, b)
    assert any(a != b for a, b in zip(then, now, strict=True))
    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", ("sm80",))
    monkeypatch.setattr(selftest, "VARLEN_FAMILIES", ("sm80",))
    for (seed, index, quick, families), want in PINNED_FORWARD.items():
        assert before_sinks(selftest.draw_case(seed, index, list(families), quick)) == want
    for (seed, index, quick), want in PINNED_BACKWARD.items():
        assert before_sinks(selftest.draw_backward_case(seed, index, quick)) == want

    def digest(cases):
        return hashlib.sha256(repr([before_sinks(c) for c in cases]).encode()).hexdigest()[:16]

    monkeypatch.setattr(selftest, "block_m", lambda *args: 128)
    runs = [(s, i, q) for s in (0, 1) for q in (False, True) for i in range(300)]
    assert (digest([selftest.draw_case(s, i, BOTH, q) for s, i, q in runs]),
            digest([selftest.draw_backward_case(s, i, q) for s, i, q in runs])) == PINNED_DIGESTS


def test_parser_and_replay_command_carry_variants():
    parser = selftest.build_parser()
    assert not parser.parse_args([]).variants
    args = parser.parse_args(["--variants", "--backward", "--quick", "--cases", "300"])
    assert args.variants and args.backward and args.quick and args.cases == 300
    assert selftest.replay_command(args, 77, 4) == (
        "python -m numbaflash.selftest --seed 77 --quick --backward --variants --case 4")
    args = parser.parse_args(["--variants", "--family", "sm80"])
    assert selftest.replay_command(args, 3, 9) == (
        "python -m numbaflash.selftest --seed 3 --family sm80 --variants --case 9")
    assert "--variants" in parser.format_help()


@pytest.mark.parametrize("backward", [False, True])
def test_main_with_variants(fake_hopper, capsys, backward):
    argv = ["--variants", "--quick", "--seed", "5", "--cases", "30"] + (["--backward"] if backward else [])
    assert selftest.main(argv) == 1
    text = capsys.readouterr().out
    assert len(fake_hopper) == 30 and all(_is_variant(c) for c in fake_hopper)
    assert {c.family for c in fake_hopper} == ({"backward"} if backward else set(BOTH))
    assert fake_hopper[3] == (selftest.draw_backward_case(5, 3, True, True) if backward
                              else selftest.draw_case(5, 3, BOTH, True, True))
    assert "30 variant (varlen/window/softcap) cases" in text and "window/softcap)" in text
    assert (f"replay: python -m numbaflash.selftest --seed 5 --quick{' --backward' if backward else ''} "
            "--variants --case 2") in text


def test_main_with_variants_on_a_family_without_them(fake_hopper, capsys, monkeypatch):
    monkeypatch.setattr(selftest, "WINDOW_SOFTCAP_FAMILIES", ("sm80",))  # a family with neither
    monkeypatch.setattr(selftest, "VARLEN_FAMILIES", ("sm80",))
    assert selftest.main(["--variants", "--family", "sm90", "--quick", "--seed", "5"]) == 2
    assert "sm90 has no window/softcap or varlen kernels" in capsys.readouterr().err and not fake_hopper


def test_a_case_run_on_other_inputs_says_why():
    """A numba case of a split head dim runs on torch: its line says so, not that torch was missing
    (the line a d512 backward case printed on an H200 with torch, G54d)."""
    from numbaflash.tools.selftest_common import kind_note

    assert kind_note("numba", "numba") == ""
    assert kind_note("torch", "numba") == " (torch with CUDA not importable: ran as numba)"
    note = kind_note("numba", "torch")
    assert "split head dim" in note and note.endswith("ran as torch)") and "not importable" not in note


def test_backward_draws_long_query_sequences():
    """About ``LONG_SHARE`` of the dense backward cases have one query sequence of at least
    ``configs.BACKWARD_LONG_SEQLEN`` rows (the long-sequence configs), within the reference's
    budget; none with ``quick``, a sink or packed sequences."""
    cases = [selftest.draw_backward_case(s, i) for s in (0, 1, 2) for i in range(300)]
    long = [c for c in cases if c.seqlen_q >= configs.BACKWARD_LONG_SEQLEN]
    assert abs(len(long) / len(cases) - selftest.LONG_SHARE) < 0.03
    assert all(c.batch == 1 and not c.varlen and not c.sink and c.heads_q <= 4 for c in long)
    assert all(selftest.reference_cost(c) <= selftest.LIMITS[False][1] for c in long)
    assert any(c.head_dim == 128 for c in long) and len({c.seqlen_q for c in long}) > 5
    assert not any(selftest.draw_backward_case(0, i, quick=True).seqlen_q >= configs.BACKWARD_LONG_SEQLEN
                   for i in range(300))
