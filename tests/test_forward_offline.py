"""Every shipped forward configuration, compiled offline (no GPU) for the architecture it is
dispatched on: tensor-core and async-copy instructions present, fully inlined, nothing in
local memory."""

from __future__ import annotations

import pytest

from numbaflash.inspect import inspect_kernel
from numbaflash.kernels.registry import forward_kernels

KERNELS = forward_kernels()


@pytest.fixture(scope="module", params=sorted(KERNELS), ids=str)
def report(request):
    pyfunc, argtypes, archs = KERNELS[request.param]
    return inspect_kernel(pyfunc, argtypes, archs[0], request.param)


def test_tensor_core_and_copy_instructions(report):
    assert report.count("HMMA") > 0, "no mma.sync in SASS"
    assert report.count("LDSM") > 0, "no ldmatrix in SASS"
    assert report.count("LDGSTS") > 0, "no cp.async in SASS"
    assert report.count("MUFU") > 0, "no ex2 in SASS"


def test_no_local_memory_spills_or_calls(report):
    assert report.local_bytes == 0 and report.stack_bytes == 0, (report.local_bytes, report.stack_bytes)
    assert report.spill_instructions == 0, f"{report.spill_instructions} LDL/STL"
    assert report.calls == 0, "a helper was not inlined"


def test_fits_register_file(report):
    assert report.registers <= 255
