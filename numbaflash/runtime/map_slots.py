"""Tensor maps in device memory for the warp-specialised Hopper kernel (``forward_ws``), which
reads its four maps (q, k, v, o) from global memory.

Each device has a ring of ``SLOTS`` slots of four maps (512 bytes) and a pinned mirror. A call
looks its operands up by (pointer, shape, strides, box, dtype): on a hit it launches with the
maps already on the device, with no copy. On a miss it encodes the maps into the least recently
used slot and copies them to the device on the launch's own stream, so the copy lands before
that kernel and after every earlier kernel on the stream. A slot is overwritten only after
every kernel that read it has finished: an event recorded after each launch guards it. The
pinned mirror is guarded the same way.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

SLOTS = 256
SLOT_BYTES = 4 * 128


def _check(result, what: str):
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"numbaflash tensor maps: {what} failed: {result[0].name}")
    return result[1] if len(result) == 2 else None


def event_recorder():
    """``record(event handle, stream handle) -> CUresult``: the driver's ``cuEventRecord``
    through ctypes (once per launch; the bindings' wrapper costs a few microseconds more)."""
    from .launch import _libcuda

    record = _libcuda().cuEventRecord
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    record.restype = ctypes.c_int
    return record


class MapSlots:
    """One device's ring of tensor-map slots (make that device's context current first)."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.lock = threading.Lock()  # held from lookup to launch: a slot cannot move under a call
        self.device = int(_check(driver.cuMemAlloc(SLOTS * SLOT_BYTES), "allocating map slots"))
        self.host = int(_check(driver.cuMemHostAlloc(SLOTS * SLOT_BYTES, 0), "pinning map slots"))
        flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.events = [_check(driver.cuEventCreate(flags), "creating an event") for _ in range(SLOTS)]
        self._event_handles = [int(event) for event in self.events]
        self._record = event_recorder()
        self.slot_of: OrderedDict[tuple, int] = OrderedDict()  # key -> slot, least recent first
        self.free = list(range(SLOTS))
        self.misses = 0

    def address(self, key: tuple, encode, stream: int) -> tuple[int, int]:
        """(device address of the slot holding ``key``'s maps, slot): on a miss, ``encode()``
        gives the four maps (uint64[4, 16]) and they are copied in on ``stream``."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
            return self.device + slot * SLOT_BYTES, slot
        from cuda.bindings import driver

        maps = np.ascontiguousarray(encode(), dtype=np.uint64)  # raises on a bad layout: nothing changed
        self.misses += 1
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.slot_of.popitem(last=False)
            _check(driver.cuEventSynchronize(self.events[slot]), "waiting for a slot's last kernel")
        host = self.host + slot * SLOT_BYTES
        np.ctypeslib.as_array((ctypes.c_uint64 * 64).from_address(host))[:] = maps.ravel()
        device = self.device + slot * SLOT_BYTES
        _check(driver.cuMemcpyHtoDAsync(device, host, SLOT_BYTES, stream), "copying tensor maps")
        self.slot_of[key] = slot
        return device, slot

    def used(self, slot: int, stream: int) -> None:
        """The kernel just launched on ``stream`` reads ``slot``."""
        err = self._record(self._event_handles[slot], int(stream))
        if err:
            from .launch import driver_error

            raise RuntimeError(f"numbaflash tensor maps: recording an event failed: {driver_error(err)}")


def map_slots(device: int) -> MapSlots:
    """Device ``device``'s slots, made on first use and kept in ``runtime.device.GPU``."""
    from .device import GPU

    slots = GPU.tensor_maps.get(device)
    if slots is None:
        with GPU.lock:
            slots = GPU.tensor_maps.get(device)
            if slots is None:
                slots = GPU.tensor_maps[device] = MapSlots()
    return slots
