"""The Hopper backward's main kernel (``kernels/backward_ws.py``), compiled offline (no GPU) through
the kernel cache for the configs an H100 dispatches: TMA loads (UTMALDG), mbarrier waits
(SYNCS), wgmma (HGMMA) and the dQ adds (REDG), fully inlined, nothing in local memory. One dtype
and causality a head dim (the others differ only in conversions and masks);
``python -m numbaflash.inspect backward_ws --arch sm_90a`` lists every shipped build, variants
included."""

from __future__ import annotations

import re

import pytest

from numbaflash import configs
from numbaflash.configs import kernel_cubin
from numbaflash.kernels.families import spec_of
from numbaflash.kernels.shapes import WsBackwardConfig
from numbaflash.tools.inspect import report_from_cubin

CASES = [(configs.backward_config((9, 0), 128, True), True, True),
         (configs.backward_config((9, 0), 64, False), False, False),
         (configs.backward_config((9, 0), 128, False, long=True), False, True)]  # 80 rows, dQᵀ


@pytest.fixture(scope="module", params=[(*case, split) for case in CASES for split in (False, True)],
                ids=lambda c: f"d{c[0].head_dim}-m{c[0].block_m}-{'causal' if c[1] else 'full'}"
                                  f"{'-split' if c[3] else ''}")
def report(request):
    """(config, report, whether the GQA-split build) of each case, plain and split."""
    config, causal, bf16, split = request.param
    assert isinstance(config, WsBackwardConfig), config
    entry = kernel_cubin(spec_of(config, "backward", bf16, "sm_90a", causal=causal, group_split=split))
    return config, report_from_cubin(entry.cubin, entry.entry_name, "sm_90a"), split


def test_instructions(report):
    config, report, split = report
    for op in ("HGMMA", "UTMALDG", "SYNCS", "MUFU", "REDG"):
        assert report.count(op) > 0, f"no {op} in SASS"
    # one wgmma per k-step: Sᵀ and dPᵀ over the head dim, dV and dK over the query block, dQ over
    # the key block, each issued once in the step loop
    d, bm, bn = config.head_dim, config.block_m, config.block_n
    assert report.count("HGMMA") == 2 * d // 16 + 2 * bm // 16 + bn // 16
    # a split GQA group's epilogue (``Epilogue.gather_split``), in the split build only: one ticket
    assert report.count("ATOMG") == (1 if split else 0)


def test_the_next_rows_are_staged_where_the_config_says(report):
    """``late_rows`` (the d128 config): a step stages the next step's LSE and D rows (two LDGSTS)
    after issuing its Sᵀ and dPᵀ, so only the first step's, staged before the walk, precede the
    first HGMMA; otherwise the loop's own precede it too."""
    config, report, _ = report
    ops = [op for line in report.sass.splitlines() for op in ("LDGSTS", "HGMMA")
           if re.search(rf"\b{op}\b", line)]
    assert ops[:ops.index("HGMMA")].count("LDGSTS") == (2 if config.late_rows else 4), ops[:8]


def test_no_local_memory_spills_or_calls(report):
    _, report, _ = report
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    assert report.spill_instructions == 0, f"{report.spill_instructions} LDL/STL"
    assert report.calls == 0, "a helper was not inlined"


def _shipped_variant_builds():
    """Every (variant, head dim, causal) an H100 runs on the Hopper backward besides ``CASES``
    (window kernels are built non-causal: their right edge 0 is causal)."""
    builds = []
    for window, softcap in ((False, False), (True, False), (False, True), (True, True)):
        for _, causal, config in configs.shipped_backward_configs(window=window, softcap=softcap):
            if not isinstance(config, WsBackwardConfig) or (window and causal):
                continue
            if not (window or softcap) and any(c == config and k == causal for c, k, _ in CASES):
                continue
            variant = "plain" if not (window or softcap) else "window" * window + "softcap" * softcap
            builds.append((variant, config, causal))
    return builds


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("variant,config,causal", _shipped_variant_builds(),
                         ids=lambda v: v if isinstance(v, str) else getattr(v, "head_dim", v))
def test_every_shipped_build_keeps_to_registers(variant, config, causal, split):
    """No shipped Hopper backward build spills (those that did run on the mma.sync backward:
    ``configs.WS_BACKWARD_LEFT_TO_MMA``), nor its GQA-split build (compiled on first use: the d128
    window and 80-row causal ones spilled 8 each while the walk's step count was 64-bit)."""
    spec = spec_of(config, "backward", True, "sm_90a", causal=causal, window="window" in variant,
                   softcap="softcap" in variant, group_split=split)
    entry = kernel_cubin(spec)
    report = report_from_cubin(entry.cubin, entry.entry_name, "sm_90a")
    assert report.local_bytes == 0 and report.spill_instructions == 0 and report.calls == 0, (
        f"{entry.entry_name}: {report.spill_instructions} LDL/STL, {report.local_bytes} B local, "
        f"{report.calls} CALL")


def _exponentials_before_dp_wait(report) -> int:
    """MUFU.EX2 between the step's first wgmma wait of a whole group (dPᵀ's) and the one before."""
    count = 0
    for line in report.sass.splitlines():
        if "MUFU.EX2" in line:
            count += 1
        elif re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", line):
            return count
    raise AssertionError("no wgmma wait_group 0 in SASS")


def test_early_p_runs_exponentials_beside_dp():
    """``WsBackwardConfig.early_p`` (the d64 config): the step makes Pᵀ between Sᵀ's wait and
    dPᵀ's, so that its exponentials run beside dPᵀ's GEMM. Without it, every one comes after dPᵀ's
    wait. ptxas sinks some below even with the fence (25-28 of the 64 a thread with CUDA 13.0 and 13.5);
    should no more than a third stay above it, the knob no longer does its job (docs/PERFORMANCE.md
    [EARLYP])."""
    import dataclasses

    shipped = configs.BACKWARD_WS_DEFAULTS[64][0]
    assert shipped.early_p
    per_thread = 64 * shipped.block_m // 128  # 64 keys x block_m queries over a warpgroup
    for early in (True, False):
        config = dataclasses.replace(shipped, early_p=early)
        entry = kernel_cubin(spec_of(config, "backward", True, "sm_90a", causal=True))
        count = _exponentials_before_dp_wait(report_from_cubin(entry.cubin, entry.entry_name, "sm_90a"))
        if early:
            assert count >= per_thread // 3, count
        else:
            assert count == 0, count
