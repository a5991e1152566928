"""The self-test's case drawing and command line, without a GPU (plus one GPU run of it)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import pytest

from numbaflash.configs import FAMILY_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from numbaflash.tools import selftest

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
        assert 1 <= c.batch <= max_batch and 1 <= c.heads_kv <= max_hkv, c.describe()
        assert c.heads_q % c.heads_kv == 0, c.describe()
        assert c.batch * c.heads_q * c.seqlen_q * c.seqlen_k <= cap, c.describe()
        assert c.kind in selftest.KINDS and c.amplitude >= 1
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
