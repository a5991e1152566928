"""Compile a kernel to a linked cubin with no GPU: Numba → NVVM → LTO-IR, then nvJitLink links
it with its PTX helpers (``ptx/*.cu``, compiled to LTO-IR by NVRTC) and runs ptxas.

This is the one compile path of the package: the kernel cache stores what it returns, the
API loads it, and offline inspection disassembles it, so what is inspected is what runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import re
import struct
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

_ARCH_RE = re.compile(r"^sm_(\d+)(\d)(a?)$")


def parse_arch(arch: str) -> tuple:
    """``"sm_90a"`` -> ``(9, 0, "a")``, ``"sm_86"`` -> ``(8, 6)``: Numba's compute capability."""
    match = _ARCH_RE.match(arch)
    if not match or int(match.group(1)) < 8:
        raise ValueError(f"unknown architecture {arch!r}; expected sm_XY or sm_XYa with X >= 8, "
                         f"for example sm_80, sm_86, sm_89, sm_90a")
    major, minor, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
    return (major, minor, suffix) if suffix else (major, minor)


def arch_of(capability: tuple[int, int]) -> str:
    """The target a GPU of ``capability`` compiles for, as Numba picks it: architecture-specific
    (``a``) features from sm_90 on, since the Hopper kernel needs wgmma and setmaxnreg."""
    major, minor = capability
    return f"sm_{major}{minor}" + ("a" if (major, minor) >= (9, 0) else "")


@contextlib.contextmanager
def target_capability(cc: tuple) -> Iterator[None]:
    """While compiling for ``cc``, answer Numba's question "which GPU is this for?" with ``cc``.

    Device functions are ``@cuda.jit(device=True, forceinline=True)``: each is typed and
    lowered once on its own (``CUDADispatcher.compile_device``) and NVVM inlines it, instead of
    Numba deep-copying its IR into every caller. ``compile_device`` takes the compute capability
    from ``numba.cuda.dispatcher.get_current_device()``, which needs a GPU and, with one,
    names the current GPU rather than the target. Inside this context that name answers with
    a stand-in device of capability ``cc``, under Numba's compiler lock so that no other
    thread's compile sees it. ``tests/test_compile_offline.py`` pins this hook, so a numba-cuda
    release that moves it fails there and not in a user's first call.

    The capability only steers lowering choices made below sm_75 (atomics, ``tanh``); the
    device functions' typed IR is the same for every target from sm_80 on, and the per-target
    code comes from NVVM and ptxas at the kernel's own ``cc``."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.cuda import dispatcher

    device = types.SimpleNamespace(compute_capability=tuple(cc))
    with global_compiler_lock:
        saved = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: device
        try:
            yield
        finally:
            dispatcher.get_current_device = saved


def compile_cubin(pyfunc, argtypes: Sequence, arch: str, launch_bounds=None) -> bytes:
    """Compile a kernel's Python function for ``arch`` and return the linked cubin.
    ``launch_bounds`` defaults to the function's ``launch_bounds`` attribute (set by the
    package's kernel factories).

    Numba (with ``target_capability``) and NVVM turn the kernel and its device functions into
    one LTO-IR module; nvJitLink links it with every PTX helper family's LTO-IR
    (``helper_ltoir``: NVRTC, once per family and target in a process, started on a thread
    before Numba runs), inlines the helpers and runs ptxas. Helpers the kernel does not call
    are dropped by the link: the SASS is the same as linking only the families it uses."""
    from cuda.bindings import nvjitlink
    from numba.cuda import compile as numba_compile

    from .sources import ptx_directory

    cc = parse_arch(arch)
    bounds = launch_bounds if launch_bounds is not None else getattr(pyfunc, "launch_bounds", None)
    sources = sorted(ptx_directory().glob("*.cu"))
    helpers = [_HELPERS.submit(helper_ltoir, str(path), arch) for path in sources]
    with target_capability(cc):
        kernel, _ = numba_compile(pyfunc, tuple(argtypes), device=False, cc=cc, output="ltoir", abi="numba",
                                  launch_bounds=bounds)
    modules = [("kernel", _code_bytes(kernel))] + [(f"helper{i}", h.result()) for i, h in enumerate(helpers)]
    handle = nvjitlink.create(2, [f"-arch={arch}", "-lto"])
    try:
        for name, data in modules:
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, data, len(data), name)
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin)


def _code_bytes(code) -> bytes:
    return bytes(code if isinstance(code, (bytes, bytearray)) else code.code)


# One thread compiles the helpers while Numba compiles the kernel (NVRTC releases the GIL for part of it).
_HELPERS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="numbaflash-nvrtc")


@functools.cache
def helper_ltoir(path: str, arch: str) -> bytes:
    """LTO-IR of one PTX helper family (``ptx/<family>.cu``) for ``arch``, by NVRTC as Numba
    compiles the files a ``declare_device(link=...)`` names; once per process."""
    from numba.cuda.cudadrv import nvrtc

    source = Path(path)
    code, _ = nvrtc.compile(source.read_text(), source.name, parse_arch(arch), ltoir=True)
    return _code_bytes(code)


_INFO_PREFIX = b".nv.info."


def entry_name(cubin: bytes) -> str:
    """The mangled name of the one kernel entry in ``cubin``, read from its ELF section names
    (each entry has a ``.nv.info.<name>`` section)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    entries = []
    for header in headers:
        start = names_offset + header[0]
        name = cubin[start:cubin.index(b"\0", start)]
        if name.startswith(_INFO_PREFIX):
            entries.append(name[len(_INFO_PREFIX):].decode())
    if len(entries) != 1:
        raise ValueError(f"expected one kernel entry in the cubin, found {len(entries)}")
    return entries[0]


def toolchain_versions() -> dict[str, str]:
    """Versions of everything that turns Python into a cubin: numba-cuda, NVVM (library and IR),
    NVRTC (compiles the PTX helpers), nvJitLink, and this package. Read without importing
    Numba (whose import alone costs about 0.4 s) and without a GPU; NVVM is found the way
    numba-cuda finds it (``cuda.pathfinder``)."""
    import ctypes
    from importlib.metadata import version

    from cuda import pathfinder
    from cuda.bindings import nvjitlink, nvrtc

    from .version import VERSION

    nvvm = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvvm").abs_path)
    v = [ctypes.c_int() for _ in range(4)]
    nvvm.nvvmVersion(ctypes.byref(v[0]), ctypes.byref(v[1]))
    nvvm_version = f"{v[0].value}.{v[1].value}"
    nvvm.nvvmIRVersion(*(ctypes.byref(x) for x in v))
    _, nvrtc_major, nvrtc_minor = nvrtc.nvrtcVersion()
    return {
        "numbaflash": VERSION,
        "numba-cuda": version("numba-cuda"),
        "nvvm": nvvm_version,
        "nvvm-ir": ".".join(str(x.value) for x in v),
        "nvrtc": f"{nvrtc_major}.{nvrtc_minor}",
        "nvjitlink": ".".join(str(x) for x in nvjitlink.version()),
    }
