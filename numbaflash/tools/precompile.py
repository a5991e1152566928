"""Compile kernels into the on-disk cache with no GPU, so that a later GPU process compiles nothing.

By default: the forward kernels each target dispatches, and the backward's three kernels (prepare,
main, dQ) of each config it runs, causal and not, float16 and bfloat16.

    python -m numbaflash.precompile                        # what sm_80, sm_86, sm_89, sm_90a GPUs run
    python -m numbaflash.precompile --arch sm_90a          # one target
    python -m numbaflash.precompile --arch sm_90a --candidates   # also every autotune candidate
    python -m numbaflash.precompile --forward-only         # not the backward's kernels
    python -m numbaflash.precompile --list                 # what the cache holds
    python -m numbaflash.precompile --clear                # remove entries of other versions
    python -m numbaflash.precompile --clear --all          # remove every entry

For Docker images, CI and clusters: run it once where the image is built (``CUDA_VISIBLE_DEVICES=``
is fine), with ``NUMBAFLASH_CACHE_DIR`` pointing where the GPU processes will look.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

DEFAULT_ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90a")
BAR_WIDTH = 30


def capability_of(arch: str) -> tuple[int, int]:
    from ..runtime.compiler import parse_arch

    cc = parse_arch(arch)
    return cc[0], cc[1]


def kernels_for(arch: str, candidates: bool) -> list:
    """The specs (``kernels.spec.KernelSpec``) of every forward kernel a GPU of ``arch`` dispatches
    (the tuned table), and with ``candidates`` of every config autotune, tests and the sanitizer
    may force."""
    from ..configs import LONG_SEQLEN, SHORT_SEQLEN, SUPPORTED_HEAD_DIMS, forward_config, runnable_candidates

    cap = capability_of(arch)
    configs = []
    for head_dim in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            chosen = [forward_config(cap, head_dim, causal)]
            for span in (SHORT_SEQLEN, LONG_SEQLEN):  # the short- and long-sequence entries
                config = forward_config(cap, head_dim, causal, seqlen=span)
                chosen += [config] if config not in chosen else []
            if candidates:
                chosen += [c for c in runnable_candidates(cap, head_dim) if c not in chosen]
            configs += [(config, causal) for config in chosen]
    from ..kernels.families import spec_of

    return [spec_of(config, "forward", bf16, arch, causal=causal) for config, causal in configs
            for bf16 in (False, True)]


def backward_kernels_for(arch: str, candidates: bool) -> list:
    """The specs of every backward kernel a GPU of ``arch`` runs (each config's prepare, main and
    dQ kernels; the mma.sync backward runs on every GPU, Hopper included), and with ``candidates``
    those of every backward candidate; each once (the prepare and dQ kernels serve causal and
    non-causal calls alike: ``kernels.spec.CAUSAL_FREE``)."""
    from ..configs import BACKWARD_CANDIDATES, BACKWARD_DEFAULTS, backward_config, backward_for_target
    from ..kernels.families import BACKWARD_OPERATIONS, spec_of

    cap = capability_of(arch)
    items = []
    for head_dim in BACKWARD_DEFAULTS:
        for causal in (False, True):
            try:
                chosen = [backward_config(cap, head_dim, causal)]
            except RuntimeError:  # no tile of this head dim fits the GPU (d256 on 99 KB a CTA)
                chosen = []
            if candidates:
                chosen += [t for c in BACKWARD_CANDIDATES[head_dim]
                           if (t := backward_for_target(c, cap)) not in chosen]
            items += [spec_of(config, operation, bf16, arch, causal=causal)
                      for config in chosen for bf16 in (False, True) for operation in BACKWARD_OPERATIONS]
    return list(dict.fromkeys(items))


def decode_kernels_for(arch: str) -> list:
    """The specs of every decode kernel a GPU of ``arch`` runs: the attention kernel of each config
    it dispatches (``configs.decode_configs_for``), causal or not, and each config's combine
    kernel (causal-free: ``kernels.spec.CAUSAL_FREE``); each once."""
    from ..configs import decode_configs_for
    from ..kernels.families import DECODE_OPERATIONS, spec_of

    items = [spec_of(config, operation, bf16, arch, causal=causal)
             for config in decode_configs_for(capability_of(arch)) for operation in DECODE_OPERATIONS
             for causal in (False, True) for bf16 in (False, True)]
    return list(dict.fromkeys(items))


def build_one(spec) -> tuple[str, bool, float]:
    """Compile one kernel (its ``kernels.spec.KernelSpec``) into the cache (a worker process):
    (description, compiled, seconds)."""
    from ..configs import kernel_cubin
    from ..runtime import cache

    start = time.perf_counter()
    before = cache.STATS["compiles"]
    kernel_cubin(spec)
    compiled = cache.STATS["compiles"] > before
    return cache.describe(spec), compiled, time.perf_counter() - start


def progress(done: int, total: int, label: str, stream=sys.stderr) -> None:
    """One progress line: a bar on a terminal (redrawn in place), plain lines otherwise."""
    filled = BAR_WIDTH * done // max(total, 1)
    line = f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {done}/{total} {label}"
    if stream.isatty():
        stream.write("\r\033[K" + line + ("\n" if done == total else ""))
    else:
        stream.write(line + "\n")
    stream.flush()


def precompile(arches: Sequence[str], candidates: bool = False, jobs: int | None = None,
               backward: bool = True, decode: bool = True) -> dict:
    """Fill the cache for ``arches`` (the forward kernels, with ``backward`` the backward's, with
    ``decode`` the decode kernels);
    returns counts {"kernels", "compiled", "cached"}."""
    from ..runtime import cache

    if not cache.enabled():
        raise SystemExit("numbaflash.precompile: the cache is off (NUMBAFLASH_CACHE=0); nothing to do")
    items = [item for arch in arches for item in kernels_for(arch, candidates)]
    if backward:
        items += [item for arch in arches for item in backward_kernels_for(arch, candidates)]
    if decode:
        items += [item for arch in arches for item in decode_kernels_for(arch)]
    counts = {"kernels": len(items), "compiled": 0, "cached": 0}
    print(f"numbaflash.precompile: {len(items)} kernels for {', '.join(arches)} into {cache.cache_root()}",
          file=sys.stderr)
    progress(0, len(items), "")
    # Each worker prints the line a compile logs when it starts (after a second), the bar when it ends.
    workers = jobs or os.cpu_count() or 1
    with ProcessPoolExecutor(max_workers=workers, initializer=cache.show_compile_progress) as pool:
        for done, (label, compiled, seconds) in enumerate(pool.map(build_one, items), start=1):
            counts["compiled" if compiled else "cached"] += 1
            progress(done, len(items), f"{label} ({'compiled' if compiled else 'cached'}, {seconds:.1f} s)")
    return counts


def list_cache() -> None:
    from ..runtime import cache

    entries = cache.list_entries()
    print(f"cache: {cache.cache_root()}  (this installation: {cache.folder_name()})")
    if not entries:
        print("no entries")
        return
    for e in entries:
        print(f"{'current' if e.current else 'other  '}  {e.size:>8} B  {e.kernel or '(unreadable)'}"
              + ("" if e.current else f"  [{e.toolchain}]"))
    other = sum(not e.current for e in entries)
    total = sum(e.size for e in entries)
    print(f"{len(entries)} entries, {total / 2**20:.1f} MiB; {other} of other versions "
          f"(python -m numbaflash.precompile --clear removes them)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numbaflash.precompile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHES),
                        help=f"comma-separated targets (default: {','.join(DEFAULT_ARCHES)})")
    parser.add_argument("--candidates", action="store_true",
                        help="also every candidate config (what autotune, tests and the sanitizer force)")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    parser.add_argument("--forward-only", action="store_true",
                        help="only the forward kernels (not the backward's or decode's)")
    parser.add_argument("--list", action="store_true", help="list the cache's entries and exit")
    parser.add_argument("--clear", action="store_true", help="remove entries of other versions and exit")
    parser.add_argument("--all", action="store_true", help="with --clear: remove every entry")
    args = parser.parse_args(argv)

    from ..runtime import cache

    if args.list:
        list_cache()
        return 0
    if args.clear:
        removed = cache.clear(everything=args.all)
        print(f"removed {removed} entries from {cache.cache_root()}")
        return 0
    if args.all:
        parser.error("--all goes with --clear")
    arches = [a.strip() for a in args.arch.split(",") if a.strip()]
    for arch in arches:
        try:
            capability_of(arch)
        except ValueError as exc:
            parser.error(str(exc))
    start = time.perf_counter()
    counts = precompile(arches, args.candidates, args.jobs, backward=not args.forward_only,
                        decode=not args.forward_only)
    print(f"{counts['kernels']} kernels: {counts['compiled']} compiled, {counts['cached']} already cached "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
