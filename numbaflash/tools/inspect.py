"""Offline kernel inspection: compile for a target with no GPU, link, disassemble, report.

    python -m numbaflash.inspect                       # every registered kernel, sm_80 + sm_90a
    python -m numbaflash.inspect forward --arch sm_90a # kernels whose name contains "forward"

The kernel is compiled by NVVM to LTO-IR, linked with its PTX helpers by nvJitLink into
a cubin, and read with ``cuobjdump`` (from the ``nvidia-cuda-cuobjdump`` wheel or PATH).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence

from ..runtime.compiler import compile_cubin, parse_arch  # noqa: F401  (parse_arch: re-exported)

# Targets offered on the command line (any sm_XY[a] works through the API).
ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120a")

# SASS opcodes worth counting: tensor-core, copy, memory, barrier and trouble makers.
WATCHED_OPCODES = (
    "HMMA", "HGMMA", "QGMMA", "LDSM", "STSM", "LDGSTS", "UTMALDG", "UBLKCP", "SYNCS", "WARPGROUP",
    "LDG", "STG", "LDS", "STS", "BAR", "SHFL", "MUFU", "LDL", "STL", "CALL",
)


@dataclasses.dataclass
class KernelReport:
    """What one kernel compiled to on one architecture."""

    name: str
    arch: str
    registers: int
    stack_bytes: int
    shared_bytes: int
    local_bytes: int
    opcodes: dict[str, int]
    sass: str = dataclasses.field(repr=False, default="")

    @property
    def spill_instructions(self) -> int:
        """Local-memory loads and stores in SASS (register spills or local arrays)."""
        return self.opcodes.get("LDL", 0) + self.opcodes.get("STL", 0)

    @property
    def calls(self) -> int:
        return self.opcodes.get("CALL", 0)

    def count(self, opcode: str) -> int:
        """Instructions whose opcode starts with ``opcode`` (e.g. ``"HMMA"``)."""
        return self.opcodes.get(opcode, 0)


def find_tool(name: str) -> str:
    """Path of a CUDA binary tool (``cuobjdump``, ``nvdisasm``): PATH or an NVIDIA wheel."""
    path = shutil.which(name)
    if path:
        return path
    for entry in sys.path:
        for hit in sorted(glob.glob(os.path.join(entry, "nvidia", "**", "bin", name), recursive=True)):
            if os.access(hit, os.X_OK):
                return hit
    raise FileNotFoundError(
        f"numbaflash.inspect needs {name!r}: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
        f"(or put the CUDA toolkit's bin on PATH)"
    )


_RES_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_OPCODE_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


_NOINC_RE = re.compile(r"\bCALL\.REL\.NOINC\b")


def count_opcodes(sass: str) -> dict[str, int]:
    """Count SASS instructions by base opcode (``HMMA.16816.F32`` counts as ``HMMA``).

    ``CALL.REL.NOINC`` pushes no return address: ptxas uses it as a branch out of a loop
    with divergent exit (seen on sm_80), not to call a function. It is counted apart, as
    ``CALL.NOINC``, so that ``CALL`` counts real calls only."""
    counts = collections.Counter(_OPCODE_RE.findall(sass))
    noinc = len(_NOINC_RE.findall(sass))
    if noinc:
        counts["CALL"] -= noinc
        counts["CALL.NOINC"] = noinc
        if not counts["CALL"]:
            del counts["CALL"]
    return dict(counts)


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def report_from_cubin(cubin: bytes, name: str, arch: str) -> KernelReport:
    """Resource usage and opcode counts of the (single) kernel in ``cubin``."""
    cuobjdump = find_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = _run([cuobjdump, "-res-usage", path])
        sass = _run([cuobjdump, "-sass", path])
    match = _RES_RE.search(res)
    if match is None:
        raise RuntimeError(f"could not read resource usage from cuobjdump:\n{res}")
    regs, stack, shared, local = (int(x) for x in match.groups())
    return KernelReport(name, arch, regs, stack, shared, local, count_opcodes(sass), sass)


def inspect_kernel(pyfunc, argtypes: Sequence, arch: str, name: str | None = None,
                   launch_bounds=None) -> KernelReport:
    """Compile ``pyfunc`` (a kernel's Python function, or a ``@cuda.jit`` dispatcher) for
    ``arch`` offline and report registers, stack, shared/local memory and SASS counts."""
    pyfunc = getattr(pyfunc, "py_func", pyfunc)
    cubin = compile_cubin(pyfunc, argtypes, arch, launch_bounds)
    return report_from_cubin(cubin, name or pyfunc.__name__, arch)


def format_table(reports: Iterable[KernelReport]) -> str:
    """A fixed-width table, one row per (kernel, arch)."""
    cols = ["HMMA", "HGMMA", "QGMMA", "LDSM", "LDGSTS", "UTMALDG", "SYNCS", "BAR", "LDL", "STL", "CALL"]
    head = ["kernel", "arch", "regs", "stack", "smem", "local"] + cols
    rows = [
        [r.name, r.arch, str(r.registers), str(r.stack_bytes), str(r.shared_bytes), str(r.local_bytes)]
        + [str(r.count(c)) for c in cols]
        for r in reports
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        padded = (c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in pairs)
        return "  ".join(padded)

    out = [line(head), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from .registry import on_demand_kernels, registered_kernels

    parser = argparse.ArgumentParser(prog="python -m numbaflash.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("pattern", nargs="?", default="", help="only kernels whose name contains this")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHES),
                        help="target (repeatable); default sm_80 and sm_90a")
    parser.add_argument("--list", action="store_true", help="list kernel names and exit")
    parser.add_argument("--sass", action="store_true", help="also print the full SASS")
    parser.add_argument("--on-demand", action="store_true",
                        help="the builds compiled on first use (learnable sink, GQA split) instead of the "
                             "registered kernels")
    args = parser.parse_args(argv)
    source = on_demand_kernels if args.on_demand else registered_kernels
    kernels = {n: k for n, k in source().items() if args.pattern in n}
    if args.list:
        print("\n".join(kernels))
        return 0
    if not kernels:
        print(f"no kernel matches {args.pattern!r}; try --list", file=sys.stderr)
        return 2
    pairs = [(name, arch) for name, (_, _, archs) in kernels.items()
             for arch in args.arch or ("sm_80", "sm_90a") if arch in archs]
    reports = []
    for i, (name, arch) in enumerate(pairs, start=1):
        pyfunc, argtypes, _ = kernels[name]
        start = time.perf_counter()
        report = inspect_kernel(pyfunc, argtypes, arch, name)
        reports.append(report)
        # A line per kernel as it goes (stderr, so that stdout stays the table).
        print(f"[{i}/{len(pairs)}] {name} {arch}: {report.registers} registers, "
              f"{sum(report.opcodes.values())} instructions ({time.perf_counter() - start:.1f} s)",
              file=sys.stderr, flush=True)
        if args.sass:
            print(report.sass)
    print(format_table(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
