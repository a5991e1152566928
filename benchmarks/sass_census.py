"""Registers, SASS instruction count and LDL / STL / CALL of every registered kernel, offline (no GPU).

Compare two versions of the code before and after a change that should not grow the machine
code (a refactor):

    python benchmarks/sass_census.py --out before.tsv          # on the old code
    python benchmarks/sass_census.py --out after.tsv           # on the new code
    python benchmarks/sass_census.py --compare before.tsv after.tsv

Each line is ``name@arch registers instructions ldl stl call``; every kernel of
``tools.registry.registered_kernels`` is compiled for each of its targets among ``--archs``
(sm_80 and sm_90a by default: the mma.sync kernels for both, the Hopper kernels for sm_90a).
``--compare`` prints a markdown table (kernel groups, how many kernels are lower, equal, higher
in registers and instructions) and exits 1 if any kernel grew or spills.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

_KERNELS: dict | None = None
ON_DEMAND = False  # --on-demand: the builds compiled on first use, not registered (sink, GQA split)


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        from numbaflash.tools.registry import on_demand_kernels, registered_kernels

        _KERNELS = on_demand_kernels() if ON_DEMAND else registered_kernels()
    return _KERNELS


CACHE = False  # --cache: compile through the kernel cache (a census that also precompiles)


def census(item: tuple[str, str]) -> str:
    """'name@arch registers instructions ldl stl call' of one kernel."""
    from numbaflash.tools.inspect import inspect_kernel, report_from_cubin

    name, arch = item
    pyfunc, argtypes, _ = _kernels()[name]
    spec = getattr(pyfunc, "spec", None)
    if CACHE and spec is not None:
        from numbaflash.configs import kernel_cubin

        report = report_from_cubin(kernel_cubin(spec.on(arch)).cubin, name, arch)
    else:
        report = inspect_kernel(pyfunc, argtypes, arch, name)
    return (f"{name}@{arch} {report.registers} {sum(report.opcodes.values())} "
            f"{report.count('LDL')} {report.count('STL')} {report.calls}")


def read(path: str) -> dict[str, tuple[int, ...]]:
    rows = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 6:
                rows[parts[0]] = tuple(int(x) for x in parts[1:])
    return rows


GROUPS = (  # (name prefix, group), first match wins
    ("flash_forward_ws", "Hopper forward"), ("flash_backward_ws_prep", "Hopper backward: prepare"),
    ("flash_backward_ws_dq", "Hopper backward: dQ"), ("flash_backward_ws", "Hopper backward: main"),
    ("flash_backward_prep", "mma.sync backward: prepare"), ("flash_backward_dq", "mma.sync backward: dQ"),
    ("flash_backward", "mma.sync backward: main"), ("flash_forward", "mma.sync forward"),
    ("flash_decode_combine", "decode: combine"), ("flash_decode", "decode"),
)


def group_of(key: str) -> str:
    """A kernel's group for the table: its kernel family and part, then the target."""
    name, arch = key.split("@")
    group = next((g for prefix, g in GROUPS if name.startswith(prefix)), "demos")
    return f"{group}@{arch}"


def compare(before_path: str, after_path: str) -> int:
    before, after = read(before_path), read(after_path)
    missing = sorted(set(before) - set(after))
    added = sorted(set(after) - set(before))
    groups: dict[str, list[int]] = defaultdict(lambda: [0] * 7)
    worse = []
    for key in sorted(set(before) & set(after)):
        b, a = before[key], after[key]
        g = groups[group_of(key)]
        g[0] += 1
        g[1 + (a[0] > b[0]) + (a[0] >= b[0])] += 1  # registers: lower, equal, higher
        g[4 + (a[1] > b[1]) + (a[1] >= b[1])] += 1  # instructions: lower, equal, higher
        if a[0] > b[0] or a[1] > b[1] or any(a[2:]):
            worse.append(f"{key}: registers {b[0]} -> {a[0]}, instructions {b[1]} -> {a[1]}, "
                         f"LDL/STL/CALL {a[2]}/{a[3]}/{a[4]}")
    print("| kernels | targets | count | regs lower | regs equal | regs higher "
          "| instr lower | instr equal | instr higher |")
    print("|:--|:--|--:|--:|--:|--:|--:|--:|--:|")
    for key, g in sorted(groups.items()):
        name, arch = key.split("@")
        print(f"| {name} | {arch} | {g[0]} | {g[1]} | {g[2]} | {g[3]} | {g[4]} | {g[5]} | {g[6]} |")
    total = [sum(g[i] for g in groups.values()) for i in range(7)]
    print(f"| **all** | | {total[0]} | {total[1]} | {total[2]} | {total[3]} | {total[4]} | {total[5]} "
          f"| {total[6]} |")
    for line in worse:
        print("WORSE", line)
    for key in missing:
        print("MISSING", key)
    for key in added:
        print("NEW", key)
    return 1 if worse or missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default="sm_80,sm_90a")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--match", default="", help="only kernels whose name contains this")
    parser.add_argument("--out", help="write the census here (else stdout)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--cache", action="store_true",
                        help="compile through the kernel cache (NUMBAFLASH_CACHE_DIR): the census also "
                             "precompiles every registered kernel for each target")
    parser.add_argument("--on-demand", action="store_true",
                        help="the builds compiled on first use instead (tools.registry.on_demand_kernels: "
                             "the learnable-sink builds and the Hopper backward's GQA-split builds, "
                             "not registered)")
    args = parser.parse_args(argv)
    global CACHE, ON_DEMAND
    CACHE, ON_DEMAND = args.cache, args.on_demand
    if args.compare:
        return compare(*args.compare)
    archs = args.archs.split(",")
    items = [(name, arch) for name, (_, _, targets) in sorted(_kernels().items())
             if args.match in name for arch in targets if arch in archs]
    out = open(args.out, "w") if args.out else sys.stdout
    with ProcessPoolExecutor(args.jobs) as pool:
        for line in pool.map(census, items, chunksize=4):
            print(line, file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
