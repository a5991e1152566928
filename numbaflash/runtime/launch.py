"""Host-side launch utilities shared by the API and the demos.

``KernelLauncher`` launches a compiled kernel (a ``cuda.core`` kernel loaded from a cached
cubin, or a Numba kernel's overload) from plain values. Numba's own launch
(``kernel[grid, block, stream, shared](*args)``) types every argument, wraps every device
array and checks the context on each call: about 0.25 ms of host time for the attention
kernel's 23 arguments, which is longer than the kernel itself on a small problem. The launcher
works out the parameter layout once (``param_layout``, Numba's kernel ABI for each argument
type); a call packs the values into one buffer with a precompiled ``struct`` and calls the
driver's ``cuLaunchKernel`` through ctypes: a few microseconds.
"""

from __future__ import annotations

import ctypes
import re
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

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


def kernel_registers(kernel_handle, device: int) -> int:
    """Registers a thread of a loaded kernel (``CUkernel``) takes on device ``device``."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
    err, value = driver.cuKernelGetAttribute(attr, kernel_handle, device)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot read the registers of a kernel on device {device}: {err}")
    return int(value)


def raise_dynamic_shared_limit(kernel, argtypes, nbytes: int) -> None:
    """``set_dynamic_shared_limit`` for a Numba kernel's overload on the current device."""
    if nbytes <= DEFAULT_SHARED_LIMIT:
        return
    cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
    set_dynamic_shared_limit(cufunc.handle, cufunc.device.id, nbytes)


_ARRAY_RE = re.compile(r"^array\((\w+), (\w+), (\w+)\)$")
_ITEMSIZE = {"int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "int32": 4, "uint32": 4,
             "float32": 4, "int64": 8, "uint64": 8, "float64": 8}
# struct codes of the scalar parameters (little-endian, no implicit padding)
_SCALAR_CODES = {"int8": "b", "uint8": "B", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
                 "int64": "q", "uint64": "Q", "float32": "f", "bool": "?"}
# A 1-D C-contiguous array is seven parameters: meminfo, parent, nitems, itemsize, data, shape[0],
# strides[0] (bytes).
_ARRAY_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data", "shape", "stride")


class Param(NamedTuple):
    """One kernel parameter: byte offset in the parameter buffer, struct code, and the Python
    expression (over the launch arguments ``a0, a1, ...``) that gives its value."""

    offset: int
    code: str
    value: str


def param_layout(argtypes: Sequence[Any]) -> list[Param]:
    """The kernel parameters Numba's ABI gives ``argtypes`` (Numba types or their names,
    ``str(type)``, as in ``kernels.abi``), each at an offset aligned to its size:

    - a 1-D C-contiguous array (``array(uint16, 1d, C)``), passed as ``(device pointer, number of
      elements)``: meminfo (0), parent (0), nitems, itemsize, data pointer, shape, stride in bytes;
    - an integer of its width and signedness; float32; bool (one byte).
    """
    params: list[Param] = []
    offset = 0

    def add(code: str, value: str) -> None:
        nonlocal offset
        size = struct.calcsize("<" + code)
        offset = -(-offset // size) * size
        params.append(Param(offset, code, value))
        offset += size

    for i, ty in enumerate(argtypes):
        name, arg = str(ty), f"a{i}"
        array = _ARRAY_RE.match(name)
        if array:
            dtype, ndim, layout = array.groups()
            if ndim != "1d" or layout != "C" or dtype not in _ITEMSIZE:
                raise TypeError(f"KernelLauncher handles 1-D C-contiguous arrays, not {name}")
            itemsize = str(_ITEMSIZE[dtype])
            for field, value in zip(_ARRAY_FIELDS, ("0", "0", f"{arg}[1]", itemsize, f"{arg}[0]",
                                                    f"{arg}[1]", itemsize), strict=True):
                add("Q" if field == "data" else "q", value)
        elif name in _SCALAR_CODES:
            add(_SCALAR_CODES[name], arg)
        else:
            raise TypeError(f"KernelLauncher cannot pass arguments of type {name}")
    return params


def _packer(params: list[Param], nargs: int):
    """``pack(buffer, *args)``: writes every parameter of ``args`` into ``buffer`` with one
    ``struct.pack_into`` (generated once per parameter list)."""
    fmt, end = "<", 0
    for p in params:
        fmt += "x" * (p.offset - end) + p.code
        end = p.offset + struct.calcsize("<" + p.code)
    args = ", ".join(f"a{i}" for i in range(nargs))
    values = ", ".join(p.value for p in params)
    source = f"def pack(buffer, {args}):\n    _pack_into(buffer, 0, {values})\n"
    namespace = {"_pack_into": struct.Struct(fmt).pack_into}
    exec(compile(source, "<numbaflash kernel parameters>", "exec"), namespace)  # noqa: S102
    return namespace["pack"], struct.calcsize(fmt)


def _firer(words: Sequence[int]):
    """``make(buffer, words, pointers, lock, launch, handle, gx, gy, gz, block, shared, failed)
    -> fire(stream, p0, p1, ...)``: a launch that writes the device pointers ``p0, p1, ...`` into
    the 64-bit words ``words`` of a parameter buffer already packed, then calls the driver
    (generated once per parameter list, like ``_packer``)."""
    names = [f"p{i}" for i in range(len(words))]
    stores = "".join(f"            words[{w}] = {n}\n" for w, n in zip(words, names, strict=True))
    source = (
        "def make(buffer, words, pointers, lock, launch, handle, gx, gy, gz, block, shared, failed):\n"
        f"    def fire(stream, {', '.join(names)}):\n"
        "        with lock:\n"
        f"{stores}"
        "            err = launch(handle, gx, gy, gz, block, 1, 1, shared, stream, pointers, None)\n"
        "        if err:\n"
        "            failed(err)\n"
        "    fire.buffer = buffer  # the parameters the pointers point into, kept alive\n"
        "    return fire\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "<numbaflash bound launch>", "exec"), namespace)  # noqa: S102
    return namespace["make"]


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id (int), padding to 8 bytes, a 64-byte value union (its first
    int here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuLaunchKernelEx): grid, block, shared bytes, stream, attributes."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _programmatic_launch():
    """A function with ``cuLaunchKernel``'s parameters that launches through ``cuLaunchKernelEx``
    with programmatic stream serialization allowed (programmatic dependent launch, sm_90+): the
    kernel may start while the stream's previous kernel finishes, and must call
    ``ptx.grid_dependency_wait`` before it reads what that kernel wrote. Each function owns its
    launch config, so the caller serialises its calls (a launcher's or a bound launch's lock)."""
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(attrs=ctypes.pointer(attribute), num_attrs=1)
    config_ref = ctypes.byref(config)
    launch_ex = _libcuda().cuLaunchKernelEx

    def launch(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        config.grid_x, config.grid_y, config.grid_z = gx, gy, gz
        config.block_x, config.block_y, config.block_z = bx, by, bz
        config.shared, config.stream = shared, stream
        return launch_ex(config_ref, handle, params, extra)

    launch.keep = (attribute, config)  # the structures the driver reads, kept alive
    return launch


_LIBCUDA = None


def _libcuda():
    """The driver library, its ``cuLaunchKernel`` typed (loaded once)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        lib = ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
        p, u = ctypes.c_void_p, ctypes.c_uint
        lib.cuLaunchKernel.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), p, p, p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _LIBCUDA = lib
    return _LIBCUDA


def driver_error(code: int) -> str:
    """``CUDA_ERROR_...`` for a driver result code."""
    name = ctypes.c_char_p()
    _libcuda().cuGetErrorName(code, ctypes.byref(name))
    return name.value.decode() if name.value else f"CUresult {code}"


class KernelLauncher:
    """Launch a loaded kernel whose parameters follow Numba's ABI for ``argtypes``: a
    ``cuda.core`` ``Kernel`` (``KernelLauncher(kernel, argtypes, name)``), or one overload of a
    ``cuda.jit`` kernel (``KernelLauncher.from_numba(kernel, argtypes)``).

    Call with ``(grid, block, stream_handle, shared_bytes, *args)``: ``stream_handle`` is a
    ``cudaStream_t`` as an int (0: the legacy default stream) and each array argument is a
    ``(device pointer, number of elements)`` pair. The kernel runs in the stream's context (the
    current one for stream 0). The caller keeps the memory alive until the kernel has run (as
    with any asynchronous launch). Thread-safe: the parameter buffer is held under a lock from
    packing until the driver has copied it.

    ``programmatic=True`` (sm_90+) launches through ``cuLaunchKernelEx`` with programmatic stream
    serialization allowed: the kernel may start before the stream's previous kernel ends (once
    that one's CTAs have all called ``ptx.grid_launch_dependents`` or exited), and must call
    ``ptx.grid_dependency_wait`` before it reads anything that kernel wrote.
    """

    def __init__(self, kernel, argtypes: Sequence[Any], name: str = "kernel",
                 programmatic: bool = False) -> None:
        self.name = name
        self.programmatic = programmatic
        self.kernel = kernel  # kept alive: the handle below belongs to it
        # A CUkernel (context-independent, cuLibraryLoad) launches as a CUfunction.
        self.handle = int(kernel.handle)
        self.params = param_layout(argtypes)
        self._nargs = len(argtypes)
        self._pack, size = _packer(self.params, self._nargs)
        self._buffer = ctypes.create_string_buffer(max(size, 1))
        self._words = -(-size // 8)  # the buffer of a bound launch, in 64-bit words
        self._make_fire = None  # _firer(...) of the array arguments' data words, made on first bind
        base = ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * max(len(self.params), 1))(*(base + p.offset for p in self.params))
        self._launch = _programmatic_launch() if programmatic else _libcuda().cuLaunchKernel
        self._lock = threading.Lock()

    @classmethod
    def from_numba(cls, kernel, argtypes: Sequence[Any], programmatic: bool = False) -> KernelLauncher:
        """The launcher of a ``cuda.jit`` kernel's overload for ``argtypes`` (compiled and
        loaded on the current device)."""
        cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
        return cls(cufunc.kernel, argtypes, cufunc.name, programmatic)

    def __call__(self, grid: tuple[int, int, int], block: int, stream_handle: int, shared_bytes: int,
                 *args: Any) -> None:
        if len(args) != self._nargs:
            raise TypeError(f"{self.name}: expected {self._nargs} arguments, got {len(args)}")
        with self._lock:
            self._pack(self._buffer, *args)
            err = self._launch(self.handle, grid[0], grid[1], grid[2], block, 1, 1, shared_bytes,
                               int(stream_handle), self._pointers, None)
        if err:
            self._failed(err, grid, block, shared_bytes)

    def _failed(self, err: int, grid: tuple[int, int, int], block: int, shared_bytes: int) -> None:
        raise RuntimeError(f"{self.name}: cuLaunchKernel failed: {driver_error(err)} (grid {grid}, "
                           f"{block} threads, {shared_bytes} bytes of shared memory)")

    def bind(self, grid: tuple[int, int, int], block: int, shared_bytes: int, *args: Any):
        """``fire(stream_handle, *pointers)``: this launch with every argument fixed but the stream
        and the device pointers of the array arguments (one a launch, in parameter order; the
        element counts given here stay). The parameters are packed here, once, into a buffer of
        the bound launch's own; a fire writes the pointers into it and calls the driver. For
        the calls of one layout (shapes, strides, scalars) that differ in their memory only.
        Thread-safe like a call."""
        if len(args) != self._nargs:
            raise TypeError(f"{self.name}: expected {self._nargs} arguments, got {len(args)}")
        if self._make_fire is None:
            self._make_fire = _firer([p.offset // 8 for p in self.params if p.code == "Q"])  # data fields
        buffer = ctypes.create_string_buffer(8 * max(self._words, 1))
        self._pack(buffer, *args)
        base = ctypes.addressof(buffer)
        pointers = (ctypes.c_void_p * max(len(self.params), 1))(*(base + p.offset for p in self.params))
        words = (ctypes.c_uint64 * max(self._words, 1)).from_buffer(buffer)

        def failed(err: int) -> None:
            self._failed(err, grid, block, shared_bytes)

        launch = _programmatic_launch() if self.programmatic else self._launch
        return self._make_fire(buffer, words, pointers, threading.Lock(), launch, self.handle,
                               grid[0], grid[1], grid[2], block, shared_bytes, failed)
