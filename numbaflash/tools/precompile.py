"""Compile kernels into the on-disk cache with no GPU, so that a later GPU process compiles nothing.

By default: every kernel a GPU of each target may run unforced, float16 and bfloat16, causal and
not: the forward kernels it dispatches, the backward's three kernels (prepare, main, dQ) of each
config it runs, and decode's, each plain and in the variants a call may ask for (a sliding window,
a softcap, both; packed variable-length sequences for the forward and the backward), and MLA
decode's (``flash_mla_with_kvcache``).

    python -m numbaflash.precompile                        # what sm_80, sm_86, sm_89, sm_90a GPUs run
    python -m numbaflash.precompile --arch sm_90a          # one target
    python -m numbaflash.precompile --arch sm_90a --candidates   # also every autotune candidate
    python -m numbaflash.precompile --forward-only         # not the backward's kernels
    python -m numbaflash.precompile --plain                # no window, softcap or varlen kernels
    python -m numbaflash.precompile --list                 # what the cache holds
    python -m numbaflash.precompile --clear                # remove entries of other versions
    python -m numbaflash.precompile --clear --all          # remove every entry

It runs one compile process per CPU (``--jobs``), each compiling a group of neighbouring kernels
in a row (``Schedule``), since neighbours share most of their device functions' compiles.

For Docker images, CI and clusters: run it once where the image is built (``CUDA_VISIBLE_DEVICES=``
is fine), with ``NUMBAFLASH_CACHE_DIR`` pointing where the GPU processes will look.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence

DEFAULT_ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90a")
BAR_WIDTH = 30


def capability_of(arch: str) -> tuple[int, int]:
    from ..runtime.compiler import parse_arch

    cc = parse_arch(arch)
    return cc[0], cc[1]


# (window, softcap) of a masked kernel: plain, then the variants a call may ask for (issue 35)
MASKS = ((False, False), (True, False), (False, True), (True, True))
PLAIN = ((False, False, False),)  # (window, softcap, varlen) of the plain kernels
# (window, softcap, varlen) of every forward and backward kernel a call may run
VARIANTS = tuple((window, softcap, varlen) for varlen in (False, True) for window, softcap in MASKS)


def kernels_for(arch: str, candidates: bool, variants: bool = False) -> list:
    """The specs (``kernels.spec.KernelSpec``) of every forward kernel a GPU of ``arch`` dispatches
    (the tuned table, each sequence span's entry), with ``variants`` also its window, softcap and
    packed variable-length kernels (``VARIANTS``, each on the config its call picks:
    ``configs.forward_config(window=, varlen=)``), and with ``candidates`` the plain kernels of
    every config autotune, tests and the sanitizer may force; each once."""
    from ..configs import LONG_SEQLEN, SHORT_SEQLEN, SUPPORTED_HEAD_DIMS, forward_config, runnable_candidates
    from ..kernels.families import spec_of

    cap = capability_of(arch)
    items = []
    for head_dim in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            for window, softcap, varlen in VARIANTS if variants else PLAIN:
                chosen = []
                for span in (None, SHORT_SEQLEN, LONG_SEQLEN):  # the plain, short- and long-sequence entries
                    config = forward_config(cap, head_dim, causal, seqlen=span, window=window, varlen=varlen)
                    chosen += [config] if config not in chosen else []
                if candidates and (window, softcap, varlen) == PLAIN[0]:
                    chosen += [c for c in runnable_candidates(cap, head_dim) if c not in chosen]
                items += [spec_of(config, "forward", bf16, arch, causal=causal, window=window,
                                  softcap=softcap, varlen=varlen)
                          for config in chosen for bf16 in (False, True)]
    return list(dict.fromkeys(items))


def backward_kernels_for(arch: str, candidates: bool, variants: bool = False) -> list:
    """The specs of every backward kernel a GPU of ``arch`` runs (each config's prepare, main and
    dQ kernels; the mma.sync backward runs on every GPU, Hopper included), with ``variants`` also
    those of its window, softcap and packed variable-length calls (``VARIANTS``, each on the family
    and config its call picks: ``configs.backward_config(window=, softcap=, varlen=)``; short and
    long query sequences, ``long=``), and with
    ``candidates`` the plain kernels of every backward candidate, and the GQA-split build of each
    Hopper backward main kernel among them (``KernelSpec.group_split``); each once (the prepare
    and dQ kernels serve causal and non-causal calls, and every window and softcap, alike:
    ``kernels.spec.CAUSAL_FREE``)."""
    import dataclasses

    from ..configs import BACKWARD_CANDIDATES, BACKWARD_DEFAULTS, backward_config, backward_for_target
    from ..kernels.families import BACKWARD_OPERATIONS, FAMILIES, spec_of

    cap = capability_of(arch)
    items = []
    for head_dim in BACKWARD_DEFAULTS:
        for causal in (False, True):
            for window, softcap, varlen in VARIANTS if variants else PLAIN:
                chosen = []
                for long in (False, True) if not varlen else (False,):  # ``configs.backward_is_long``
                    try:
                        config = backward_config(cap, head_dim, causal, window=window, softcap=softcap,
                                                 varlen=varlen, long=long)
                    except RuntimeError:  # no tile of this head dim fits the GPU (d256 on 99 KB a CTA)
                        continue
                    if config not in chosen:
                        chosen.append(config)
                if candidates and (window, softcap, varlen) == PLAIN[0]:
                    chosen += [t for c in BACKWARD_CANDIDATES[head_dim]
                               if (t := backward_for_target(c, cap)) not in chosen]
                items += [spec_of(config, operation, bf16, arch, causal=causal, window=window,
                                  softcap=softcap, varlen=varlen)
                          for config in chosen for bf16 in (False, True) for operation in BACKWARD_OPERATIONS]
    # The GQA-split build of each main kernel of a family that splits (the Hopper backward's:
    # ``operations.backward.call_group_splits``), which its calls with a small grid run.
    items += [dataclasses.replace(s, group_split=True) for s in items
              if s.operation == "backward" and FAMILIES[s.family].group_splits]
    return list(dict.fromkeys(items))


def decode_kernels_for(arch: str, variants: bool = False) -> list:
    """The specs of every decode kernel a GPU of ``arch`` runs: the attention kernel of each config
    it dispatches (``configs.decode_configs_for``), causal or not (with ``variants`` also with a
    window, a softcap or both: ``MASKS``), and each config's combine kernel (causal-free:
    ``kernels.spec.CAUSAL_FREE``); each once."""
    from ..configs import decode_configs_for
    from ..kernels.families import DECODE_OPERATIONS, spec_of

    masks = MASKS if variants else MASKS[:1]
    items = [spec_of(config, operation, bf16, arch, causal=causal, window=window, softcap=softcap)
             for config in decode_configs_for(capability_of(arch)) for operation in DECODE_OPERATIONS
             for causal in (False, True) for window, softcap in masks for bf16 in (False, True)]
    return list(dict.fromkeys(items))


def mla_kernels_for(arch: str) -> list:
    """The specs of every MLA decode kernel (``flash_mla_with_kvcache``) a GPU of ``arch`` runs: the
    attention kernel of each config it dispatches (``configs.mla_decode_configs_for``: 16, 32 and 64
    rows, contiguous or paged), causal or not, both dtypes, and each config's combine kernel; each
    once."""
    from ..configs import mla_decode_configs_for
    from ..kernels.families import DECODE_OPERATIONS, spec_of

    items = [spec_of(config, operation, bf16, arch, causal=causal)
             for config in mla_decode_configs_for(capability_of(arch)) for operation in DECODE_OPERATIONS
             for causal in (False, True) for bf16 in (False, True)]
    return list(dict.fromkeys(items))


def plan(arches: Sequence[str], candidates: bool = False, backward: bool = True, decode: bool = True,
         variants: bool = True) -> dict[str, dict[str, list]]:
    """What ``precompile`` builds: arch -> {"forward", "backward", "decode", "mla"} -> specs
    (``backward``, ``decode`` False: none of theirs, nor MLA decode's; ``variants`` False: the plain
    kernels only)."""
    return {arch: {"forward": kernels_for(arch, candidates, variants),
                   "backward": backward_kernels_for(arch, candidates, variants) if backward else [],
                   "decode": decode_kernels_for(arch, variants) if decode else [],
                   "mla": mla_kernels_for(arch) if decode else []}
            for arch in arches}


def summary(arch: str, parts: dict[str, list]) -> str:
    """One line of what ``precompile`` builds for ``arch``: ``precompile sm_90a: 228 kernels
    (forward 64, backward 112 of which 16 GQA-split, decode 52)``."""
    def count(specs: list) -> str:
        split = sum(getattr(s, "group_split", False) for s in specs)
        return f"{len(specs)}{f' of which {split} GQA-split' if split else ''}"

    counts = ", ".join(f"{name} {count(specs)}" for name, specs in parts.items() if specs)
    return f"precompile {arch}: {sum(len(specs) for specs in parts.values())} kernels ({counts})"


# Seconds a kernel of each operation takes to compile from nothing (2-core machine, 2026-11-28: a
# backward main kernel 3-5 s, a forward or decode kernel 2-4 s, a prepare, dQ or combine kernel
# about 1 s): what ``schedule`` balances.
COMPILE_SECONDS = {"backward": 4.0, "forward": 3.0, "decode": 2.5}


def compile_cost(spec) -> float:
    """The estimated compile time of ``spec``'s kernel (``COMPILE_SECONDS``; 1 s for the others)."""
    return COMPILE_SECONDS.get(spec.operation, 1.0)


def affinity(spec) -> tuple:
    """The group whose kernels one process should compile in a row: the target, the call (the
    forward, the backward's three kernels, decode and its combine) and the head dim. Their
    device functions are largely equal (``runtime.compiler.device_functions_shared``: a process
    types each once), and their kernels sometimes (``compiler.function_fingerprint``: compiled
    once)."""
    call = spec.operation.split("_")[0]
    return spec.arch, call, spec.config.head_dim


def neighbourly(spec) -> tuple:
    """The order within an ``affinity`` group: each config's kernels together, each dtype's
    together, then the variants, so that consecutive kernels share the most."""
    return (spec.family, repr(spec.config), spec.dtype, spec.operation, spec.varlen, spec.window,
            spec.softcap, spec.causal)


class Schedule:
    """Which kernel each compile process takes next: the ``affinity`` groups, the costliest first
    (``compile_cost``), one to a process, which then takes its group's kernels in order
    (``neighbourly``); a process whose group is done starts the next group not yet started, and
    once every group has started it takes the back half of the group with the most work left, so
    that no process idles while another has a queue, and each still compiles neighbours."""

    def __init__(self, items: Sequence) -> None:
        groups: dict[tuple, list] = {}
        for spec in items:
            groups.setdefault(affinity(spec), []).append(spec)
        runs = [sorted(g, key=neighbourly) for g in groups.values()]
        self.waiting = sorted(runs, key=lambda run: -sum(map(compile_cost, run)))
        self.running: dict[int, list] = {}  # process -> what is left of its run

    def next_for(self, worker: int):
        """The next kernel for process ``worker``, or None when nothing is left for it."""
        run = self.running.get(worker)
        if not run:
            if self.waiting:
                run = self.waiting.pop(0)
            else:
                busiest = max(self.running.values(), key=lambda r: sum(map(compile_cost, r)), default=[])
                if len(busiest) < 2:
                    self.running.pop(worker, None)
                    return None
                half = len(busiest) // 2
                run = busiest[half:]
                del busiest[half:]
            self.running[worker] = run
        return run.pop(0)

    def order(self) -> list:
        """Every kernel in the order one process would take them."""
        taken = []
        while (spec := self.next_for(0)) is not None:
            taken.append(spec)
        return taken


def build_one(spec) -> tuple[str, bool, float]:
    """Compile one kernel (its ``kernels.spec.KernelSpec``) into the cache: (description,
    compiled, seconds)."""
    from ..configs import kernel_cubin
    from ..runtime import cache

    start = time.perf_counter()
    before = cache.STATS["compiles"]
    kernel_cubin(spec)
    compiled = cache.STATS["compiles"] > before
    return cache.describe(spec), compiled, time.perf_counter() - start


def _serve(worker: int, tasks, results) -> None:
    """A compile process: ``build_one`` each spec ``tasks`` gives until None; each result (or
    the error's traceback) onto ``results`` with ``worker``."""
    import traceback

    from ..runtime import cache

    cache.show_compile_progress()
    while (spec := tasks.get()) is not None:
        try:
            results.put((worker, build_one(spec), None))
        except BaseException:  # noqa: BLE001 - handed to the parent, which raises it
            results.put((worker, None, traceback.format_exc()))


def compile_all(items: Sequence, workers: int) -> Iterator[tuple[str, bool, float]]:
    """``build_one`` of every spec in ``items``, in ``Schedule``'s order, by ``workers``
    processes (one: in this process); yields each result as it comes. A failed compile raises
    RuntimeError with the process's traceback; so does a process that dies."""
    schedule = Schedule(items)
    if workers <= 1:
        from ..runtime import cache

        cache.show_compile_progress()
        for spec in schedule.order():
            yield build_one(spec)
        return
    import multiprocessing
    import queue

    context = multiprocessing.get_context()
    results = context.Queue()
    tasks = [context.SimpleQueue() for _ in range(workers)]
    processes = [context.Process(target=_serve, args=(w, tasks[w], results), daemon=True)
                 for w in range(workers)]
    for process in processes:
        process.start()
    try:
        busy = set()
        for worker in range(workers):
            spec = schedule.next_for(worker)
            if spec is not None:
                tasks[worker].put(spec)
                busy.add(worker)
        while busy:
            try:
                worker, result, error = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in busy if not processes[w].is_alive()]
                if dead:
                    raise RuntimeError(f"numbaflash.precompile: compile process {dead[0]} died "
                                       f"(exit code {processes[dead[0]].exitcode})") from None
                continue
            if error is not None:
                raise RuntimeError(f"numbaflash.precompile: a compile failed in process {worker}:\n{error}")
            yield result
            spec = schedule.next_for(worker)
            if spec is None:
                busy.discard(worker)
            else:
                tasks[worker].put(spec)
    finally:
        for worker, process in enumerate(processes):
            if process.is_alive():
                tasks[worker].put(None)
        for process in processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.terminate()


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
               backward: bool = True, decode: bool = True, variants: bool = True) -> dict:
    """Fill the cache for ``arches`` (``plan``: the forward kernels, with ``backward`` the
    backward's, with ``decode`` the decode kernels; with ``variants`` each also in its window,
    softcap and varlen variants) with ``jobs`` processes (``compile_all``; default: the CPU
    count); prints one ``summary`` line per target; returns counts {"kernels", "compiled",
    "cached"}."""
    from ..runtime import cache

    if not cache.enabled():
        raise SystemExit("numbaflash.precompile: the cache is off (NUMBAFLASH_CACHE=0); nothing to do")
    planned = plan(arches, candidates, backward, decode, variants)
    items = []
    for arch, parts in planned.items():
        print(summary(arch, parts), file=sys.stderr)
        items += [spec for specs in parts.values() for spec in specs]
    counts = {"kernels": len(items), "compiled": 0, "cached": 0}
    workers = min(jobs or os.cpu_count() or 1, len(items))
    print(f"numbaflash.precompile: {len(items)} kernels for {', '.join(arches)} into {cache.cache_root()} "
          f"({workers} processes)", file=sys.stderr)
    progress(0, len(items), "")
    # Each process prints the line a compile logs when it starts (after a second), the bar when it ends.
    for done, (label, compiled, seconds) in enumerate(compile_all(items, workers), start=1):
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
    parser.add_argument("--plain", action="store_true",
                        help="only the plain kernels (not the window, softcap and varlen variants)")
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
                        decode=not args.forward_only, variants=not args.plain)
    print(f"{counts['kernels']} kernels: {counts['compiled']} compiled, {counts['cached']} already cached "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
