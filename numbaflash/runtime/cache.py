"""On-disk cache of linked kernel cubins, so that a new process compiles nothing it has compiled
before.

numba-cuda's own ``cache=True`` refuses kernels that link files (our PTX helpers), so the
package keeps its own cache of what ``compiler.compile_cubin`` returns.

- **Where:** ``$NUMBAFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/numbaflash``, else
  ``~/.cache/numbaflash``. ``NUMBAFLASH_CACHE=0`` turns the cache off (every process compiles).
- **Layout:** one folder per toolchain (package, numba-cuda, NVVM, NVRTC and nvJitLink
  versions), one file per kernel, named by its key. Other folders are never read;
  ``python -m numbaflash.precompile --list / --clear`` shows and removes them (``--clear --all``
  also this folder's entries left by edited sources).
- **Key:** a SHA-256 over the kernel's sources (the modules of ``numbaflash/kernels`` and of the
  PTX bindings its factory imports, transitively, the compile options and every ``ptx/*.cu``:
  ``kernels.families.kernel_source_files``, through ``configs.kernel_key``), every field of the kernel's spec
  (``kernels.spec.KernelSpec``: family, operation, config, dtype, target, causal and the variant
  axes) and the toolchain versions: any change gives a new key, so stale code is never loaded.
- **Entry:** a header (magic, length, JSON with the key, the kernel's entry name, the cubin's
  size and SHA-256) and the cubin. A file whose header, key, size or checksum does not match
  is ignored and replaced: a truncated, corrupt or foreign file is recompiled, never launched.
- **Writes** go to a temporary file in the same folder, then ``os.replace``: readers see a
  whole entry or none, and processes that store the same kernel at once leave one valid entry.
  A read-only or full cache folder gives one warning, then the process runs without storing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"NUMBAFLASH-CUBIN\x00"
FORMAT = 1
SUFFIX = ".cubin"
_HEADER_LENGTH = struct.Struct("<I")
_MAX_HEADER = 1 << 16
_PACKAGE = Path(__file__).resolve().parent.parent

LOG = logging.getLogger("numbaflash")
# A compile that runs longer than this says so: one line through the ``numbaflash`` logger.
ANNOUNCE_AFTER_S = 1.0

# What this process did: "hits", "compiles", "rejected" (entries ignored as invalid), "stored".
STATS: Counter = Counter()
_WRITE_FAILED = threading.Event()  # set after the first failed store: warn once, then stop storing


@dataclass(frozen=True)
class CacheEntry:
    """One cached kernel: its key, the mangled entry name to load, and the linked cubin."""

    key: str
    entry_name: str
    cubin: bytes


def enabled() -> bool:
    """False when ``NUMBAFLASH_CACHE=0`` (or ``false``/``off``/``no``)."""
    return os.environ.get("NUMBAFLASH_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_root() -> Path:
    """The cache folder (which may not exist yet)."""
    explicit = os.environ.get("NUMBAFLASH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numbaflash"


@functools.cache
def toolchain() -> dict[str, str]:
    """Versions of the compile chain (``compiler.toolchain_versions``), read once per process."""
    from .compiler import toolchain_versions

    return toolchain_versions()


def toolchain_tag(versions: dict[str, str] | None = None) -> str:
    """The folder name of one toolchain, e.g. ``numbaflash-0.1.0_numba-cuda-0.30.4_nvvm-2.0_...``."""
    versions = toolchain() if versions is None else versions
    text = "_".join(f"{name}-{value}" for name, value in sorted(versions.items()))
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)


def folder_name() -> str:
    """This installation's folder: its toolchain (package and compiler versions), so that entries
    left by other versions can be listed and cleared. Edited sources change the keys of the
    kernels they can change (``kernel_key``), not the folder: the other kernels stay cached."""
    return toolchain_tag()


def _source_files() -> list[Path]:
    """Every file whose content can change some kernel's binary: what a kernel with no
    ``source_files()`` of its own is keyed by."""
    from .sources import ptx_directory

    files = sorted((_PACKAGE / "kernels").glob("*.py")) + sorted((_PACKAGE / "ptx").glob("*.py"))
    files += sorted(ptx_directory().glob("*.cu"))
    files.append(Path(__file__).resolve().parent / "compiler.py")  # compile and link options
    return files


@functools.cache
def source_digest(files: tuple[Path, ...] | None = None) -> str:
    """SHA-256 over ``files`` (default: every kernel source, ``_source_files``), read once per
    process."""
    digest = hashlib.sha256()
    for path in _source_files() if files is None else files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def kernel_key(spec, *, sources: str | None = None, versions: dict[str, str] | None = None) -> str:
    """The cache key of one kernel: every field of its spec (a frozen dataclass, e.g.
    ``kernels.spec.KernelSpec``; its config by ``repr``), the digest of its sources and the
    toolchain. ``sources`` defaults to the digest of every kernel source; ``configs.kernel_key``
    gives a registered kernel's own (``kernels.families.kernel_source_files``); ``versions``
    defaults to this installation's."""
    fields = {
        "format": FORMAT,
        **{f.name: repr(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.compare},
        "sources": source_digest() if sources is None else sources,
        "toolchain": toolchain() if versions is None else versions,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def entry_path(key: str) -> Path:
    return cache_root() / folder_name() / (key + SUFFIX)


def encode_entry(entry: CacheEntry, description: str = "") -> bytes:
    """The bytes of a cache file: magic, header length, JSON header, cubin."""
    header = json.dumps({
        "format": FORMAT,
        "key": entry.key,
        "entry_name": entry.entry_name,
        "size": len(entry.cubin),
        "sha256": hashlib.sha256(entry.cubin).hexdigest(),
        "kernel": description,
    }).encode()
    return MAGIC + _HEADER_LENGTH.pack(len(header)) + header + entry.cubin


def read_header(data: bytes) -> tuple[dict, bytes]:
    """(header, cubin) of a cache file's bytes; ValueError if it is not a whole, valid entry."""
    if not data.startswith(MAGIC):
        raise ValueError("not a numbaflash cache entry (bad magic)")
    start = len(MAGIC) + _HEADER_LENGTH.size
    if len(data) < start:
        raise ValueError("truncated header")
    (length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
    if length > _MAX_HEADER or len(data) < start + length:
        raise ValueError("truncated header")
    try:
        header = json.loads(data[start:start + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError("unknown entry format")
    cubin = data[start + length:]
    if header.get("size") != len(cubin):
        raise ValueError(f"cubin is {len(cubin)} bytes, header says {header.get('size')}")
    if header.get("sha256") != hashlib.sha256(cubin).hexdigest():
        raise ValueError("cubin checksum mismatch")
    if not isinstance(header.get("entry_name"), str) or not isinstance(header.get("key"), str):
        raise ValueError("header lacks key or entry name")
    return header, cubin


def decode_entry(data: bytes, key: str) -> CacheEntry:
    """The entry in ``data`` if it is valid and for ``key``; ValueError otherwise."""
    header, cubin = read_header(data)
    if header["key"] != key:
        raise ValueError("entry belongs to another key")
    return CacheEntry(key, header["entry_name"], cubin)


def load(key: str) -> CacheEntry | None:
    """The valid cached entry for ``key``, or None (missing, unreadable or invalid: an invalid
    file is removed, best effort, so that the next store replaces it)."""
    if not enabled():
        return None
    path = entry_path(key)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        entry = decode_entry(data, key)
    except ValueError:
        STATS["rejected"] += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None
    STATS["hits"] += 1
    return entry


def store(entry: CacheEntry, description: str = "") -> bool:
    """Write ``entry`` atomically; False (after one warning per process) if the folder is not
    writable or full."""
    if not enabled() or _WRITE_FAILED.is_set():
        return False
    path = entry_path(entry.key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(encode_entry(entry, description))
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        if not _WRITE_FAILED.is_set():
            _WRITE_FAILED.set()
            warnings.warn(f"numbaflash: cannot write the kernel cache at {path.parent} ({exc}); "
                          f"kernels will be compiled in each process. Set NUMBAFLASH_CACHE_DIR to a "
                          f"writable folder, or NUMBAFLASH_CACHE=0 to silence this.",
                          RuntimeWarning, stacklevel=3)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    STATS["stored"] += 1
    return True


@dataclass(frozen=True)
class ListedEntry:
    """A file in the cache, for ``--list``: its toolchain folder, whether that is this
    installation's, its size and the kernel it holds (empty if unreadable)."""

    path: Path
    toolchain: str
    current: bool
    size: int
    kernel: str


def list_entries() -> list[ListedEntry]:
    """Every entry under the cache folder, this toolchain's first."""
    root = cache_root()
    if not root.is_dir():
        return []
    current = folder_name()
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*" + SUFFIX)):
            if path.name.startswith(".tmp-"):
                continue
            kernel = ""
            try:
                header, _ = read_header(path.read_bytes())
                kernel = header.get("kernel", "")
            except (OSError, ValueError):
                pass
            found.append(ListedEntry(path, folder.name, folder.name == current, path.stat().st_size, kernel))
    return sorted(found, key=lambda e: (not e.current, e.toolchain, e.kernel))


def clear(everything: bool = False) -> int:
    """Remove the folders of other toolchains (or, with ``everything``, this one too); return
    the number of entries removed."""
    root = cache_root()
    if not root.is_dir():
        return 0
    current = folder_name()
    removed = 0
    for folder in [p for p in root.iterdir() if p.is_dir()]:
        if folder.name == current and not everything:
            continue
        removed += sum(1 for _ in folder.glob("*" + SUFFIX))
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def cached_cubin(spec, build, sources: str | None = None) -> CacheEntry:
    """The cubin of one kernel (``spec``: its ``kernels.spec.KernelSpec``, with the target
    ``spec.arch``): from the cache, or compiled (``build()`` returns the Python kernel function
    and its Numba argument types), stored, and returned. One code path for both: a hit only skips
    the compile. ``sources``: the digest of the kernel's sources (``kernel_key``)."""
    key = kernel_key(spec, sources=sources)
    entry = load(key)
    if entry is None:
        from .compiler import compile_cubin, entry_name

        description = describe(spec)
        with announce_slow_compile(description):
            pyfunc, argtypes = build()
            cubin = compile_cubin(pyfunc, argtypes, spec.arch)
        STATS["compiles"] += 1
        entry = CacheEntry(key, entry_name(cubin), cubin)
        store(entry, description)
    return entry


def show_compile_progress(stream=None) -> None:
    """Print the ``numbaflash`` logger's INFO lines on ``stream`` (default stderr): what the
    command-line tools call so that a long compile is announced. Idempotent."""
    if not any(getattr(h, "_numbaflash_progress", False) for h in LOG.handlers):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._numbaflash_progress = True
        LOG.addHandler(handler)
    if LOG.getEffectiveLevel() > logging.INFO:
        LOG.setLevel(logging.INFO)


@contextlib.contextmanager
def announce_slow_compile(description: str) -> Iterator[None]:
    """Log one INFO line on the ``numbaflash`` logger once a compile has run ``ANNOUNCE_AFTER_S``
    (a timer thread, so the line comes while the compile runs, not after it), saying what is
    being compiled and where it will be cached; a DEBUG line with its time when it ends. A
    compile that ends sooner logs nothing."""
    where = f"cached in {cache_root()} for next time" if enabled() else "not cached: NUMBAFLASH_CACHE=0"
    line = ("numbaflash: compiling %s (first use on this toolchain; %s)", description, where)
    timer = threading.Timer(ANNOUNCE_AFTER_S, LOG.info, line)
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if time.perf_counter() - start >= ANNOUNCE_AFTER_S:
            LOG.debug("numbaflash: compiled %s in %.1f s", description, time.perf_counter() - start)


def describe(spec) -> str:
    """A readable name of a kernel's spec for listings: ``sm90.forward+window sm_90a bfloat16 full
    WsConfig(...)``."""
    return f"{spec.kind} {spec.arch} {spec.dtype} {'causal' if spec.causal else 'full'} {spec.config!r}"
