"""Offline SASS of the e4m3 PTX helpers (``ptx.mma_m16n8k32_e4m3``, ``ptx.pack_e4m3x4``; issue 60's
mma.sync FP8 path), compiled with no GPU for the targets that take them.

Pinned facts of the toolchain, which the FP8 kernels are designed around:
- sm_89 (Ada) runs the e4m3 mma.sync natively: one ``QMMA.16832.F32.E4M3.E4M3``.
- sm_90a (Hopper) has no 8-bit mma.sync: ptxas widens each operand register to f16 pairs
  (``F2FP.F16.E4M3.UNPACK_B``) and issues two ``HMMA.16816.F32``, so an mma.sync FP8 kernel on
  Hopper runs at the 16-bit kernel's tensor rate at best; Hopper's FP8 rate is wgmma's only.
- sm_80 refuses both helpers (the link fails): no FP8 below sm_89.
"""

from __future__ import annotations

import _fp8_kernels as K
import pytest
from _sass import assert_fully_inlined, report_cache
from _sass import sass_lines as _lines

from numbaflash.tools import inspect as nfi

ARCHS = ("sm_89", "sm_90a")


@pytest.fixture(scope="module")
def reports():
    """Compiled reports, shared by every test of this module: ``reports(name, arch)``."""
    return report_cache(K.KERNELS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(K.KERNELS))
def test_fully_inlined_no_local_memory(reports, name, arch):
    assert_fully_inlined(reports(name, arch))


def test_ada_runs_the_e4m3_mma_natively(reports):
    r = reports("mma_e4m3", "sm_89")
    assert len(_lines(r, r"\bQMMA\.16832\.F32\.E4M3\.E4M3 ")) == 1, r.opcodes
    assert r.count("HMMA") == 0 and r.count("F2FP") == 0


def test_hopper_widens_the_e4m3_mma_to_two_f16_mmas(reports):
    """If this fails because ptxas now issues an 8-bit mma on sm_90a, the mma.sync FP8 path's
    speed bar on Hopper (issue 60) is reachable after all: re-measure it."""
    r = reports("mma_e4m3", "sm_90a")
    assert r.count("QMMA") == 0
    assert len(_lines(r, r"\bHMMA\.16816\.F32 ")) == 2 == r.count("HMMA"), r.opcodes
    assert len(_lines(r, r"\bF2FP\.F16\.E4M3\.UNPACK_B ")) >= 6  # A's 4 and B's 2 registers, widened


@pytest.mark.parametrize("arch", ARCHS)
def test_four_floats_pack_in_two_conversions(reports, arch):
    r = reports("pack_e4m3", arch)
    assert len(_lines(r, r"\bF2FP\.SATFINITE\.E4M3\.F32\.PACK_AB")) == 2, r.opcodes


@pytest.mark.parametrize("name", list(K.KERNELS))
def test_sm80_refuses_the_e4m3_helpers(name):
    pyfunc, argtypes = K.KERNELS[name]
    with pytest.raises(Exception, match="PTX_COMPILE"):
        nfi.inspect_kernel(pyfunc, argtypes, "sm_80", name)
