"""Where a precompile's time goes: compile a group of kernels in one process, in ``precompile``'s
order, and report the CPU seconds of each stage, per kernel and in all.

    python benchmarks/compile_stages.py --call forward --head-dim 96        # the sm_90a forward d96 group
    python benchmarks/compile_stages.py --call backward --head-dim 96 --limit 8
    PYTHONPATH=/path/to/other/tree python benchmarks/compile_stages.py ...   # the same on other code

Stages are exclusive CPU timers (a stage's time leaves out the stages nested in it) wrapped
around: Numba's typing and lowering passes and its other passes (``PassManager._runPass``), the
rest of Numba's compile (``compiler.numba_library``), the LLVM IR printed for NVVM
(``compiler.module_texts``, where the code has it), NVVM (``nvvm.compile_ir``), NVRTC
(``compiler.helper_ltoir``), nvJitLink and what else ``compile_cubin`` does itself, the cache
(key, load, store) and the kernel factories; ``gc``: the garbage collector's own time (inside the
others). Each run uses a new empty cache folder. One JSON line per kernel, then the totals.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter

EXCLUSIVE: Counter = Counter()
_STACK: list = []  # [label, start, time of nested stages]
_GC: list = [0.0, []]  # collector time, start times


def timed(owner, name: str, label) -> None:
    """Wrap ``owner.name`` in an exclusive CPU timer (``label``: a name, or a function of the
    call's arguments giving one)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        _STACK.append([label(args) if callable(label) else label, time.process_time(), 0.0])
        try:
            return original(*args, **kwargs)
        finally:
            stage, start, nested = _STACK.pop()
            spent = time.process_time() - start
            EXCLUSIVE[stage] += spent - nested
            if _STACK:
                _STACK[-1][2] += spent

    setattr(owner, name, wrapper)


def collector(phase: str, info: dict) -> None:
    if phase == "start":
        _GC[1].append(time.process_time())
    else:
        _GC[0] += time.process_time() - _GC[1].pop()


def instrument() -> None:
    from numba.cuda.core import compiler_machinery
    from numba.cuda.cudadrv import nvvm

    from numbaflash import configs
    from numbaflash.kernels import families
    from numbaflash.runtime import cache, compiler

    passes = {"nopython_type_inference": "numba typing", "cuda_native_lowering": "numba lowering"}
    timed(compiler_machinery.PassManager, "_runPass",
          lambda args: passes.get(args[2].name(), "numba other passes"))
    timed(compiler, "numba_library", "numba rest")
    timed(compiler, "compile_cubin", "nvjitlink and the rest")
    if hasattr(compiler, "module_texts"):
        timed(compiler, "module_texts", "llvm ir text")
    timed(nvvm, "compile_ir", "nvvm")
    timed(compiler, "helper_ltoir", "nvrtc")
    for name in ("load", "store", "kernel_key"):
        timed(cache, name, "cache")
    timed(configs, "kernel_sources", "cache")
    timed(families, "make_kernel", "factories")
    gc.callbacks.append(collector)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--call", default="forward", choices=("forward", "backward", "decode"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--limit", type=int, default=0, help="only the first N kernels of the group")
    args = parser.parse_args()
    os.environ["NUMBAFLASH_CACHE_DIR"] = tempfile.mkdtemp(prefix="numbaflash-stages-")
    os.environ.pop("NUMBAFLASH_CACHE", None)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    from numbaflash import configs
    from numbaflash.tools import precompile

    instrument()
    planned = precompile.plan([args.arch])[args.arch][args.call]
    group = [s for s in planned if s.config.head_dim == args.head_dim]
    group.sort(key=lambda s: (s.family, repr(s.config), s.dtype, s.operation, s.varlen, s.window, s.softcap,
                              s.causal))  # precompile.neighbourly, which older code lacks
    group = group[:args.limit] if args.limit else group
    total = Counter()
    for spec in group:
        before, collected, start = Counter(EXCLUSIVE), _GC[0], time.process_time()
        configs.kernel_cubin(spec)
        stages = {k: round(v - before[k], 3) for k, v in EXCLUSIVE.items() if v - before[k] >= 0.001}
        stages["gc"] = round(_GC[0] - collected, 3)
        total.update(stages)
        name = f"{spec.kind} {spec.dtype} {'causal' if spec.causal else 'full'} {spec.config!r}"
        print(json.dumps({"kernel": name, "cpu_s": round(time.process_time() - start, 3), **stages}))
    cpu = sum(v for k, v in total.items() if k != "gc")
    print(json.dumps({"kernels": len(group), "cpu_s": round(cpu, 2),
                      "cpu_per_kernel_s": round(cpu / max(len(group), 1), 2),
                      **{k: round(v, 2) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
