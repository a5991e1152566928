"""Compile a kernel to a linked cubin with no GPU: Numba → NVVM → LTO-IR, then nvJitLink links
it with its PTX helpers (``ptx/*.cu``, compiled to LTO-IR by NVRTC) and runs ptxas.

This is the one compile path of the package: the kernel cache stores what it returns, the
API loads it, and offline inspection disassembles it, so what is inspected is what runs.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

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


def compile_cubin(pyfunc, argtypes: Sequence, arch: str, launch_bounds=None) -> bytes:
    """Compile a kernel's Python function for ``arch`` and return the linked cubin.
    ``launch_bounds`` defaults to the function's ``launch_bounds`` attribute (set by the
    package's kernel factories)."""
    from cuda.bindings import nvjitlink
    from numba.cuda.compiler import compile_all

    cc = parse_arch(arch)
    bounds = launch_bounds if launch_bounds is not None else getattr(pyfunc, "launch_bounds", None)
    codes, _ = compile_all(pyfunc, tuple(argtypes), device=False, cc=cc, output="ltoir", abi="numba",
                           launch_bounds=bounds)
    handle = nvjitlink.create(2, [f"-arch={arch}", "-lto"])
    try:
        for i, code in enumerate(codes):
            data = code if isinstance(code, (bytes, bytearray)) else code.code
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, data, len(data), f"module{i}")
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin)


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

    from .. import __version__

    nvvm = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvvm").abs_path)
    v = [ctypes.c_int() for _ in range(4)]
    nvvm.nvvmVersion(ctypes.byref(v[0]), ctypes.byref(v[1]))
    nvvm_version = f"{v[0].value}.{v[1].value}"
    nvvm.nvvmIRVersion(*(ctypes.byref(x) for x in v))
    _, nvrtc_major, nvrtc_minor = nvrtc.nvrtcVersion()
    return {
        "numbaflash": __version__,
        "numba-cuda": version("numba-cuda"),
        "nvvm": nvvm_version,
        "nvvm-ir": ".".join(str(x.value) for x in v),
        "nvrtc": f"{nvrtc_major}.{nvrtc_minor}",
        "nvjitlink": ".".join(str(x) for x in nvjitlink.version()),
    }
