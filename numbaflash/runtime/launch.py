"""Host-side launch utilities shared by the API and the demos.

``KernelLauncher`` launches a compiled kernel (a ``cuda.core`` kernel loaded from a cached
cubin, or a Numba kernel's overload) from plain values. Numba's own launch
(``kernel[grid, block, stream, shared](*args)``) types every argument, wraps every device
array and checks the context on each call: about 0.25 ms of host time for the attention
kernel's 23 arguments, which is longer than the kernel itself on a small problem. The launcher
does that work once and per call only packs integers, in the layout Numba's kernel ABI gives
each argument type (see ``pack_arguments``).
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Sequence
from typing import Any

MAX_CACHED_CONFIGS = 256
MAX_CACHED_STREAMS = 64


DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory a launch may use without opting in


def set_dynamic_shared_limit(kernel_handle, device: int, nbytes: int) -> None:
    """Allow ``nbytes`` of dynamic shared memory for a loaded kernel (``CUkernel``) on device
    ``device``: above 48 KB a launch fails (CUDA_ERROR_INVALID_VALUE) until it is raised."""
    if nbytes <= DEFAULT_SHARED_LIMIT:
        return
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, kernel_handle, device)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot allow {nbytes} bytes of dynamic shared memory on device {device}: {err}")


def raise_dynamic_shared_limit(kernel, argtypes, nbytes: int) -> None:
    """``set_dynamic_shared_limit`` for a Numba kernel's overload on the current device."""
    if nbytes <= DEFAULT_SHARED_LIMIT:
        return
    cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
    set_dynamic_shared_limit(cufunc.handle, cufunc.device.id, nbytes)


_ARRAY_RE = re.compile(r"^array\((\w+), (\w+), (\w+)\)$")
_ITEMSIZE = {"int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "int32": 4, "uint32": 4,
             "float32": 4, "int64": 8, "uint64": 8, "float64": 8}
_INTEGERS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def _packer(ty) -> Any:
    """How one argument becomes kernel parameters (Numba's ABI). ``ty`` is a Numba type or its
    name (``str(type)``, as in ``kernels.abi``), so that launching never imports Numba:

    - a 1-D C-contiguous array (``array(uint16, 1d, C)``), given as ``(device pointer, number
      of elements)``: meminfo (0), parent (0), nitems, itemsize, data pointer, shape, stride in
      bytes;
    - an integer: the ctypes integer of its width and signedness;
    - float32: ``ctypes.c_float``; bool: a Python bool.
    """
    name = str(ty)
    array = _ARRAY_RE.match(name)
    if array:
        dtype, ndim, layout = array.groups()
        if ndim != "1d" or layout != "C" or dtype not in _ITEMSIZE:
            raise TypeError(f"KernelLauncher handles 1-D C-contiguous arrays, not {name}")
        itemsize = _ITEMSIZE[dtype]

        def pack_array(value, out):
            pointer, nitems = value
            out += (0, 0, nitems, itemsize, pointer, nitems, itemsize)

        return pack_array
    if name in _INTEGERS:
        ctype = getattr(ctypes, f"c_{name}")
        return lambda value, out: out.append(ctype(value))
    if name == "float32":
        return lambda value, out: out.append(ctypes.c_float(value))
    if name == "bool":
        return lambda value, out: out.append(bool(value))
    raise TypeError(f"KernelLauncher cannot pass arguments of type {name}")


class KernelLauncher:
    """Launch a loaded kernel whose parameters follow Numba's ABI for ``argtypes``: a
    ``cuda.core`` ``Kernel`` (``KernelLauncher(kernel, argtypes, name)``), or one overload of a
    ``cuda.jit`` kernel (``KernelLauncher.from_numba(kernel, argtypes)``).

    Call with ``(grid, block, stream_handle, shared_bytes, *args)``: ``stream_handle`` is a
    ``cudaStream_t`` as an int (0: the legacy default stream) and each array argument is a
    ``(device pointer, number of elements)`` pair. The caller keeps the memory alive until the
    kernel has run (as with any asynchronous launch).
    """

    def __init__(self, kernel, argtypes: Sequence[Any], name: str = "kernel") -> None:
        self.name = name
        self._kernel = kernel
        self._packers = [_packer(t) for t in argtypes]
        self._streams: dict[int, Any] = {}
        self._configs: dict[tuple, Any] = {}  # launch configurations by (grid, block, shared bytes)
        self._lock = threading.Lock()

    @classmethod
    def from_numba(cls, kernel, argtypes: Sequence[Any]) -> KernelLauncher:
        """The launcher of a ``cuda.jit`` kernel's overload for ``argtypes`` (compiled and
        loaded on the current device)."""
        cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
        return cls(cufunc.kernel, argtypes, cufunc.name)

    def pack(self, args: Sequence[Any]) -> list[Any]:
        """The kernel parameters for ``args``, in launch order."""
        if len(args) != len(self._packers):
            raise TypeError(f"{self.name}: expected {len(self._packers)} arguments, got {len(args)}")
        out: list[Any] = []
        for pack, value in zip(self._packers, args, strict=True):
            pack(value, out)
        return out

    def _stream(self, handle: int):
        stream = self._streams.get(handle)
        if stream is None:
            from cuda.core import Stream

            with self._lock:  # non-owning wrappers; bounded, as callers may create streams per call
                if len(self._streams) >= MAX_CACHED_STREAMS:
                    self._streams.clear()
                stream = self._streams.setdefault(handle, Stream.from_handle(handle))
        return stream

    def _config(self, grid: tuple[int, int, int], block: int, shared_bytes: int):
        key = (grid, block, shared_bytes)
        config = self._configs.get(key)
        if config is None:
            from cuda.core import LaunchConfig

            config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)
            with self._lock:
                if len(self._configs) >= MAX_CACHED_CONFIGS:
                    self._configs.clear()
                self._configs[key] = config
        return config

    def __call__(self, grid: tuple[int, int, int], block: int, stream_handle: int, shared_bytes: int,
                 *args: Any) -> None:
        from cuda.core import launch

        config = self._config(grid, block, shared_bytes)
        launch(self._stream(stream_handle), config, self._kernel, *self.pack(args))
