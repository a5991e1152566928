"""Every shipped forward configuration, compiled offline (no GPU) for the architecture it is
dispatched on: tensor-core and async-copy instructions present, fully inlined, nothing in
local memory."""

from __future__ import annotations

import pytest

from numbaflash.configs import kernel_cubin
from numbaflash.tools.inspect import report_from_cubin
from numbaflash.tools.registry import forward_kernels

KERNELS = forward_kernels()


CASES = [(name, arch) for name, (_, _, archs) in sorted(KERNELS.items()) for arch in archs]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def report(request):
    """Compiled through the kernel cache (``configs.kernel_cubin``, the API's path): the run's
    one cache folder (conftest) gives the same cubin to every test that needs it."""
    name, arch = request.param
    return report_from_cubin(kernel_cubin(KERNELS[name][0].spec.on(arch)).cubin, name, arch)


def test_tensor_core_and_copy_instructions(report):
    if "_ws_" in report.name:  # warp-specialised Hopper kernel: TMA, mbarriers, setmaxnreg, no cp.async
        assert report.count("HGMMA") > 0, "no wgmma in SASS"
        for op in ("UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG"):
            assert report.count(op) > 0, f"no {op} in SASS"
        assert report.count("LDGSTS") == 0, "cp.async in the TMA kernel"
        # ptxas serialises every wgmma (a WARPGROUP.DEPBAR after each HGMMA) when it cannot
        # prove the asynchronous pipeline; the kernel's own waits are a handful.
        assert report.sass.count("WARPGROUP.DEPBAR") <= 8 < report.count("HGMMA"), "wgmma serialised by ptxas"
    else:
        assert report.count("HMMA") > 0, "no mma.sync in SASS"
        assert report.count("LDSM") > 0, "no ldmatrix in SASS"
        assert report.count("LDGSTS") > 0, "no cp.async in SASS"
    assert report.count("MUFU") > 0, "no ex2 in SASS"


def test_no_local_memory_spills_or_calls(report):
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    assert report.spill_instructions == 0, f"{report.spill_instructions} LDL/STL"
    assert report.calls == 0, "a helper was not inlined"


REGISTER_FILE = 65536  # 32-bit registers per SM, sm_80 .. sm_90
REGISTER_GRANULE = 8  # registers per thread are allocated in steps of 8 (256 per warp)


def test_fits_register_file(request, report):
    """One CTA of the kernel's launch bound fits the register file (what ``launch_bounds``
    (threads, 1) promises ptxas it may use), and no thread exceeds the 255-register limit."""
    name, _ = request.node.callspec.params["report"]
    threads = KERNELS[name][0].launch_bounds[0]
    allocated = -(-report.registers // REGISTER_GRANULE) * REGISTER_GRANULE
    assert report.registers <= 255
    assert allocated * threads <= REGISTER_FILE, f"{report.registers} registers x {threads} threads"


D96_WS = [name for name in sorted(KERNELS) if name.startswith("flash_forward_ws_d96_")]


@pytest.mark.parametrize("name", D96_WS)
def test_d96_descriptors_stay_uniform(name):
    """The d96 Hopper forward takes its warpgroup index by a lane-0 broadcast (``forward_ws``'s
    ``UNIFORM_WG``, +1-2% measured there), so that ptxas keeps the wgmma descriptors in uniform
    registers: 30-39 R2UR moves with it, 54-68 without (sm_90a, CUDA 13.0 and 13.5)."""
    report = report_from_cubin(kernel_cubin(KERNELS[name][0].spec.on("sm_90a")).cubin, name, "sm_90a")
    moves = report.count("R2UR")
    assert moves <= 45, f"{moves} R2UR: the descriptors left the uniform registers"


WS_16BIT = [name for name in sorted(KERNELS) if "_ws_" in name and "e4m3" not in name]


@pytest.mark.parametrize("name", WS_16BIT)
def test_ping_pong_rescales_without_a_vote(name):
    """The Hopper forward's ping-pong builds adopt the row maxes and rescale O on every KV tile
    (``forward_ws``'s ``RESCALE_ALWAYS``: d64 +2-3% measured there), so their SASS has no warp
    vote (``VOTE``; ``VOTEU`` is the elect of uniform code); the other builds rescale only when a
    warp's vote says some row max grew."""
    report = report_from_cubin(kernel_cubin(KERNELS[name][0].spec.on("sm_90a")).cubin, name, "sm_90a")
    votes = report.count("VOTE")
    if "_pp_" in name:
        assert votes == 0, f"{votes} VOTE: the ping-pong build rescales lazily"
    else:
        assert votes > 0, "no VOTE: the build rescales O on every tile"
