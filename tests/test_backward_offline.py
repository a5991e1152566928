"""The backward's main kernel, compiled offline (no GPU) through the kernel cache for the
configs an H100 and an A100 dispatch: tensor-core, ldmatrix, cp.async and dQ reduction
instructions present, fully inlined, nothing in local memory. One dtype each (the other
differs only in its conversions); ``python -m numbaflash.inspect backward`` lists every
shipped backward kernel of both dtypes."""

from __future__ import annotations

import types

import pytest

from numbaflash import configs
from numbaflash.configs import kernel_cubin
from numbaflash.kernels import families
from numbaflash.tools.inspect import report_from_cubin

CASES = [  # (config, causal, bf16, arch): the H100's mma.sync choice per head dim, causal, fp16 (at d64
    # and d128 what its packed variable-length calls run: the others run the Hopper backward) ...
    *[(configs.backward_config((9, 0), d, True, varlen=True), True, False, "sm_90a")
      for d in configs.SUPPORTED_HEAD_DIMS],
    # ... and the A100's d128 and d256 (one Q stage there), non-causal, bf16, for sm_80
    *[(configs.backward_config((8, 0), d, False), False, True, "sm_80") for d in (128, 256)],
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"d{c[0].head_dim}{c[0].tag}-{c[3]}")
def report(request):
    config, causal, bf16, arch = request.param
    entry = kernel_cubin(families.spec_of(config, "backward", bf16, arch, causal=causal))
    return report_from_cubin(entry.cubin, entry.entry_name, arch)


def test_instructions(report):
    for op in ("HMMA", "LDSM", "LDGSTS", "MUFU"):
        assert report.count(op) > 0, f"no {op} in SASS"
    assert report.count("RED") + report.count("REDG") > 0, "no red.global.add (RED on sm_80, REDG on sm_90)"


def test_no_local_memory_spills_or_calls(report):
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    assert report.spill_instructions == 0, f"{report.spill_instructions} LDL/STL"
    assert report.calls == 0, "a helper was not inlined"
    assert report.registers <= 255


def test_prepare_and_dq_kernels_are_cached_once_for_causal_and_not(monkeypatch):
    """Their code does not depend on causal masking (``kernels.spec.CAUSAL_FREE``; the SASS of both
    builds is identical): causal and non-causal calls share one cache entry and one loaded module."""
    from numbaflash.runtime import cache

    asked = []
    monkeypatch.setattr(cache, "cached_cubin", lambda spec, build, sources=None:
                        asked.append((spec.operation, spec.causal))
                        or types.SimpleNamespace(cubin=b"", entry_name="e"))
    config = configs.backward_config((9, 0), 96, True)  # the mma.sync backward's
    for causal in (False, True):
        for op in families.BACKWARD_OPERATIONS:
            configs.kernel_cubin(families.spec_of(config, op, False, "sm_90a", causal=causal))
    assert asked == [("backward_prep", False), ("backward", False), ("backward_dq", False),
                     ("backward_prep", False), ("backward", True), ("backward_dq", False)]
    # the forward's own kernels do depend on it; a window kernel is built once, as non-causal (a
    # causal window is its right edge 0)
    for config in (configs.DEFAULTS[("sm80", 64)], configs.DEFAULTS[("sm90", 64)]):
        assert families.spec_of(config, causal=True).causal
        assert families.spec_of(config, causal=True, softcap=True).causal
        assert not families.spec_of(config, causal=True, window=True).causal
        assert not families.spec_of(config, causal=True, window=True, softcap=True).causal
