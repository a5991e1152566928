"""CPU tests of benchmarks/autotune.py's pure parts: the command line (forward and --backward),
which backward candidates run under a shared-memory limit, the table entry written for a
BackwardConfig (its key, its JSON round trip, what the dispatcher then picks, the forward's
entries untouched) and the choice of the winner."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _benchmarks import load_benchmark

from numbaflash import configs
from numbaflash.kernels.shapes import BackwardConfig

pytest.importorskip("torch")  # autotune imports it at the top (a GPU is needed only to run it)
autotune = load_benchmark("autotune")

HOPPER, AMPERE, SM86 = (9, 0), (8, 0), (8, 6)


# --------------------------------------------------------------------------- command line


def test_forward_command_line_is_unchanged():
    args = autotune.parse_args([])
    assert not args.backward and not args.write and args.causal == "both"
    assert args.seqlen == 4096 and args.head_dims == list(configs.SUPPORTED_HEAD_DIMS)
    assert args.family == "auto" and args.only is None and args.key is None and args.rounds == 1
    args = autotune.parse_args(["--short", "--seqlen", "2048", "--only", "ws", "--key", "sm86", "--write"])
    assert args.short and args.seqlen == 2048 and args.only == "ws" and args.key == "sm86" and args.write
    with pytest.raises(SystemExit):
        autotune.parse_args(["--short"])  # --seqlen 4096 is not short
    with pytest.raises(SystemExit):
        autotune.parse_args(["--long", "--short", "--seqlen", "8192"])


def test_backward_command_line():
    args = autotune.parse_args(["--backward", "--head-dims", "64", "128", "--causal", "causal",
                                "--match", "key_tiles=2", "--rounds", "3", "--seqlen", "8192", "--write"])
    assert args.backward and args.write and args.head_dims == [64, 128] and args.causal == "causal"
    assert args.match == ["key_tiles=2"] and args.rounds == 3 and args.seqlen == 8192
    assert autotune.CAUSAL_CHOICES[args.causal] == (True,)
    assert autotune.CAUSAL_CHOICES["both"] == (False, True) and autotune.CAUSAL_CHOICES["full"] == (False,)
    assert autotune.parse_args(["--backward"]).head_dims == list(configs.BACKWARD_CANDIDATES)


@pytest.mark.parametrize("flags", [["--only", "mma"], ["--family", "sm80"], ["--key", "sm86"],
                                   ["--short", "--seqlen", "1024"], ["--long", "--seqlen", "8192"],
                                   ["--head-dims", "64", "48"], ["--causal", "both-ways"]])
def test_backward_rejects_forward_only_flags_and_unknown_head_dims(flags, capsys):
    with pytest.raises(SystemExit):
        autotune.parse_args(["--backward", *flags])
    assert "error" in capsys.readouterr().err


# --------------------------------------------------------------------------- runnable candidates


@pytest.mark.parametrize("head_dim", sorted(configs.BACKWARD_CANDIDATES))
@pytest.mark.parametrize("cap", [HOPPER, AMPERE, SM86])
def test_runnable_candidates_are_those_that_fit(head_dim, cap):
    limit = configs.max_shared_bytes(cap)
    fit, too_big = autotune.runnable_backward_candidates(head_dim, limit)
    every = configs.BACKWARD_CANDIDATES[head_dim]
    assert sorted(fit + too_big, key=every.index) == every  # a partition, in the table's order
    assert fit == [c for c in every if c in fit]
    assert all(c.shared_bytes <= limit for c in fit) and all(c.shared_bytes > limit for c in too_big)
    if fit:  # the first that fits is what dispatch runs with no table entry (the defaults come first)
        assert fit[0] == next(c for c in configs.BACKWARD_DEFAULTS[head_dim] if c.shared_bytes <= limit)


def test_runnable_candidates_at_known_limits():
    every = configs.BACKWARD_CANDIDATES
    assert autotune.runnable_backward_candidates(128, configs.max_shared_bytes(HOPPER)) == (every[128], [])
    fit, too_big = autotune.runnable_backward_candidates(256, configs.max_shared_bytes(AMPERE))  # 163 KB
    assert {c.q_stages for c in fit} == {1} and {c.q_stages for c in too_big} == {2}
    assert autotune.runnable_backward_candidates(256, configs.max_shared_bytes(SM86))[0] == []  # 99 KB
    fit, _ = autotune.runnable_backward_candidates(128, configs.max_shared_bytes(SM86))
    assert fit and all(c.block_n == 64 and c.q_stages == 1 for c in fit)
    edge = every[64][0]
    assert edge in autotune.runnable_backward_candidates(64, edge.shared_bytes)[0]  # the limit is inclusive
    assert edge in autotune.runnable_backward_candidates(64, edge.shared_bytes - 1)[1]


def test_match_filters_candidates_before_the_limit():
    fit, too_big = autotune.runnable_backward_candidates(128, configs.max_shared_bytes(AMPERE),
                                                         ["key_tiles=2"])
    assert fit and all(c.key_tiles == 2 for c in fit + too_big)
    assert fit + too_big == [c for c in configs.BACKWARD_CANDIDATES[128] if c.key_tiles == 2]
    fit, too_big = autotune.runnable_backward_candidates(64, 10**6, ["block_n=64", "q_stages=1"])
    assert fit == [c for c in configs.BACKWARD_CANDIDATES[64] if c.block_n == 64 or c.q_stages == 1]
    assert not too_big


# --------------------------------------------------------------------------- the table entry


@pytest.fixture
def table_now(monkeypatch):
    """``table_now(table)``: the dispatcher reads ``table`` as the tuned table, for this test."""
    def patch(table: dict) -> None:
        monkeypatch.setattr(configs, "_table", lambda: table)
        configs._backward_choice.cache_clear()
        configs._table_choice.cache_clear()

    yield patch
    configs._backward_choice.cache_clear()
    configs._table_choice.cache_clear()


@pytest.mark.parametrize("causal", [False, True])
def test_backward_entry_round_trips_under_its_key(causal):
    for d, candidates in configs.BACKWARD_CANDIDATES.items():
        for cand in candidates:
            table: dict = {}
            key = autotune.record_backward(table, cand, causal, 123.456)
            assert key == configs.backward_table_key(d, causal)
            assert key == f"sm80bwd/d{d}/{'causal' if causal else 'full'}"
            assert list(table) == [key]
            entry = json.loads(json.dumps(table))[key]  # as --write stores it and the table is read
            assert entry == {**configs.config_to_json(cand), "tflops": 123.5}
            assert entry["kernel"] == "mma_bwd" and entry["head_dim"] == d
            assert configs.config_from_json(entry) == cand


def test_recording_leaves_the_forward_entries_alone(table_now):
    shipped = json.loads(configs.TABLE_PATH.read_text())
    table = json.loads(json.dumps(shipped))
    before = {k: v for k, v in table.items() if not k.startswith("sm80bwd/")}
    assert before  # the shipped table has forward entries
    forward_before = {(cap, d, causal): configs.forward_config(cap, d, causal)
                      for cap in (HOPPER, AMPERE, SM86) for d in configs.SUPPORTED_HEAD_DIMS
                      for causal in (False, True)}
    won = {(128, True): BackwardConfig(128, block_m=64, block_n=64, q_stages=1),
           (64, False): BackwardConfig(64, block_m=64, block_n=128, q_stages=1, key_tiles=2, dq_tiles=2)}
    for (_, causal), cand in won.items():
        autotune.record_backward(table, cand, causal, 100.0)
    assert {k: v for k, v in table.items() if not k.startswith("sm80bwd/")} == before
    assert set(table) - set(shipped) <= {configs.backward_table_key(d, c) for d, c in won}
    assert json.loads(configs.TABLE_PATH.read_text()) == shipped  # recording writes nothing
    table_now(json.loads(json.dumps(table, indent=1) + "\n"))
    for (d, causal), cand in won.items():  # the dispatcher picks the winners up (on Hopper at d64
        # and d128 for the packed variable-length calls: the others run Hopper's own backward)
        assert configs.backward_config(HOPPER, d, causal, varlen=True) == \
            configs.backward_for_target(cand, HOPPER)
        assert configs.backward_config(SM86, d, causal) == cand  # both fit in 99 KB
    for (cap, d, causal), config in forward_before.items():
        assert configs.forward_config(cap, d, causal) == config


def test_a_winner_too_big_for_a_gpu_is_passed_over_there(table_now):
    big = configs.BACKWARD_CANDIDATES[128][0]  # 161 KB
    table: dict = {}
    autotune.record_backward(table, big, False, 1.0)
    table_now(table)
    assert configs.backward_config(HOPPER, 128, False, varlen=True) == \
        configs.backward_for_target(big, HOPPER)
    assert configs.backward_config(SM86, 128, False).shared_bytes <= configs.max_shared_bytes(SM86)


# --------------------------------------------------------------------------- the winner


def test_best_of_takes_the_fastest_mean_and_skips_failures(capsys):
    a, b, c = configs.BACKWARD_CANDIDATES[64][:3]
    timed = {a: [2.0, 2.2], b: [1.9, 2.1], c: None}
    cand, tflops = autotune.best_of("sm80bwd/d64/full", timed, flops=2e9)
    assert cand == b and tflops == pytest.approx(2e9 / 2.0 / 1e9)
    out = capsys.readouterr().out
    assert out.count("TFLOP/s") == 2 and "rounds:" in out and str(c) not in out
    assert autotune.best_of("sm80bwd/d64/full", {a: None}, flops=1.0) is None


# --------------------------------------------------------------------------- the backward run's flow


def test_tune_backward_times_what_fits_and_passes(monkeypatch, capsys):
    """tune_backward with the GPU parts replaced: a candidate too big for the limit is not checked,
    a wrong one and one that fails are not timed, the fastest of the rest is recorded under its
    key (each causality asked for), each timed under force_config, and nothing else changes."""
    from types import SimpleNamespace

    cands = configs.BACKWARD_CANDIDATES[64]
    limit = 90_000
    fit = [c for c in cands if c.shared_bytes <= limit]
    wrong, broken, fastest = fit[0], fit[1], fit[2]
    speed = {c: 2.0 + i for i, c in enumerate(fit)}
    speed[fastest] = 1.0
    checked, forced_while_timed = [], []

    def check(config, cap, causal, problems):
        checked.append(config)
        if config == broken:
            raise RuntimeError("no launch")
        return ["dq max error"] if config == wrong else []

    def timed(fn, **kw):
        fn()
        config = configs.backward_config(HOPPER, 64, current["causal"])
        assert config.dq_vector == 4  # what an H100 compiles
        config = dataclasses.replace(config, dq_vector=1)
        forced_while_timed.append(config)
        return speed[config]

    current = {}
    fake_torch = SimpleNamespace(float16="fp16", randn=lambda *shape, device, dtype: object(),
                                 empty_like=lambda x: object())
    monkeypatch.setattr(autotune, "torch", fake_torch)
    monkeypatch.setattr(autotune, "device_shared_limit", lambda: limit)
    monkeypatch.setattr(autotune, "backward_check_problems", lambda d, causal: current.update(causal=causal))
    monkeypatch.setattr(autotune, "check_backward", check)
    monkeypatch.setattr(autotune, "flash_attention", lambda *a, **kw: (object(), object()))
    monkeypatch.setattr(autotune, "flash_attention_backward", lambda *a, **kw: None)
    monkeypatch.setattr(autotune, "time_ms", timed)
    table = {"sm90/d64/full": {"kernel": "ws", "head_dim": 64}}
    args = autotune.parse_args(["--backward", "--head-dims", "64", "--rounds", "2"])
    autotune.tune_backward(args, HOPPER, table)
    assert checked == fit * 2  # each causality; the too-big ones are not checked
    runs = [c for c in fit if c not in (wrong, broken)] * 4  # 2 rounds x 2 causalities
    assert sorted(forced_while_timed, key=fit.index) == sorted(runs, key=fit.index)
    assert set(table) == {"sm90/d64/full", "sm80bwd/d64/full", "sm80bwd/d64/causal"}
    assert table["sm90/d64/full"] == {"kernel": "ws", "head_dim": 64}
    for causal in (False, True):
        entry = table[configs.backward_table_key(64, causal)]
        assert configs.config_from_json(entry) == fastest
    out = capsys.readouterr().out
    assert "WRONG, not timed" in out and "failed: no launch" in out and "skipped: needs" in out
    assert not configs.OVERRIDES
