"""Offline SASS helpers shared by the helper-kernel tests (``test_inspect_sm80_offline.py``,
``test_ptx_fp8_offline.py``): compiled reports memoised per (kernel, target), and the SASS lines
that match a pattern."""

from __future__ import annotations

import re
from collections.abc import Callable

from numbaflash.tools import inspect as nfi


def report_cache(kernels: dict) -> Callable[[str, str], nfi.KernelReport]:
    """``get(name, arch)``: the report of ``kernels[name]`` (a (pyfunc, argtypes) pair) compiled
    for ``arch``, compiled once."""
    cache = {}

    def get(name: str, arch: str) -> nfi.KernelReport:
        if (name, arch) not in cache:
            pyfunc, argtypes = kernels[name]
            cache[name, arch] = nfi.inspect_kernel(pyfunc, argtypes, arch, name)
        return cache[name, arch]

    return get


def sass_lines(report: nfi.KernelReport, pattern: str) -> list[str]:
    return [line for line in report.sass.splitlines() if re.search(pattern, line)]


def assert_fully_inlined(report: nfi.KernelReport) -> None:
    """Every helper inlined (no CALL), no stack, no local memory, no spill, and SASS really read."""
    assert report.calls == 0, "a helper was not inlined"
    assert report.stack_bytes == 0
    assert report.local_bytes == 0
    assert report.spill_instructions == 0, sass_lines(report, r"\b(LDL|STL)\b")
    assert report.count("EXIT") >= 1  # the SASS was really read
