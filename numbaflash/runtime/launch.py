"""Host-side launch utilities shared by the API and the demos.

``KernelLauncher`` launches a compiled Numba kernel from plain values. Numba's own launch
(``kernel[grid, block, stream, shared](*args)``) types every argument, wraps every device
array and checks the context on each call: about 0.25 ms of host time for the attention
kernel's 23 arguments, which is longer than the kernel itself on a small problem. The launcher
does that work once and per call only packs integers, in the layout Numba's kernel ABI gives
each argument type (see ``pack_arguments``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

MAX_CACHED_CONFIGS = 256
MAX_CACHED_STREAMS = 64


def raise_dynamic_shared_limit(kernel, argtypes, nbytes: int) -> None:
    """Allow ``nbytes`` of dynamic shared memory for a compiled kernel: above 48 KB a launch
    fails (CUDA_ERROR_INVALID_VALUE) until the function attribute is raised."""
    if nbytes <= 48 * 1024:
        return
    from cuda.bindings import driver as cu_driver
    from numba.cuda.cudadrv.driver import driver

    cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
    attr = cu_driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)


def _packer(ty) -> Any:
    """How one argument of Numba type ``ty`` becomes kernel parameters (Numba's ABI):

    - a 1-D C-contiguous array, given as ``(device pointer, number of elements)``: meminfo (0),
      parent (0), nitems, itemsize, data pointer, shape, stride in bytes;
    - an integer: the ctypes integer of its width and signedness;
    - float32: ``ctypes.c_float``; boolean: a Python bool.
    """
    from numba.cuda import types

    if isinstance(ty, types.Array):
        if ty.ndim != 1 or ty.layout != "C":
            raise TypeError(f"KernelLauncher handles 1-D C-contiguous arrays, not {ty}")
        itemsize = ty.dtype.bitwidth // 8

        def array(value, out):
            pointer, nitems = value
            out += (0, 0, nitems, itemsize, pointer, nitems, itemsize)

        return array
    if isinstance(ty, types.Integer):
        ctype = getattr(ctypes, f"c_{ty}")
        return lambda value, out: out.append(ctype(value))
    if ty == types.float32:
        return lambda value, out: out.append(ctypes.c_float(value))
    if ty == types.boolean:
        return lambda value, out: out.append(bool(value))
    raise TypeError(f"KernelLauncher cannot pass arguments of type {ty}")


class KernelLauncher:
    """Launch one overload of a ``cuda.jit`` kernel compiled for ``argtypes``.

    Call with ``(grid, block, stream_handle, shared_bytes, *args)``: ``stream_handle`` is a
    ``cudaStream_t`` as an int (0: the legacy default stream) and each array argument is a
    ``(device pointer, number of elements)`` pair. The caller keeps the memory alive until the
    kernel has run (as with any asynchronous launch).
    """

    def __init__(self, kernel, argtypes: Sequence[Any]) -> None:
        overload = kernel.overloads[tuple(argtypes)]
        self.name = overload._codelibrary.get_cufunc().name
        self._kernel = overload._codelibrary.get_cufunc().kernel
        self._packers = [_packer(t) for t in argtypes]
        self._streams: dict[int, Any] = {}
        self._configs: dict[tuple, Any] = {}  # launch configurations by (grid, block, shared bytes)
        self._lock = threading.Lock()

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
