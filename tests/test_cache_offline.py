"""The on-disk kernel cache, on CPU (no GPU needed): keys, entry validation, atomic and
concurrent writes, unwritable folders, listing and clearing, precompilation, import cost.

Kernels here are compiled for real (NVVM -> LTO-IR -> nvJitLink), on a small kernel where a
test only needs some cubin, and on the shipped kernels where it matters which ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from numba import cuda, types

from numbaflash import configs
from numbaflash.configs import (
    CANDIDATES,
    DEFAULTS,
    LONG_SEQLEN,
    SHORT_SEQLEN,
    SUPPORTED_HEAD_DIMS,
    ForwardConfig,
    WsConfig,
    dispatch_family,
    forward_config,
)
from numbaflash.kernels.shapes import BackwardConfig
from numbaflash.kernels.spec import KernelSpec, kernel_spec
from numbaflash.runtime import cache
from numbaflash.runtime.compiler import entry_name, parse_arch
from numbaflash.tools import precompile

ROOT = Path(__file__).resolve().parents[1]
SMALL_ARGTYPES = (types.float32[::1], types.int64)


def small_kernel(out, n):
    i = cuda.grid(1)
    if i < n:
        out[i] = i * 2.0


def build_small():
    return small_kernel, SMALL_ARGTYPES


@dataclasses.dataclass(frozen=True)
class SmallConfig:
    scale: int = 2


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder for the test, the cache on, and fresh counters."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(folder))
    monkeypatch.delenv("NUMBAFLASH_CACHE", raising=False)
    monkeypatch.setattr(cache, "STATS", cache.Counter())
    cache._WRITE_FAILED.clear()
    yield folder
    cache._WRITE_FAILED.clear()


def get_small(arch="sm_80"):
    return cache.cached_cubin(KernelSpec("small", "small", SmallConfig(), arch=arch), build_small)


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------

BASE = dict(family="sm80", operation="forward", config=ForwardConfig(64), dtype="float16", arch="sm_80")
VERSIONS = {"numbaflash": "0.1.0", "numba-cuda": "0.30.4", "nvvm": "2.0", "nvvm-ir": "2.0.3.2",
            "nvrtc": "13.5", "nvjitlink": "13.5"}


def key(**change):
    versions = change.pop("versions", VERSIONS)
    sources = change.pop("sources", "abc")
    fields = {**BASE, **change}
    return cache.kernel_key(kernel_spec(**fields), sources=sources, versions=versions)


@pytest.mark.parametrize("change", [
    {"operation": "backward"},
    {"family": "sm90"},
    {"config": ForwardConfig(64, block_m=64)},
    {"config": ForwardConfig(64, warp_m_tiles=2)},
    {"config": WsConfig(64)},
    {"causal": True},
    {"window": True},
    {"softcap": True},
    {"varlen": True},
    {"dtype": "bfloat16"},
    {"arch": "sm_86"},
    {"arch": "sm_90a"},
    {"sources": "abd"},
] + [{"versions": {**VERSIONS, name: "9.9"}} for name in VERSIONS])
def test_key_changes_with_every_input(change):
    assert key() == key()  # deterministic
    assert key(**change) != key()


def test_key_covers_the_installed_toolchain_and_sources():
    versions = cache.toolchain()
    assert set(versions) == set(VERSIONS)
    assert all(versions.values())
    spec = kernel_spec("sm80", "forward", ForwardConfig(64), arch="sm_80")
    live = cache.kernel_key(spec)
    assert live == cache.kernel_key(spec, sources=cache.source_digest(), versions=versions)


def test_source_digest_covers_kernels_bindings_and_ptx():
    names = {p.name for p in cache._source_files()}
    assert {"forward_mma.py", "forward_ws.py", "smem.py", "softmax.py", "epilogue.py", "blocks.py",
            "common.py", "mma.cu", "wgmma.cu", "copy.cu", "hopper.py", "compiler.py"} <= names


def test_source_digest_changes_when_a_source_changes(tmp_path, monkeypatch):
    files = [tmp_path / "a.py", tmp_path / "b.cu"]
    for f in files:
        f.write_text("x = 1\n")
    monkeypatch.setattr(cache, "_source_files", lambda: files)
    cache.source_digest.cache_clear()
    try:
        before = cache.source_digest()
        cache.source_digest.cache_clear()
        files[1].write_text("x = 2\n")
        after = cache.source_digest()
    finally:
        cache.source_digest.cache_clear()
    assert before != after


def test_toolchain_tag_is_a_safe_folder_name():
    tag = cache.toolchain_tag({"numba-cuda": "0.30.4", "odd": "1/2 3"})
    assert "/" not in tag and " " not in tag and "numba-cuda-0.30.4" in tag


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_root() == tmp_path / "x"
    monkeypatch.delenv("NUMBAFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "numbaflash"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == Path.home() / ".cache" / "numbaflash"


# ---------------------------------------------------------------------------------------------
# Hits, misses and invalid entries
# ---------------------------------------------------------------------------------------------


def test_miss_compiles_stores_and_hit_loads(cache_dir):
    first = get_small()
    assert cache.STATS["compiles"] == 1 and cache.STATS["stored"] == 1
    assert first.cubin[:4] == b"\x7fELF" and "small_kernel" in first.entry_name
    assert entry_name(first.cubin) == first.entry_name
    path = cache.entry_path(first.key)
    assert path.is_file() and path.parent.parent == cache_dir
    second = get_small()
    assert cache.STATS["compiles"] == 1 and cache.STATS["hits"] == 1
    assert second == first


def assert_same_kernel(a: cache.CacheEntry, b: cache.CacheEntry) -> None:
    """Two compiles of one kernel: same key and size; Numba numbers each compile in the mangled
    name (``B2v2``, ``B3v10``), so the names and bytes differ only there."""
    assert a.key == b.key and entry_name(a.cubin) == a.entry_name
    assert re.sub(r"B\d+v\d+", "", a.entry_name) == re.sub(r"B\d+v\d+", "", b.entry_name)


def corrupt_truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def corrupt_flipped(data: bytes) -> bytes:
    i = len(data) - 100
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]


def corrupt_header(data: bytes) -> bytes:
    return data[:30] + b"{{{{" + data[34:]


def corrupt_garbage(data: bytes) -> bytes:
    return os.urandom(len(data))


def corrupt_empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("corrupt", [corrupt_truncated, corrupt_flipped, corrupt_header, corrupt_garbage,
                                     corrupt_empty])
def test_corrupt_entry_is_recompiled(cache_dir, corrupt):
    good = get_small()
    path = cache.entry_path(good.key)
    path.write_bytes(corrupt(path.read_bytes()))
    again = get_small()
    assert cache.STATS["rejected"] == 1 and cache.STATS["compiles"] == 2
    assert_same_kernel(again, good)
    assert cache.decode_entry(path.read_bytes(), good.key) == again  # the file was replaced


def test_foreign_entry_is_recompiled(cache_dir):
    """A valid entry of another kernel, under this kernel's name, is never launched."""
    good = get_small("sm_80")
    other = get_small("sm_86")
    path = cache.entry_path(good.key)
    path.write_bytes(cache.entry_path(other.key).read_bytes())
    with pytest.raises(ValueError, match="another key"):
        cache.decode_entry(path.read_bytes(), good.key)
    assert_same_kernel(get_small("sm_80"), good)
    assert cache.STATS["rejected"] == 1


@pytest.mark.parametrize("bad", [b"", b"NUMBAFLASH", cache.MAGIC, cache.MAGIC + b"\xff\xff\xff\xff"])
def test_read_header_rejects_short_files(bad):
    with pytest.raises(ValueError):
        cache.read_header(bad)


def test_cache_off_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("NUMBAFLASH_CACHE", "0")
    get_small()
    get_small()
    assert cache.STATS["compiles"] == 2 and not cache_dir.exists()


# ---------------------------------------------------------------------------------------------
# Unwritable folders, concurrent writers
# ---------------------------------------------------------------------------------------------


def test_unwritable_cache_folder_works_after_one_warning(tmp_path, monkeypatch):
    """A folder that cannot be created (here: below a file; as root, permissions would not
    stop us) still gives working kernels, and one warning in all."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(cache, "STATS", cache.Counter())
    cache._WRITE_FAILED.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = get_small("sm_80")
            second = get_small("sm_86")
    finally:
        cache._WRITE_FAILED.clear()
    assert first.cubin[:4] == b"\x7fELF" and second.cubin[:4] == b"\x7fELF"
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "cannot write the kernel cache" in messages[0]
    assert cache.STATS["compiles"] == 2 and cache.STATS["stored"] == 0


def test_read_only_cache_folder(cache_dir, monkeypatch):
    """A read-only cache folder: kernels still compile and run from memory, after one warning.
    Root writes through permission bits, so as root the folder answers as a read-only one
    does (EACCES on creating a file in it)."""
    cache_dir.mkdir()
    cache_dir.chmod(0o555)
    if os.geteuid() == 0:
        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(kwargs.get("dir")))

        monkeypatch.setattr(cache.tempfile, "mkstemp", refused)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = get_small("sm_80"), get_small("sm_86")
    finally:
        cache_dir.chmod(0o755)
    assert first.cubin[:4] == b"\x7fELF" and second.cubin[:4] == b"\x7fELF"
    messages = [str(w.message) for w in caught if "cannot write the kernel cache" in str(w.message)]
    assert len(messages) == 1 and "Permission denied" in messages[0]
    assert cache.STATS["compiles"] == 2 and cache.STATS["stored"] == 0
    assert not list(cache_dir.rglob("*" + cache.SUFFIX))


def test_full_disk_leaves_no_partial_file(cache_dir, monkeypatch):
    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", no_space)
    with pytest.warns(RuntimeWarning, match="No space left"):
        entry = get_small()
    assert entry.cubin[:4] == b"\x7fELF"
    assert not list(cache_dir.rglob("*")) or not list(cache_dir.rglob("*.cubin"))


WRITER = textwrap.dedent("""
    import sys, time
    from numbaflash.runtime import cache
    payload = bytes(range(256)) * 4096 * int(sys.argv[2])  # 1 MiB per unit: slow enough to overlap
    entry = cache.CacheEntry(sys.argv[1], "kernel_" + sys.argv[2], payload)
    start = float(sys.argv[3])
    while time.time() < start:
        time.sleep(0.001)
    for _ in range(20):
        assert cache.store(entry, "writer " + sys.argv[2])
        got = cache.load(sys.argv[1])
        assert got is not None and got.entry_name.startswith("kernel_"), got
    print("ok", cache.STATS["rejected"])
""")


def test_four_processes_storing_one_entry_leave_one_valid_entry(cache_dir):
    """Four processes store the same key at once, 20 times each, reading it back between:
    every read sees a whole valid entry, and one valid entry and no temporary file remain."""
    import time

    key_ = "f" * 64
    start = str(time.time() + 3.0)
    env = {**os.environ, "NUMBAFLASH_CACHE_DIR": str(cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, key_, str(n), start], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (1, 2, 3, 4)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        assert out.split() == ["ok", "0"]  # no reader ever saw a partial or corrupt entry
    files = list(cache_dir.rglob("*"))
    entries = [f for f in files if f.is_file()]
    assert len(entries) == 1 and entries[0].name == key_ + cache.SUFFIX
    header, cubin = cache.read_header(entries[0].read_bytes())
    assert header["key"] == key_ and len(cubin) == 4096 * 256 * int(header["entry_name"][-1])


# ---------------------------------------------------------------------------------------------
# Listing, clearing, precompiling
# ---------------------------------------------------------------------------------------------


def test_list_and_clear_other_versions(cache_dir):
    mine = get_small()
    other = cache_dir / "numbaflash-0.0.1_numba-cuda-0.1"
    other.mkdir(parents=True)
    (other / ("a" * 64 + cache.SUFFIX)).write_bytes(cache.encode_entry(mine, "old kernel"))
    (other / ("b" * 64 + cache.SUFFIX)).write_bytes(b"junk")
    listed = cache.list_entries()
    assert [e.current for e in listed] == [True, False, False]
    assert listed[0].kernel.startswith("small.small sm_80 float16 full")
    assert {e.kernel for e in listed[1:]} == {"old kernel", ""}
    assert cache.clear() == 2
    assert [e.current for e in cache.list_entries()] == [True]
    assert cache.clear(everything=True) == 1
    assert cache.list_entries() == []


def test_precompile_lists_what_each_target_dispatches():
    for arch, family in (("sm_80", "sm80"), ("sm_86", "sm80"), ("sm_90a", "sm90")):
        cap = (parse_arch(arch)[0], parse_arch(arch)[1])
        assert {dispatch_family(cap, d) for d in (64, 128)} == {family}
        items = precompile.kernels_for(arch, candidates=False)
        dispatched = {(forward_config(cap, d, causal, seqlen=s), causal) for d in SUPPORTED_HEAD_DIMS
                      for causal in (False, True) for s in (None, SHORT_SEQLEN, LONG_SEQLEN)}  # every span
        assert len(items) == len(dispatched) * 2  # x dtypes
        for spec in items:
            assert spec.arch == arch and spec.operation == "forward"
            assert (spec.config, spec.causal) in dispatched
        with_candidates = precompile.kernels_for(arch, candidates=True)
        expected = {(c, causal) for d in SUPPORTED_HEAD_DIMS for causal in (False, True)
                    for c in CANDIDATES[(dispatch_family(cap, d), d)]}
        assert {(s.config, s.causal) for s in with_candidates} == expected
    assert DEFAULTS  # the table falls back to defaults: both families have them


def test_precompile_command_fills_the_cache_with_no_gpu(tmp_path):
    """``python -m numbaflash.precompile`` with no GPU visible compiles the shipped sm_80
    kernels the cache lacks; a second run finds them all; --list shows them; --clear --all
    removes them. It fills the run's own cache folder (conftest), so the offline SASS tests
    reuse what it compiled, and what they compiled first it only finds."""
    root = Path(os.environ["NUMBAFLASH_CACHE_DIR"])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("NUMBAFLASH_CACHE", None)

    def run(*args, folder=root):
        done = subprocess.run([sys.executable, "-m", "numbaflash.precompile", *args],
                              env={**env, "NUMBAFLASH_CACHE_DIR": str(folder)}, cwd=ROOT,
                              capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    items = precompile.kernels_for("sm_80", candidates=False)
    shipped = {(forward_config((8, 0), d, causal, seqlen=s), causal) for d in SUPPORTED_HEAD_DIMS
               for causal in (False, True) for s in (None, SHORT_SEQLEN, LONG_SEQLEN)}  # every span
    n = len(shipped) * 2  # x dtypes
    assert len(items) == n
    missing = sum(not cache.entry_path(configs.kernel_key(spec)).is_file() for spec in items)
    # the plain forward kernels (backward: test_backward_api_cpu; the variants: test_precompile_cpu)
    out, err = run("--arch", "sm_80", "--jobs", "2", "--forward-only", "--plain")
    assert f"{n} kernels: {missing} compiled, {n - missing} already cached" in out
    assert f"{n}/{n}" in err and "[" + "#" * precompile.BAR_WIDTH + "]" in err  # the progress bar
    if missing:
        assert "numbaflash: compiling sm80.forward sm_80" in err  # a worker's compile announced itself
    out, _ = run("--arch", "sm_80", "--forward-only", "--plain")
    assert f"{n} kernels: 0 compiled, {n} already cached" in out
    out, _ = run("--list")
    assert sum(line.startswith("current") for line in out.splitlines()) >= n
    assert "sm80.forward sm_80 bfloat16 causal" in out  # each entry listed by its spec (cache.describe)
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    entries = sum(1 for _ in copy.rglob("*" + cache.SUFFIX))
    out, _ = run("--clear", "--all", folder=copy)
    assert f"removed {entries} entries" in out and not list(copy.rglob("*" + cache.SUFFIX))
    done = subprocess.run([sys.executable, "-m", "numbaflash.precompile", "--arch", "sm_75"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown architecture 'sm_75'" in done.stderr


def test_import_is_light():
    """``import numbaflash`` imports neither torch nor Numba, and compiles nothing."""
    code = ("import sys, time; t = time.perf_counter(); import numbaflash; "
            "print(json.dumps([time.perf_counter() - t, 'torch' in sys.modules, 'numba' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    seconds, torch_loaded, numba_loaded = json.loads(done.stdout)
    assert not torch_loaded and not numba_loaded
    assert seconds < 2.0, f"import numbaflash took {seconds:.2f} s"


def test_each_kernel_is_keyed_by_the_sources_it_is_built_from():
    """An edit recompiles the kernels it can change, no others: the mma.sync forward's key does
    not read the backward's module, the backward's does; both read the compile options, the
    registry, the parameter declarations and every PTX helper."""
    from numbaflash.kernels.families import FACTORIES, kernel_source_files

    def names(family, operation):
        return {p.name for p in kernel_source_files(family, operation)}

    common = {"families.py", "spec.py", "params.py", "compiler.py", "sources.py", "mma.cu", "wgmma.cu"}
    for pair in FACTORIES:
        assert common <= names(*pair), pair
    assert "forward_mma.py" in names("sm80", "forward") and "backward_mma.py" not in names("sm80", "forward")
    assert "backward_mma.py" in names("sm80bwd", "backward")
    assert "forward_ws.py" in names("sm90", "forward") and "forward_mma.py" not in names("sm90", "forward")
    assert "mma_pieces.py" in names("sm80dec", "decode")
    assert "backward_ws.py" not in names("sm80dec", "decode")
    # a kernel the registry does not build (a test's own) is keyed by every kernel source
    assert {p.name for p in cache._source_files()} <= names("small", "small")


def test_an_edit_changes_the_keys_of_the_kernels_it_can_change_only(monkeypatch):
    """``configs.kernel_key`` (what ``kernel_cubin`` stores under) reads the kernel's own files:
    edit the backward's module (its digest) and only the backward's key moves."""
    from numbaflash import configs

    backward = kernel_spec("sm80bwd", "backward", BackwardConfig(64), arch="sm_80")
    forward = kernel_spec("sm80", "forward", ForwardConfig(64), arch="sm_80")
    before = configs.kernel_key(backward), configs.kernel_key(forward)
    real = cache.source_digest

    def edited(files=None):
        text = real(files)
        return text + "-edited" if files and any(p.name == "backward_mma.py" for p in files) else text

    monkeypatch.setattr(cache, "source_digest", edited)
    after = configs.kernel_key(backward), configs.kernel_key(forward)
    assert after[0] != before[0] and after[1] == before[1]


@pytest.mark.slow
def test_source_files_hold_every_module_a_factory_imports():
    """Live check of the import reading: build one kernel of each (family, operation) in a fresh
    process; every ``numbaflash.kernels`` / ``numbaflash.ptx`` module that building it imported is
    among the files that key it."""
    script = textwrap.dedent("""
        import pickle, sys
        spec = pickle.loads(bytes.fromhex(sys.argv[1]))  # imports kernels.spec and the config's module
        from numbaflash.kernels.families import kernel_source_files, make_kernel
        before = set(sys.modules)  # what the package's own import loads (its API's tables)
        make_kernel(spec)
        files = {str(p) for p in kernel_source_files(spec.family, spec.operation)}
        loaded = [m for m, mod in list(sys.modules.items()) if m not in before
                  and m.startswith(("numbaflash.kernels", "numbaflash.ptx")) and mod.__file__ not in files]
        print(sorted(loaded))
    """)
    import pickle

    specs = [s for part in precompile.plan(["sm_80", "sm_90a"]).values() for ss in part.values() for s in ss]
    for pair in {(s.family, s.operation): None for s in specs}:
        spec = next(s for s in specs if (s.family, s.operation) == pair)
        done = subprocess.run([sys.executable, "-c", script, pickle.dumps(spec).hex()], capture_output=True,
                              text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "[]", (pair, done.stdout)
