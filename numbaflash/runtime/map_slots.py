"""Tensor maps in device memory for the warp-specialised Hopper kernel (``forward_ws``), which
reads its four maps (q, k, v, o) from global memory.

Each device has slots of four maps (512 bytes), each with a pinned mirror. A call looks its
operands up by (pointer, shape, strides, box, dtype): on a hit it launches with the maps already
on the device, with no copy. Eager calls (a stream that is not capturing) share a ring of
``SLOTS`` slots: on a miss the maps are encoded into the least recently used slot and copied to
the device on the launch's own stream, so the copy lands before that kernel and after every
earlier kernel on the stream. A ring slot is overwritten only after every kernel that read it
has finished: an event recorded after each launch guards it. The pinned mirror is guarded the
same way.

CUDA graphs. A launch captured in a graph keeps its slot's device address as a kernel argument,
and a captured copy reads the slot's pinned mirror again at every replay, so a slot a capture
used must hold the same maps for as long as the graph may be replayed. Every launch asks the
driver whether its stream is capturing (``cuStreamIsCapturing``, one C call through ctypes,
about 0.4 us). A launch under capture

- that hits a ring slot pins it: the slot leaves the ring and is never evicted or rewritten
  again (its maps were copied by the eager call that filled it, before the capture); eager
  calls keep hitting it;
- that misses gets a slot of its own, never reused for other maps; its maps reach the device
  only through the captured copy (from a mirror that never changes), so eager calls never look
  it up, and a later capture of the same operands captures its own copy into the same slot.

Pinned slots are never freed (a graph may be replayed until the process ends): 512 bytes of
device memory and 512 of pinned host memory per pinned layout. The ring keeps ``SLOTS``
evictable slots however many are pinned. Beyond them ``GROW`` spare slots are allocated up
front for captures, and topped up by ``GROW`` at an eager miss once fewer than half are left, so
a capture rarely allocates; when one must (more than the spare slots pinned in one capture), it
allocates with the thread's capture mode relaxed, as torch's caching allocator does, so that
growing under a global-mode capture is legal.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import NoReturn

import numpy as np

SLOTS = 256  # evictable slots shared by eager calls
GROW = 64  # spare slots for captures to pin, allocated at a time
SLOT_BYTES = 4 * 128
PINNED = -1  # the slot ``MapSlots.address`` returns for a pinned slot: no event to record


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


def capture_query():
    """``query(stream handle, address of a C int) -> CUresult``: the driver's
    ``cuStreamIsCapturing`` through ctypes (once per launch), which writes the stream's
    ``CUstreamCaptureStatus`` (0: not capturing) to the int."""
    from .launch import _libcuda

    query = _libcuda().cuStreamIsCapturing
    query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    query.restype = ctypes.c_int
    return query


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """The calling thread's stream-capture mode relaxed inside the block (restored after): an
    allocation is then legal while a stream captures in global mode (torch's default)."""
    from cuda.bindings import driver

    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = _check(driver.cuThreadExchangeStreamCaptureMode(mode), "relaxing the stream-capture mode")
    try:
        yield
    finally:
        _check(driver.cuThreadExchangeStreamCaptureMode(previous), "restoring the stream-capture mode")


class MapSlots:
    """One device's tensor-map slots (make that device's context current first): the eager ring
    and the slots pinned by CUDA-graph captures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held from lookup to launch: a slot cannot move under a call
        self.device_of: list[int] = []  # slot -> device address of its four maps
        self.host_of: list[int] = []  # slot -> address of its pinned mirror
        self.events: list = []  # slot -> the event recorded after each eager launch that read it
        self._event_handles: list[int] = []
        self.free: list[int] = []  # slots never used
        self._record = event_recorder()
        self._is_capturing = capture_query()
        self._status = ctypes.c_int()
        self._status_address = ctypes.addressof(self._status)
        self.slot_of: OrderedDict[tuple, int] = OrderedDict()  # the ring: key -> slot, least recent first
        self.pinned: dict[tuple, int] = {}  # key -> ring slot a capture hit: never rewritten
        self.captured: dict[tuple, int] = {}  # key -> slot filled under capture, by its captured copies
        self.misses = 0
        self._grow(SLOTS + GROW)

    def _grow(self, count: int) -> None:
        """``count`` more free slots (one device and one pinned allocation)."""
        from cuda.bindings import driver

        flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with relaxed_capture():
            device = int(_check(driver.cuMemAlloc(count * SLOT_BYTES), "allocating map slots"))
            host = int(_check(driver.cuMemHostAlloc(count * SLOT_BYTES, 0), "pinning map slots"))
            events = [_check(driver.cuEventCreate(flags), "creating an event") for _ in range(count)]
        first = len(self.device_of)
        self.device_of += [device + i * SLOT_BYTES for i in range(count)]
        self.host_of += [host + i * SLOT_BYTES for i in range(count)]
        self.events += events
        self._event_handles += [int(event) for event in events]
        self.free += reversed(range(first, first + count))  # popped lowest first

    def _query_failed(self, stream: int, err: int) -> NoReturn:
        from .launch import driver_error

        raise RuntimeError(f"numbaflash tensor maps: cuStreamIsCapturing on stream {stream:#x} failed: "
                           f"{driver_error(err)} (expected CUDA_SUCCESS; the legacy default stream "
                           "cannot be used while another stream captures)")

    def address(self, key: tuple, encode, stream: int) -> tuple[int, int]:
        """(device address of the slot holding ``key``'s maps, slot for ``used``, or
        ``PINNED``): on a miss, ``encode()`` gives the four maps (uint64[4, 16]) and they are
        copied in on ``stream``. Under capture the slot is pinned (module docstring)."""
        err = self._is_capturing(stream, self._status_address)  # inline: the one C call per launch
        if err:
            self._query_failed(stream, err)
        capturing = self._status.value  # CUstreamCaptureStatus: 0 none, 1 active, 2 invalidated
        slot = self.slot_of.get(key)
        if slot is not None:
            if not capturing:
                self.slot_of.move_to_end(key)
                return self.device_of[slot], slot
            del self.slot_of[key]  # a graph reads it from now on: out of the ring, for good
            self.pinned[key] = slot
            return self.device_of[slot], PINNED
        slot = self.pinned.get(key)
        if slot is not None:
            return self.device_of[slot], PINNED
        if capturing:
            slot = self.captured.get(key)
            if slot is None:
                maps = self._encode(encode)
                slot = self.captured[key] = self._take()
                self._write(slot, maps)
            self._copy(slot, stream)  # captured: each replay copies the mirror, which never changes
            return self.device_of[slot], PINNED
        maps = self._encode(encode)
        if len(self.free) + len(self.slot_of) < SLOTS + GROW // 2:  # spare slots for captures
            self._grow(GROW)
        if len(self.slot_of) < SLOTS:
            slot = self._take()
        else:
            from cuda.bindings import driver

            _, slot = self.slot_of.popitem(last=False)
            _check(driver.cuEventSynchronize(self.events[slot]), "waiting for a slot's last kernel")
        self._write(slot, maps)
        self._copy(slot, stream)
        self.slot_of[key] = slot
        return self.device_of[slot], slot

    def _encode(self, encode) -> np.ndarray:
        """``encode()``'s maps, counted as a miss; a bad layout raises here, before anything
        changes."""
        maps = np.ascontiguousarray(encode(), dtype=np.uint64)
        self.misses += 1
        return maps

    def _take(self) -> int:
        """A never-used slot (``GROW`` more are allocated when none is left: under capture, only
        when one capture pinned more than the spare slots)."""
        if not self.free:
            self._grow(GROW)
        return self.free.pop()

    def _write(self, slot: int, maps: np.ndarray) -> None:
        np.ctypeslib.as_array((ctypes.c_uint64 * 64).from_address(self.host_of[slot]))[:] = maps.ravel()

    def _copy(self, slot: int, stream: int) -> None:
        from cuda.bindings import driver

        _check(driver.cuMemcpyHtoDAsync(self.device_of[slot], self.host_of[slot], SLOT_BYTES, stream),
               "copying tensor maps")

    def used(self, slot: int, stream: int) -> None:
        """The kernel just launched on ``stream`` reads ``slot`` (nothing to do for ``PINNED``)."""
        if slot < 0:
            return
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
