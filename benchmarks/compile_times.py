"""Compile time and SASS census of every shipped forward kernel (and, with ``--backward``, every
shipped backward kernel), each from nothing, offline.

Every (kernel, architecture) pair is compiled in a fresh Python process with no kernel cache,
as a new user's first call would compile it: the time (wall, and the process's CPU time, which
a machine shared with other work inflates less) covers Numba's typing and lowering,
NVVM, NVRTC for the PTX helpers, nvJitLink and ptxas, not the interpreter start or imports
(reported apart). The same cubin is then disassembled: registers, SASS instructions and the
LDL / STL / CALL counts that must stay 0.

    python benchmarks/compile_times.py                  # every shipped pair, 1 process at a time
    python benchmarks/compile_times.py --jobs 2 --only ws_d128 --csv times.csv
    python benchmarks/compile_times.py --backward --only backward_ws_d128   # the backward's kernels
    python benchmarks/compile_times.py --summary times.csv   # median / slowest of a CSV
    python benchmarks/compile_times.py --jobs 2 --sass-dir before/   # also each pair's SASS
    diff -r before/ after/                                   # ... to show a change leaves it alone

Run it on the old and the new code (a ``git worktree``) to get a before / after table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FIELDS = ("kernel", "arch", "compile_s", "cpu_s", "import_s", "registers", "instructions", "ldl", "stl",
          "call")

# "        /*01a0*/                   HMMA.16816.F32 ...": the instruction after its address
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/(.*)$")


def measure_one(name: str, arch: str, sass_dir: str = "") -> dict:
    """In this (fresh) process: import, compile one pair with no cache, disassemble."""
    start = time.perf_counter()
    from numbaflash.runtime.compiler import compile_cubin
    from numbaflash.tools.inspect import report_from_cubin
    pyfunc, argtypes, _ = shipped_kernels("backward" in name)[name]
    imported, cpu = time.perf_counter(), time.process_time()
    cubin = compile_cubin(pyfunc, argtypes, arch)
    compiled, cpu = time.perf_counter(), time.process_time() - cpu
    report = report_from_cubin(cubin, name, arch)
    if sass_dir:  # instructions with their encodings, without addresses: diffable across builds
        lines = [m.group(1).strip() for line in report.sass.splitlines()
                 if (m := _SASS_LINE.match(line))]
        Path(sass_dir, f"{name}@{arch}.sass").write_text("\n".join(lines) + "\n")
    return {"kernel": name, "arch": arch, "compile_s": round(compiled - imported, 2),
            "cpu_s": round(cpu, 2), "import_s": round(imported - start, 2), "registers": report.registers,
            "instructions": sum(report.opcodes.values()), "ldl": report.count("LDL"),
            "stl": report.count("STL"), "call": report.count("CALL")}


def shipped_kernels(backward: bool = False) -> dict:
    """name -> (kernel, argument types, targets): the shipped forward kernels, or with
    ``backward`` the shipped backward kernels (prepare, main and dQ; every name holds
    "backward")."""
    from numbaflash.tools.registry import backward_kernels, forward_kernels

    return backward_kernels() if backward else forward_kernels()


def run_pair(pair: tuple[str, str], sass_dir: str = "") -> dict:
    env = dict(os.environ, NUMBAFLASH_CACHE="0", CUDA_VISIBLE_DEVICES="")
    extra = ["--sass-dir", sass_dir] if sass_dir else []
    done = subprocess.run([sys.executable, __file__, "--one", *pair, *extra], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode != 0:
        raise RuntimeError(f"{pair}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> str:
    times = sorted(float(r["compile_s"]) for r in rows)
    slowest = max(rows, key=lambda r: float(r["compile_s"]))
    return (f"{len(rows)} pairs: median {statistics.median(times):.1f} s, slowest {times[-1]:.1f} s "
            f"({slowest['kernel']}@{slowest['arch']}), total {sum(times):.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="pairs compiled at once (default 1)")
    parser.add_argument("--only", default="", help="only kernels whose name contains this")
    parser.add_argument("--arch", default="", help="only this architecture")
    parser.add_argument("--backward", action="store_true", help="the backward kernels instead of the forward")
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--summary", help="print the summary of a CSV written earlier and exit")
    parser.add_argument("--sass-dir", default="", help="also write each pair's SASS here (KERNEL@ARCH.sass)")
    parser.add_argument("--one", nargs=2, metavar=("KERNEL", "ARCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(*args.one, args.sass_dir)))
        return 0
    if args.summary:
        with open(args.summary) as f:
            print(summary(list(csv.DictReader(f))))
        return 0
    kernels = shipped_kernels(args.backward)
    pairs = [(name, arch) for name, (_, _, archs) in sorted(kernels.items()) for arch in archs
             if args.only in name and args.arch in ("", arch)]
    print("  ".join(FIELDS), flush=True)
    rows = []
    if args.sass_dir:
        os.makedirs(args.sass_dir, exist_ok=True)
        args.sass_dir = os.path.abspath(args.sass_dir)
    with ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(lambda pair: run_pair(pair, args.sass_dir), pairs):
            rows.append(row)
            print("  ".join(str(row[f]) for f in FIELDS), flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
