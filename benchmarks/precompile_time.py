"""Time ``numbaflash.precompile`` from an empty cache: wall time and the CPU time of every process
(this one and its compile processes), on the whole plan or a slice of it.

    python benchmarks/precompile_time.py --arch sm_90a                  # all 600 kernels, CPU-count processes
    python benchmarks/precompile_time.py --arch sm_90a --head-dim 128 --dtype bfloat16 --jobs 2
    PYTHONPATH=/path/to/other/tree python benchmarks/precompile_time.py ...   # the same on other code

A slice keeps whole calls of one head dim and dtype (the forward, the backward's three kernels,
decode and its combine), so that it compiles neighbours as the whole plan does. Each run uses a
new empty cache folder (``NUMBAFLASH_CACHE_DIR`` if set and empty, else a temporary one), so
every kernel compiles. The last line is JSON: kernels, processes, wall_s, cpu_s, cpu_per_kernel_s,
max_rss_mib (the largest process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time


def cpu_seconds() -> float:
    """User and system time of this process and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def max_rss_mib() -> int:
    """The largest resident size of this process or of any of its ended children, MiB."""
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    return max(resource.getrusage(w).ru_maxrss for w in who) // 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--head-dim", type=int, default=None, help="only this head dim's kernels")
    parser.add_argument("--dtype", default=None, choices=("float16", "bfloat16"), help="only this dtype's")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    args = parser.parse_args()

    folder = os.environ.get("NUMBAFLASH_CACHE_DIR")
    if not folder or (os.path.isdir(folder) and os.listdir(folder)):
        folder = tempfile.mkdtemp(prefix="numbaflash-precompile-")
    os.environ["NUMBAFLASH_CACHE_DIR"] = folder
    os.environ.pop("NUMBAFLASH_CACHE", None)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    from numbaflash.tools import precompile

    whole = precompile.plan

    def sliced(*a, **k):
        return {arch: {part: [s for s in specs
                              if (args.head_dim is None or s.config.head_dim == args.head_dim)
                              and (args.dtype is None or s.dtype == args.dtype)]
                       for part, specs in parts.items()}
                for arch, parts in whole(*a, **k).items()}

    precompile.plan = sliced
    start, cpu = time.perf_counter(), cpu_seconds()
    counts = precompile.precompile([args.arch], jobs=args.jobs)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    print(json.dumps({"kernels": counts["kernels"], "compiled": counts["compiled"], "processes": args.jobs
                      or os.cpu_count(), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                      "cpu_per_kernel_s": round(cpu / max(counts["kernels"], 1), 2),
                      "max_rss_mib": max_rss_mib(), "cache": folder}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
