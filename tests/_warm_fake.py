"""A cheap stand-in for ``configs.kernel_cubin``, run by ``operations.warm``'s worker processes in
``test_warm_cpu.py`` (a module of its own, so that the worker can import it by name).

Each call leaves a file in ``$WARM_FAKE_DIR`` (the compiles, counted across processes), sleeps
``$WARM_FAKE_SLEEP`` seconds, and returns a cache entry whose cubin names the spec. A softcap
spec fails (its error's text comes back), and a spec of head dim 32 ends the worker process
(as a crash would)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from numbaflash.runtime.cache import CacheEntry


def cubin_of(spec) -> bytes:
    return f"cubin of {spec!r}".encode()


def compile_entry(spec) -> CacheEntry:
    folder = Path(os.environ["WARM_FAKE_DIR"])
    (folder / f"{spec.operation}-{os.getpid()}-{uuid.uuid4().hex}").write_text(repr(spec))
    time.sleep(float(os.environ.get("WARM_FAKE_SLEEP", "0")))
    if spec.softcap:
        raise ValueError(f"fake compile error for {spec.kind}")
    if spec.config.head_dim == 32:
        os._exit(3)
    print("noise on stdout that must not reach the frames")
    return CacheEntry(f"key-{spec.operation}", f"{spec.operation}_entry", cubin_of(spec))


def compiles(folder: Path) -> list[str]:
    """The operations compiled so far, one per call."""
    return sorted(p.name.split("-")[0] for p in folder.iterdir())


def compile_cached(spec) -> CacheEntry:
    """As ``configs.kernel_cubin`` does: the cache's entry if it holds one, else ``compile_entry``'s,
    stored."""
    from numbaflash import configs
    from numbaflash.runtime import cache

    key = configs.kernel_key(spec)
    entry = cache.load(key)
    if entry is None:
        made = compile_entry(spec)
        entry = CacheEntry(key, made.entry_name, made.cubin)
        cache.store(entry)
    return entry
