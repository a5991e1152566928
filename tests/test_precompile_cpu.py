"""What ``python -m numbaflash.precompile`` builds: every kernel a target may run unforced, plain and
in the window, softcap and varlen variants, each a kernel the registry ships (``tools.registry``:
precompile covers registered kernels, it adds none), and the line that says how many. No kernel
is compiled: the registry's factories are stubbed, and ``precompile`` runs with a fake build."""

from __future__ import annotations

import dataclasses
import types

import pytest

from numbaflash import configs
from numbaflash.kernels.families import BACKWARD_OPERATIONS
from numbaflash.tools import precompile, registry

ARCHES = ("sm_80", "sm_86", "sm_90a")


def _unpinned(spec):
    """A spec without its target: the registry builds each kernel for its family's target, precompile
    for the one asked."""
    return dataclasses.replace(spec, arch="")


@pytest.fixture(scope="module")
def registered_specs():
    """The spec of every kernel the registry ships, its factories stubbed (no Numba)."""
    saved = registry._built
    registry._built = lambda spec: (types.SimpleNamespace(__name__=repr(spec), spec=spec), ())
    try:
        kernels = {}
        for part in (registry.forward_kernels, registry.forward_variant_kernels,
                     registry.forward_varlen_kernels, registry.forward_long_variant_kernels,
                     registry.backward_kernels, registry.backward_variant_kernels,
                     registry.backward_varlen_kernels, registry.decode_variant_kernels,
                     lambda: registry.decode_variant_kernels(page_tiles=True),
                     registry.backward_split_kernels, lambda: registry.backward_split_kernels(True),
                     registry.backward_long_kernels):
            kernels.update(part())
    finally:
        registry._built = saved
    return {_unpinned(kernel.spec) for kernel, _, _ in kernels.values()}


@pytest.mark.parametrize("arch", ARCHES)
def test_precompile_builds_only_registered_kernels(arch, registered_specs):
    parts = precompile.plan([arch])[arch]
    for name, specs in parts.items():
        assert specs and len(specs) == len(set(specs)), name
        assert all(s.arch == arch for s in specs)
        missing = [s for s in specs if _unpinned(s) not in registered_specs and not _registered_by_proxy(s)]
        assert not missing, f"{arch} {name}: precompile builds kernels the registry lacks: {missing[:3]}"


def _registered_by_proxy(spec) -> bool:
    """Kernels the registry names through another: the plain decode kernels (the registry holds
    their configs' variants, ``registry.decode_variant_kernels``), and the prepare and dQ kernels of
    the mma.sync configs Hopper runs for the backward variants its own backward leaves to them
    (``configs.WS_BACKWARD_LEFT_TO_MMA``: the registry holds their main kernels,
    ``registry.backward_variant_kernels``)."""
    if spec.operation in ("decode", "decode_combine"):
        return not (spec.window or spec.softcap)
    if spec.operation in ("backward_prep", "backward_dq") and spec.arch == "sm_90a" and not spec.varlen:
        return any((d, w, s) in configs.WS_BACKWARD_LEFT_TO_MMA
                   and configs.backward_config((9, 0), d, c, window=w, softcap=s) == spec.config
                   for d, w, s in configs.WS_BACKWARD_LEFT_TO_MMA for c in (False, True))
    return False


@pytest.mark.parametrize("arch", ARCHES)
def test_precompile_covers_the_variants_by_default(arch):
    parts = precompile.plan([arch])[arch]
    plain = precompile.plan([arch], variants=False)[arch]
    for name in ("forward", "backward", "decode"):
        assert set(plain[name]) < set(parts[name]), name
        assert not any(s.window or s.softcap or s.varlen for s in plain[name]), name
    kinds = {s.kind.split(".", 1)[1] for specs in parts.values() for s in specs}
    assert {"forward+window", "forward+softcap", "forward+window+softcap", "forward+varlen",
            "forward+window+softcap+varlen", "backward+window", "backward+softcap+varlen",
            "backward_prep+varlen", "backward_dq+varlen", "decode+window+softcap"} <= kinds
    cap = precompile.capability_of(arch)
    for d in configs.BACKWARD_DEFAULTS:  # each variant's own dispatch: family and config
        for causal in (False, True):
            for window, softcap, varlen in precompile.VARIANTS:
                try:
                    config = configs.backward_config(cap, d, causal, window=window, softcap=softcap,
                                                     varlen=varlen)
                except RuntimeError:
                    continue
                main = [s for s in parts["backward"] if s.operation == "backward" and s.config == config
                        and (s.window, s.softcap, s.varlen) == (window, softcap, varlen)]
                assert main, (arch, d, causal, window, softcap, varlen)
                assert {main[0].sibling(op) for op in BACKWARD_OPERATIONS} <= set(parts["backward"])


def test_precompile_forward_variants_follow_the_dispatch():
    cap = (9, 0)
    specs = set(precompile.kernels_for("sm_90a", candidates=False, variants=True))
    for d in configs.SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            for span in (None, configs.SHORT_SEQLEN, configs.LONG_SEQLEN):
                for window, softcap, varlen in precompile.VARIANTS:
                    config = configs.forward_config(cap, d, causal, seqlen=span, window=window, varlen=varlen)
                    for bf16 in (False, True):
                        from numbaflash.kernels.families import spec_of

                        spec = spec_of(config, "forward", bf16, "sm_90a", causal=causal, window=window,
                                       softcap=softcap, varlen=varlen)
                        assert spec in specs


def test_summary_line_counts_each_operation():
    parts = {"forward": [1, 2], "backward": [3, 4, 5], "decode": []}
    assert precompile.summary("sm_90a", parts) == "precompile sm_90a: 5 kernels (forward 2, backward 3)"


def _contiguous(specs) -> bool:
    """Whether each ``precompile.affinity`` group of ``specs`` comes as one run."""
    runs = [precompile.affinity(s) for i, s in enumerate(specs)
            if i == 0 or precompile.affinity(s) != precompile.affinity(specs[i - 1])]
    return len(runs) == len(set(runs))


def test_precompile_prints_the_counts_and_plain_restricts(monkeypatch, capsys, tmp_path):
    """``precompile`` says how many kernels it builds per target; ``--plain`` builds the plain ones;
    one process (``--jobs 1``) compiles each affinity group in a row, the costliest first."""
    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMBAFLASH_CACHE", raising=False)
    built = []

    def build_one(spec):  # in this process, no compile
        built.append(spec)
        return "k", False, 0.0

    monkeypatch.setattr(precompile, "build_one", build_one)
    monkeypatch.setattr("numbaflash.runtime.cache.show_compile_progress", lambda: None)
    assert precompile.main(["--arch", "sm_90a", "--jobs", "1"]) == 0
    err = capsys.readouterr().err
    parts = precompile.plan(["sm_90a"])["sm_90a"]
    planned = [s for specs in parts.values() for s in specs]
    assert precompile.summary("sm_90a", parts) in err
    assert sorted(map(repr, built)) == sorted(map(repr, planned))
    assert _contiguous(built)
    costs = {}
    for s in built:
        costs[precompile.affinity(s)] = costs.get(precompile.affinity(s), 0) + precompile.compile_cost(s)
    assert list(costs.values()) == sorted(costs.values(), reverse=True)  # the costliest group first
    built.clear()
    assert precompile.main(["--arch", "sm_90a", "--plain", "--forward-only", "--jobs", "1"]) == 0
    err = capsys.readouterr().err
    assert f"precompile sm_90a: {len(built)} kernels (forward {len(built)})" in err
    forward = precompile.kernels_for("sm_90a", candidates=False)
    assert len(built) == len(forward) and set(built) == set(forward) and _contiguous(built)


def test_schedule_keeps_every_process_busy_with_neighbours():
    """``precompile.Schedule``: every kernel once; a process takes its group's kernels in a row, then
    a group not yet started, then the back half of the busiest group, so that with 16 processes
    the estimated time is within 5% of the even split."""
    import heapq

    planned = [s for specs in precompile.plan(["sm_90a"])["sm_90a"].values() for s in specs]
    schedule, clock, heap, taken = precompile.Schedule(planned), {}, [(0.0, w) for w in range(16)], []
    while heap:
        now, worker = heapq.heappop(heap)
        spec = schedule.next_for(worker)
        if spec is not None:
            taken.append(spec)
            clock[worker] = now + precompile.compile_cost(spec)
            heapq.heappush(heap, (clock[worker], worker))
    assert sorted(map(repr, taken)) == sorted(map(repr, planned))
    assert max(clock.values()) <= 1.05 * sum(map(precompile.compile_cost, planned)) / 16


@pytest.mark.parametrize("arch", ARCHES)
def test_precompile_covers_mla_decode(arch):
    """Every MLA decode kernel a GPU of ``arch`` dispatches (16, 32 and 64 rows, contiguous or paged,
    causal or not, both dtypes) and its combine kernel are in the plan, and only with decode's."""
    from numbaflash.kernels.families import spec_of

    parts = precompile.plan([arch])[arch]
    cap = precompile.capability_of(arch)
    for rows in (16, 32, 64):
        for paged in (False, True):
            config = configs.mla_decode_config(cap, rows, paged)
            for causal in (False, True):
                for bf16 in (False, True):
                    spec = spec_of(config, "decode", bf16, arch, causal=causal)
                    assert spec in parts["mla"] and spec.sibling("decode_combine") in parts["mla"]
    assert not precompile.plan([arch], decode=False)[arch]["mla"]
