"""What the process knows about its GPUs, in one object: ``GPU``.

The driver (``cuda.bindings.driver``, initialised once), each device's compute capability,
shared-memory limit and SM count, the kernels loaded (per process) and their launchers (per
device), and small per-device scratch allocations. Numba is not imported here: on a
kernel-cache hit a first call costs no Numba import.

Tests that need another driver or a fresh process's state swap the object
(``monkeypatch.setattr(device, "GPU", GpuState(load_driver=...))``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

NO_GPU = ("numbaflash needs an NVIDIA GPU with compute capability >= 8.0 (sm_80), and none "
          "is available")


def load_driver():
    from cuda.bindings import driver

    return driver


def driver_call(result, what: str, operation: str):
    """The value of a ``cuda.bindings`` driver call's result tuple, or RuntimeError naming the
    operation and the step that failed (the numpy paths of the backward and the varlen calls, which
    run on a stream of their own)."""
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"numbaflash {operation}: {what} failed: {result[0].name}")
    return result[1] if len(result) == 2 else None


class GpuState:
    """The process's GPU state. Every cache is keyed by device ordinal (or by kernel and
    ordinal); ``lock`` guards loading, compiling and allocating (the hot path only reads)."""

    def __init__(self, load_driver: Callable[[], Any] = load_driver) -> None:
        self.lock = threading.Lock()
        self._load_driver = load_driver
        self._driver = None  # cuda.bindings.driver, once cuInit has succeeded
        self._ctx_get_device = None  # ctypes cuCtxGetDevice (the one driver call of every launch)
        self.capabilities: dict[int, tuple[int, int]] = {}
        self.shared_limits: dict[int, int] = {}
        self.sm_counts: dict[int, int] = {}
        self.bandwidths: dict[int, float] = {}
        self.scratch: dict[int, int] = {}  # ordinal -> a float32 device scalar (unused LSE)
        self.modules: dict[tuple, tuple[Any, str]] = {}  # (config, causal, bf16, arch, op) -> (Kernel, name)
        self.launchers: dict[tuple, Any] = {}  # (config, ..., ordinal) -> (launcher, config, launch)
        # (ordinal, head_dim, causal, bf16, span) -> (launcher, config, launch): the forward's
        # hot-path lookup, filled while no config is forced
        self.ready: dict[tuple, Any] = {}
        # forward call layouts (operations.forward.plan_key) -> operations.forward.DevicePlan:
        # everything of a validated call but its memory and stream, filled while no config is forced
        self.plans: dict[tuple, Any] = {}
        self._usable: dict[int, tuple[int, int]] = {}  # ordinal -> capability, once found >= 8.0
        self.tensor_maps: dict[int, Any] = {}  # ordinal -> its runtime.map_slots.MapSlots

    # ------------------------------------------------------------------ driver

    def driver(self):
        """``cuda.bindings.driver``, initialised (``cuInit`` runs until it first succeeds, not on
        every call); RuntimeError if there is no usable driver or GPU."""
        if self._driver is not None:
            return self._driver
        try:
            driver = self._load_driver()
            (err,) = driver.cuInit(0)
        except Exception as exc:  # no libcuda.so: the bindings raise when they load it
            raise RuntimeError(f"{NO_GPU} (no CUDA driver: {exc})") from None
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{NO_GPU} (cuInit: {err.name})")
        self._driver = driver
        return driver

    def _check(self, result, what: str):
        driver = self.driver()
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {result[0].name}")
        return result[1] if len(result) == 2 else None

    # ------------------------------------------------------------------ current device

    def current(self) -> tuple[tuple[int, int], int]:
        """(compute capability, ordinal) of the current device, with a context current on this
        thread. With no context current it makes device 0's primary context current, as Numba,
        PyTorch and CuPy do, so that arrays of any of them work with it."""
        get = self._ctx_get_device
        if get is not None:  # the hot path: one driver call, one lookup
            device = ctypes.c_int()
            if get(device) == 0:
                cap = self._usable.get(device.value)
                if cap is not None:
                    return cap, device.value
        ordinal = self._current_ordinal()
        if ordinal is None:
            ordinal = self._make_primary_context_current()
        cap = self.capabilities.get(ordinal)
        if cap is None:
            cap = self.capabilities[ordinal] = self._capability(ordinal)
        if cap < (8, 0):
            raise RuntimeError(
                f"numbaflash needs compute capability >= 8.0 (sm_80, Ampere or newer); this GPU is "
                f"sm_{cap[0]}{cap[1]}"
            )
        self._usable[ordinal] = cap
        return cap, ordinal

    def _current_ordinal(self) -> int | None:
        """The device of this thread's current context (None if there is none): one driver call
        through ctypes once the driver is up (the bindings' wrapper costs a few microseconds)."""
        get = self._ctx_get_device
        if get is None:
            self.driver()  # cuInit first
            from .launch import _libcuda

            get = _libcuda().cuCtxGetDevice
            get.argtypes = [ctypes.POINTER(ctypes.c_int)]
            get.restype = ctypes.c_int
            self._ctx_get_device = get
        device = ctypes.c_int()
        return device.value if get(device) == 0 else None  # ctypes passes the int by reference

    def _make_primary_context_current(self) -> int:
        """Retain device 0's primary context (kept for the process) and make it current."""
        driver = self.driver()
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count == 0:
            raise RuntimeError(f"{NO_GPU} (no CUDA device visible)")
        device = self._check(driver.cuDeviceGet(0), "cannot get device 0")
        context = self._check(driver.cuDevicePrimaryCtxRetain(device),
                              "cannot create a CUDA context on device 0")
        self._check(driver.cuCtxSetCurrent(context), "cannot make device 0's context current")
        return 0

    def _attribute(self, name: str, ordinal: int) -> int:
        driver = self.driver()
        attr = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return int(self._check(driver.cuDeviceGetAttribute(attr, ordinal),
                               f"cannot read {name} of device {ordinal}"))

    def _capability(self, ordinal: int) -> tuple[int, int]:
        return (self._attribute("COMPUTE_CAPABILITY_MAJOR", ordinal),
                self._attribute("COMPUTE_CAPABILITY_MINOR", ordinal))

    # ------------------------------------------------------------------ per-device facts

    def shared_limit(self, ordinal: int) -> int:
        """The most dynamic shared memory a CTA may opt in to on device ``ordinal`` (the driver's
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 163 KB on an A100, 99 KB on sm_86/89/120, 227 KB on an H100)."""
        limit = self.shared_limits.get(ordinal)
        if limit is None:
            limit = self._attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", ordinal)
            self.shared_limits[ordinal] = limit
        return limit

    def sm_count(self, ordinal: int) -> int:
        count = self.sm_counts.get(ordinal)
        if count is None:
            count = self.sm_counts[ordinal] = self._attribute("MULTIPROCESSOR_COUNT", ordinal)
        return count

    def memory_bandwidth(self, ordinal: int) -> float:
        """Device ``ordinal``'s peak memory bandwidth in bytes a second, from the driver's memory
        clock (kHz, two transfers a clock) and bus width (bits): 3.35e12 on an H100 SXM, 4.9e12 on
        an H200; 0.0 where the driver reports neither."""
        bandwidth = self.bandwidths.get(ordinal)
        if bandwidth is None:
            try:
                clock_khz = self._attribute("MEMORY_CLOCK_RATE", ordinal)
                bus_bits = self._attribute("GLOBAL_MEMORY_BUS_WIDTH", ordinal)
            except (AttributeError, RuntimeError):  # an attribute this driver no longer has
                clock_khz = bus_bits = 0
            bandwidth = self.bandwidths[ordinal] = 2.0 * clock_khz * 1000 * bus_bits / 8
        return bandwidth

    def zero_words(self, pointer: int, count: int, stream: int) -> None:
        """Zero ``count`` 32-bit words of device memory from ``pointer``, on ``stream``
        (``cuMemsetD32Async``: ordered with the stream's kernels, and captured by CUDA graphs)."""
        driver = self.driver()
        result = driver.cuMemsetD32Async(pointer, 0, count, stream)  # a backward plan's every fire
        if result[0] != driver.CUresult.CUDA_SUCCESS:  # the message only on failure
            raise RuntimeError(f"cannot zero {count} words of device memory: {result[0].name}")

    def scratch_f32(self, ordinal: int) -> tuple[int, int]:
        """(pointer, 1) of a float32 device scalar, one per device, kept for the process: the LSE
        argument when no LSE is asked for (a fresh allocation per call would later be freed with
        cuMemFree, which makes the host wait for the device)."""
        pointer = self.scratch.get(ordinal)
        if pointer is None:
            with self.lock:
                if ordinal not in self.scratch:
                    driver = self.driver()
                    self.scratch[ordinal] = int(self._check(driver.cuMemAlloc(4),
                                                            f"cannot allocate 4 bytes on device {ordinal}"))
                pointer = self.scratch[ordinal]
        return pointer, 1


GPU = GpuState()
