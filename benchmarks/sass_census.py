"""Registers and total SASS instruction count of every shipped forward kernel, offline (no GPU).

Compare two versions of the code before and after a change that should not alter the machine
code (a refactor):

    python benchmarks/sass_census.py > before.txt   # on the old code
    python benchmarks/sass_census.py > after.txt    # on the new code
    diff before.txt after.txt
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

from numbaflash.tools.inspect import inspect_kernel
from numbaflash.tools.registry import forward_kernels


def census(item: tuple[str, str]) -> str:
    """'name@arch registers instructions' of one kernel."""
    name, arch = item
    pyfunc, argtypes, _ = forward_kernels()[name]
    report = inspect_kernel(pyfunc, argtypes, arch, name)
    return f"{name}@{arch} {report.registers} {sum(report.opcodes.values())}"


def main() -> None:
    items = [(name, arch) for name, (_, _, archs) in sorted(forward_kernels().items()) for arch in archs]
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        for line in pool.map(census, items):
            print(line, flush=True)


if __name__ == "__main__":
    main()
