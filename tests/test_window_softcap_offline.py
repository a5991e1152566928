"""The mma.sync forward's sliding-window and softcap kernels (issue 35), compiled offline (no GPU)
for sm_80 and for Hopper (sm_90a), which runs them too: fully inlined, nothing in local memory.
One window + softcap kernel per head dim (the config of the shipped table, as the registry names
it), and the softcap kernels of the d64 config (whose interleaved softmax the softcap turns off:
it spilled); every variant is in ``python -m numbaflash.inspect window`` / ``softcap``."""

from __future__ import annotations

import pytest

from numbaflash.configs import kernel_cubin
from numbaflash.tools.inspect import report_from_cubin
from numbaflash.tools.registry import (
    forward_long_variant_kernels,
    forward_variant_kernels,
    forward_varlen_kernels,
)

# registered, and (d128's 128 x 176 and d96's 128 x 192, the /long entries' tiles) built on demand
KERNELS = {**forward_variant_kernels(), **forward_varlen_kernels(), **forward_long_variant_kernels()}
WINDOW_SOFTCAP = {next(n for n in KERNELS if n.startswith(f"flash_forward_d{d}_")
                       and n.endswith("_window_softcap_f16_sm80")) for d in (32, 64, 96, 128, 256)}
D64_SOFTCAP = {n for n in KERNELS
               if n.startswith("flash_forward_d64_") and "softcap_bf16" in n and "window" not in n}
CHOSEN = sorted(WINDOW_SOFTCAP | D64_SOFTCAP)
CASES = [(name, arch) for name in CHOSEN for arch in ("sm_80", "sm_90a")]
# The Hopper kernel's variants with the fewest registers to spare: packed sequences with a window
# and a softcap at d64 (three consumer warpgroups, 160 registers each), d128's 128 x 176 tile with O
# staged in V, and d256 (O 128 registers a thread); all 108 are in ``inspect`` (sm_90a, ``ws``).
HOPPER = sorted(n for n in KERNELS if n.startswith("flash_forward_ws_") and "varlen_window_softcap_f16" in n
                and any(t in n for t in ("_d64_m192_n128_s2_pp_", "_d128_m128_n176_", "_d256_")))


@pytest.fixture(scope="module", params=HOPPER)
def hopper_report(request):
    spec = KERNELS[request.param][0].spec
    return report_from_cubin(kernel_cubin(spec.on("sm_90a")).cubin, request.param, "sm_90a")


def test_hopper_variants_do_not_spill(hopper_report):
    assert len(HOPPER) == 3
    report = hopper_report
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    assert report.spill_instructions == 0 and report.calls == 0
    assert report.count("HGMMA") > 0 and report.count("UTMALDG") > 0 and report.count("MUFU") > 0


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def report(request):
    name, arch = request.param
    return report_from_cubin(kernel_cubin(KERNELS[name][0].spec.on(arch)).cubin, name, arch)


def test_no_local_memory_spills_or_calls(report):
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    assert report.spill_instructions == 0, f"{report.spill_instructions} LDL/STL"
    assert report.calls == 0, "a helper was not inlined"
    assert report.count("HMMA") > 0 and report.count("LDGSTS") > 0 and report.count("MUFU") > 0
