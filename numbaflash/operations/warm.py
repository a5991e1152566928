"""Compile kernels a call will need soon in worker processes, while this process compiles the one
it needs now: a first training step's backward kernels while its forward's kernel compiles.

``start(specs)`` hands the kernels (``kernels.spec.KernelSpec``) that are neither pending nor in
the on-disk cache to worker processes and returns at once; ``entry_of(spec)``, what
``forward.loaded_kernel`` asks for every kernel it loads, waits on a pending compile of ``spec``
instead of starting another and takes the worker's cubin. A worker that fails (or dies) leaves
nothing behind: ``entry_of`` then compiles in this process, which raises the real error.

- **Processes, not threads:** compiling (Numba typing and lowering) holds the GIL.
- **Fresh interpreters** (``python -m numbaflash.operations.warm``), never forks of this process
  (which holds a CUDA context and threads) and never a re-run of the caller's main module (as
  multiprocessing's spawn would do to a script without a ``__main__`` guard). A worker gets its
  specs on stdin (one pickle) and answers each with one frame on stdout (the cache entry, or the
  error's text); it sees no GPU (``CUDA_VISIBLE_DEVICES=``: compiling needs none) and runs at a
  lower priority (``WORKER_NICE``), so the foreground compile keeps its core.
- **How many:** at most one fewer than the CPUs this process may run on (the foreground compile
  keeps one), none on a one-CPU machine: there the kernels compile in the foreground when needed.
- **The cache:** a worker stores what it compiles (``configs.kernel_cubin``), atomically, as
  every process does, so processes sharing a cache folder each find whole entries; and it
  returns the entry itself, so this process needs no write access to the folder (nor the cache
  on: ``NUMBAFLASH_CACHE=0``). Workers of processes that share the folder (the ranks of one
  job) compile each kernel once: a lock file per kernel (``compile_lock``), the others load it.
- ``NUMBAFLASH_BACKGROUND_COMPILE=0`` (or ``false``/``off``/``no``) turns it off.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .. import configs
from ..kernels.spec import KernelSpec
from ..runtime import cache

LOG = logging.getLogger("numbaflash")
ENV = "NUMBAFLASH_BACKGROUND_COMPILE"
WORKER_NICE = 10  # added to a worker's niceness: the foreground compile runs first on a busy core
WAIT_S = 900.0  # the longest wait for a worker's kernel (a hung worker): then it compiles in the foreground
_FRAME = struct.Struct("<Q")  # the length of each pickled frame a worker writes
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds numbaflash/

# spec -> Future of its runtime.cache.CacheEntry, while a worker compiles it
PENDING: dict[KernelSpec, concurrent.futures.Future] = {}
_LOCK = threading.Lock()
_WORKERS: list[subprocess.Popen] = []  # running workers, ended at exit


def enabled() -> bool:
    """False when ``NUMBAFLASH_BACKGROUND_COMPILE=0`` (or ``false``/``off``/``no``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cached(spec: KernelSpec) -> bool:
    """Whether the on-disk cache holds ``spec``'s kernel (a file for its key: the load checks it)."""
    return cache.enabled() and cache.entry_path(configs.kernel_key(spec)).is_file()


def start(specs: Sequence[KernelSpec], kind: str, what: str, compile: Callable | None = None) -> int:
    """Compile ``specs`` in worker processes, those not pending and not cached; returns how many.
    ``kind`` and ``what`` name them in the one INFO line this logs on the ``numbaflash`` logger
    (``numbaflash: compiling 3 backward kernels in the background (2 worker processes) for
    <what>``). ``compile``: a module-level function of a spec that returns its
    ``runtime.cache.CacheEntry``, run in the workers (default ``configs.kernel_cubin``)."""
    if not enabled():
        return 0
    most = cpus() - 1
    if most < 1:
        return 0
    with _LOCK:
        todo = [s for s in dict.fromkeys(specs) if s not in PENDING]
    todo = [s for s in todo if not _cached(s)]
    with _LOCK:
        todo = [s for s in todo if s not in PENDING]
        futures = {s: concurrent.futures.Future() for s in todo}
        PENDING.update(futures)
    if not todo:
        return 0
    workers = min(most, len(todo))
    groups = [todo[i::workers] for i in range(workers)]
    LOG.info("numbaflash: compiling %d %s kernel%s in the background (%d worker process%s) for %s", len(todo),
             kind, "s" * (len(todo) > 1), workers, "es" * (workers > 1), what)
    for group in groups:
        thread = threading.Thread(target=_run_worker, args=(group, [futures[s] for s in group], compile),
                                  name="numbaflash-background-compile", daemon=True)
        thread.start()
    return len(todo)


def entry_of(spec: KernelSpec):
    """``configs.kernel_cubin(spec)``, but a kernel a worker compiles is waited for and taken from
    it; where the worker failed, compiled here (which raises the real error)."""
    with _LOCK:
        future = PENDING.get(spec)
    if future is not None:
        try:
            entry = future.result(timeout=WAIT_S)
        except Exception as exc:  # failed or hung: the foreground compile below raises the real error
            LOG.debug("numbaflash: the background compile of %s failed (%s); compiling it here",
                      cache.describe(spec), exc)
            entry = None
        with _LOCK:
            if PENDING.get(spec) is future:
                del PENDING[spec]
        if entry is not None:
            return entry
    return configs.kernel_cubin(spec)


def _run_worker(specs: list[KernelSpec], futures: list[concurrent.futures.Future],
                compile: Callable | None) -> None:
    """Run one worker process over ``specs`` and settle each future with its frame; the futures a
    worker never answered fail with its exit status and the end of its stderr."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    try:
        with tempfile.TemporaryFile() as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "numbaflash.operations.warm"], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
            _WORKERS.append(proc)
            try:
                proc.stdin.write(pickle.dumps((compile, specs)))
                proc.stdin.close()
                while True:
                    head = proc.stdout.read(_FRAME.size)
                    if len(head) < _FRAME.size:
                        break
                    index, ok, payload = pickle.loads(proc.stdout.read(_FRAME.unpack(head)[0]))
                    if ok:
                        futures[index].set_result(payload)
                    else:
                        futures[index].set_exception(RuntimeError(payload))
                status = proc.wait()
            finally:
                _WORKERS.remove(proc)
                if proc.poll() is None:  # a broken pipe: end it
                    proc.kill()
                    proc.wait()
            stderr.seek(0)
            tail = stderr.read()[-2000:].decode(errors="replace")
        failure: BaseException = RuntimeError(f"background compile worker exited with status {status}: "
                                              f"{tail}")
    except BaseException as exc:  # could not start it, or a broken pipe: the foreground compiles
        failure = exc
    for future in futures:
        if not future.done():
            future.set_exception(failure)


@atexit.register
def _end_workers() -> None:
    for proc in list(_WORKERS):
        proc.kill()


@contextlib.contextmanager
def compile_lock(spec: KernelSpec) -> Iterator[None]:
    """Hold ``spec``'s lock file beside its cache entry (``<key>.lock``, ``fcntl.flock``): workers of
    processes that share the cache folder (the ranks of one job) compile a kernel once; the others
    wait, then load the entry (``configs.kernel_cubin`` looks in the cache first). Without a cache,
    or where the folder cannot hold a lock, no lock."""
    handle = None
    if cache.enabled():
        try:
            import fcntl

            path = cache.entry_path(configs.kernel_key(spec)).with_suffix(".lock")
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a")  # noqa: SIM115 (held across the yield)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except Exception:  # no fcntl, a folder that takes no lock, no key: compile unlocked
            if handle is not None:
                handle.close()
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def worker_main() -> int:
    """A worker: read (compile function, specs) from stdin, compile each, write one frame per spec
    ((index, True, CacheEntry) or (index, False, the error's text)) on stdout."""
    try:
        os.nice(WORKER_NICE)
    except (AttributeError, OSError):
        pass
    compile, specs = pickle.load(sys.stdin.buffer)
    compile = compile or configs.kernel_cubin
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the compile prints goes to stderr, not into the frames
    for index, spec in enumerate(specs):
        try:
            with compile_lock(spec):
                frame = (index, True, compile(spec))
        except Exception as exc:
            frame = (index, False, f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(frame)
        out.write(_FRAME.pack(len(data)) + data)
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
