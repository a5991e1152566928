"""The Hopper MLA decode kernel (``kernels/mla_ws.py``), compiled offline (no GPU) through the kernel
cache for the paged config an H100 or H200 dispatches above 16 query rows: wgmma (HGMMA) for S over
576 columns (36 k-steps of m64n64k16, a warpgroup's whole tile) and PV (4 of m64n256k16 for each
tile of the pair, written twice: P_A V_A, P_B V_B), fully inlined, nothing in local
memory, and S's wgmma descriptors in uniform registers (``run_mla`` broadcasts the split's tile
range from lane 0: a length loaded from ``cache_seqlens`` is not warp-uniform to ptxas, and the
descriptors derived from it were moved to uniform registers by an R2UR before every wgmma)."""

from __future__ import annotations

import re

import pytest

from numbaflash import configs
from numbaflash.configs import kernel_cubin
from numbaflash.kernels.families import spec_of
from numbaflash.kernels.shapes import WsMlaConfig
from numbaflash.tools.inspect import report_from_cubin


@pytest.fixture(scope="module")
def report():
    config = configs.mla_decode_config((9, 0), rows=64, paged=True)
    assert isinstance(config, WsMlaConfig), config
    entry = kernel_cubin(spec_of(config, "decode", True, "sm_90a"))
    return report_from_cubin(entry.cubin, entry.entry_name, "sm_90a")


def test_wgmma_steps_inlined_and_no_local_memory(report):
    assert report.count("HGMMA") == 36 + 2 * 4
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    for op in ("LDL", "STL", "CALL"):
        assert report.count(op) == 0, op


def test_s_descriptors_stay_in_uniform_registers(report):
    """Between S's first and last wgmma no R2UR: each k-step's descriptors are a uniform add."""
    ops = [line for line in report.sass.splitlines() if re.search(r"\b(HGMMA\.64x64x16|R2UR)\b", line)]
    first = next(i for i, line in enumerate(ops) if "HGMMA" in line)
    last = max(i for i, line in enumerate(ops) if "HGMMA" in line)
    assert not [line for line in ops[first:last] if "R2UR" in line]
