"""The Hopper kernel's tensor-map slots (``runtime/map_slots.py``) against a recording fake of the
driver: a hit copies nothing, a miss encodes and copies on the launch stream, and a slot is
reused (least recently used first) only after waiting for the last kernel that read it. Under
CUDA-graph capture a slot is pinned: never evicted nor rewritten, however many other layouts
pass through the ring afterwards."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

driver = pytest.importorskip("cuda.bindings.driver")

from numbaflash.runtime import launch  # noqa: E402
from numbaflash.runtime import map_slots as ms  # noqa: E402

OK = driver.CUresult.CUDA_SUCCESS
RELAXED = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
GLOBAL = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
CAPTURE = 9  # the stream that captures, in these tests


@pytest.fixture
def fake(monkeypatch):
    """The driver calls of ``map_slots``, recorded in ``fake.log``; streams in
    ``fake.capturing`` are capturing; ``fake.mode`` is the thread's capture mode."""
    state = SimpleNamespace(log=[], capturing={CAPTURE}, mode=GLOBAL, buffers=[], next_device=1 << 40)
    log = state.log

    def mem_alloc(n):
        address, state.next_device = state.next_device, state.next_device + n
        log.append(("alloc", n // ms.SLOT_BYTES, state.mode))
        return OK, address

    def host_alloc(n, flags):
        state.buffers.append(buffer := (ctypes.c_uint64 * (n // 8))())
        return OK, ctypes.addressof(buffer)

    def exchange_mode(mode):
        previous, state.mode = state.mode, mode
        return OK, previous

    def is_capturing(stream, status_address):
        ctypes.c_int.from_address(status_address).value = int(stream in state.capturing)
        return 0

    events = iter(range(1000, 2000))
    monkeypatch.setattr(driver, "cuMemAlloc", mem_alloc)
    monkeypatch.setattr(driver, "cuMemHostAlloc", host_alloc)
    monkeypatch.setattr(driver, "cuThreadExchangeStreamCaptureMode", exchange_mode)
    monkeypatch.setattr(driver, "cuEventCreate", lambda f: (OK, next(events)))
    monkeypatch.setattr(driver, "cuMemcpyHtoDAsync",
                        lambda dst, src, n, stream: log.append(("copy", dst, stream)) or (OK,))
    monkeypatch.setattr(ms, "event_recorder", lambda: lambda e, stream: log.append(("record", e)) or 0)
    monkeypatch.setattr(ms, "capture_query", lambda: is_capturing)
    monkeypatch.setattr(driver, "cuEventSynchronize", lambda e: log.append(("wait", e)) or (OK,))
    monkeypatch.setattr(ms, "SLOTS", 3)
    monkeypatch.setattr(ms, "GROW", 2)
    return state


def maps(value):
    return np.full((4, 16), value, np.uint64)


def mirror(slots, slot):
    return np.ctypeslib.as_array((ctypes.c_uint64 * 64).from_address(slots.host_of[slot])).tolist()


def launch_once(slots, key, value, stream):
    """What ``launch_sm90`` does around one launch: (device address, slot)."""
    address, slot = slots.address(key, lambda: maps(value), stream)
    slots.used(slot, stream)
    return address, slot


# Eager calls ---------------------------------------------------------------------------------------

def test_hit_copies_nothing_and_miss_copies_on_the_stream(fake):
    log = fake.log
    slots = ms.MapSlots()
    log.clear()
    a, slot = slots.address(("a",), lambda: maps(7), stream=5)
    assert log == [("copy", a, 5)] and slots.misses == 1
    assert mirror(slots, slot) == [7] * 64
    slots.used(slot, 5)
    assert log[-1] == ("record", slots._event_handles[slot])
    log.clear()
    again, _ = slots.address(("a",), lambda: pytest.fail("encoded on a hit"), stream=6)
    assert again == a and log == [] and slots.misses == 1


def test_eviction_waits_for_the_slots_last_kernel(fake):
    log = fake.log
    slots = ms.MapSlots()
    used = {}
    for key in "abc":
        _, used[key] = launch_once(slots, (key,), 1, stream=1)
    slots.address(("a",), lambda: maps(1), stream=1)  # "a" is now the most recent; "b" the least
    log.clear()
    _, slot = slots.address(("d",), lambda: maps(2), stream=2)
    assert slot == used["b"]
    assert log[0] == ("wait", slots.events[slot]) and log[1][0] == "copy"
    assert ("b",) not in slots.slot_of and ("d",) in slots.slot_of


def test_eager_calls_keep_a_ring_of_slots_and_never_grow(fake):
    """Without capture: one allocation of ``SLOTS`` slots and ``GROW`` spare ones (mode relaxed
    around it, then restored), each layout past them evicts the least recent, nothing is
    pinned."""
    slots = ms.MapSlots()
    for i in range(ms.SLOTS + 10):
        launch_once(slots, (i,), i, stream=1)
    assert [entry for entry in fake.log if entry[0] == "alloc"] == [("alloc", ms.SLOTS + ms.GROW, RELAXED)]
    assert fake.mode == GLOBAL
    assert len(slots.device_of) == ms.SLOTS + ms.GROW and len(slots.slot_of) == ms.SLOTS
    assert sum(entry[0] == "wait" for entry in fake.log) == 10
    assert not slots.pinned and not slots.captured and slots.misses == ms.SLOTS + 10


def test_a_bad_layout_changes_nothing(fake):
    slots = ms.MapSlots()

    def bad():
        raise ValueError("outer strides must be multiples of 16 bytes")

    for stream in (1, CAPTURE):
        with pytest.raises(ValueError, match="16 bytes"):
            slots.address(("x",), bad, stream=stream)
    assert not slots.slot_of and not slots.captured and len(slots.free) == ms.SLOTS + ms.GROW


# Under capture -------------------------------------------------------------------------------------

def churn(slots, count, start=100):
    """``count`` eager calls, each on a new layout."""
    for i in range(start, start + count):
        launch_once(slots, (i,), i, stream=1)


def writes_to(fake, slots, slot):
    """What touched ``slot`` in the log: copies into it, waits on its event, events recorded."""
    device, event = slots.device_of[slot], slots.events[slot]
    return [entry for entry in fake.log if entry[1] in (device, event)]


def test_a_ring_slot_used_under_capture_is_pinned(fake):
    """A capture that hits a ring slot pins it: no copy, no event; after SLOTS + 10 other
    layouts it was never evicted, waited on nor rewritten, and eager calls still hit it."""
    slots = ms.MapSlots()
    address, slot = launch_once(slots, ("a",), 7, stream=1)
    fake.log.clear()
    captured_address, pinned = launch_once(slots, ("a",), 7, stream=CAPTURE)
    assert (captured_address, pinned) == (address, ms.PINNED) and fake.log == []
    assert ("a",) in slots.pinned and ("a",) not in slots.slot_of
    churn(slots, ms.SLOTS + 10)
    assert writes_to(fake, slots, slot) == [] and mirror(slots, slot) == [7] * 64
    assert slot not in slots.slot_of.values()
    assert len(slots.slot_of) == ms.SLOTS  # the ring kept its size: a spare slot joined it
    fake.log.clear()
    for stream in (1, CAPTURE):
        hit = slots.address(("a",), lambda: pytest.fail("encoded a pinned slot"), stream)
        assert hit == (address, ms.PINNED)
    assert fake.log == []


def test_a_miss_under_capture_gets_a_slot_of_its_own(fake):
    """A capture that misses encodes into a never-used slot and captures its copy; eager calls
    never use that slot (its maps reach the device only when the graph replays), so SLOTS + 10
    other layouts leave it and its mirror alone; an eager call of the same layout misses."""
    slots = ms.MapSlots()
    churn(slots, ms.SLOTS)  # the ring full
    fake.log.clear()
    address, slot = slots.address(("g",), lambda: maps(5), stream=CAPTURE)
    assert slot == ms.PINNED
    own = slots.captured[("g",)]
    assert address == slots.device_of[own] and own not in slots.slot_of.values()
    assert fake.log == [("copy", address, CAPTURE)]  # a spare slot: nothing allocated
    slots.used(slot, CAPTURE)
    fake.log.clear()
    churn(slots, ms.SLOTS + 10, start=1000)
    assert writes_to(fake, slots, own) == [] and mirror(slots, own) == [5] * 64
    fake.log.clear()
    eager, ring = launch_once(slots, ("g",), 5, stream=1)
    assert eager != address and ring in slots.slot_of.values() and fake.log[0] != ("copy", address, 1)
    assert slots.captured[("g",)] == own


def test_recapturing_a_layout_copies_again_into_the_same_slot(fake):
    """A second capture of the same layout (a new graph) captures its own copy from the same
    unchanging mirror, with no new encoding."""
    slots = ms.MapSlots()
    address, _ = slots.address(("g",), lambda: maps(5), stream=CAPTURE)
    fake.log.clear()
    again, slot = slots.address(("g",), lambda: pytest.fail("encoded again"), stream=CAPTURE)
    assert (again, slot) == (address, ms.PINNED) and fake.log == [("copy", address, CAPTURE)]
    assert slots.misses == 1


def test_pinned_slots_grow_the_memory_and_the_ring_keeps_its_size(fake):
    """Many captured layouts: every one keeps its slot (allocated GROW at a time under
    relaxed capture mode), the ring keeps SLOTS evictable slots, no slot is shared."""
    slots = ms.MapSlots()
    count = ms.SLOTS + 10
    for i in range(count):
        launch_once(slots, ("ring", i), i, stream=1)
        launch_once(slots, ("ring", i), i, stream=CAPTURE)  # pins the ring slot
        launch_once(slots, ("captured", i), 500 + i, stream=CAPTURE)
    held = [*slots.pinned.values(), *slots.captured.values()]
    assert len(held) == len(set(held)) == 2 * count
    for i in range(count):
        assert mirror(slots, slots.pinned[("ring", i)]) == [i] * 64
        assert mirror(slots, slots.captured[("captured", i)]) == [500 + i] * 64
    assert not any(entry[0] == "wait" for entry in fake.log)
    assert all(entry[2] == RELAXED for entry in fake.log if entry[0] == "alloc")
    assert fake.mode == GLOBAL
    churn(slots, ms.SLOTS + 10)
    assert len(slots.slot_of) == ms.SLOTS and not set(slots.slot_of.values()) & set(held)


def test_spare_slots_are_topped_up_by_eager_misses(fake, monkeypatch):
    """``GROW`` spare slots for captures: a capture allocates only past them (relaxing the
    capture mode around the allocation); an eager miss tops them up once fewer than half
    are left."""
    monkeypatch.setattr(ms, "GROW", 4)
    slots = ms.MapSlots()
    churn(slots, ms.SLOTS)
    captures = iter(range(100))

    def capture_misses(count):
        fake.log.clear()
        for _ in range(count):
            launch_once(slots, ("captured", next(captures)), 0, stream=CAPTURE)
        return [entry for entry in fake.log if entry[0] == "alloc"]

    def eager_miss():
        fake.log.clear()
        churn(slots, 1, start=next(captures) + 1000)
        return [entry for entry in fake.log if entry[0] == "alloc"]

    assert capture_misses(ms.GROW) == []
    assert capture_misses(1) == [("alloc", ms.GROW, RELAXED)] and fake.mode == GLOBAL
    assert eager_miss() == []  # GROW - 1 spare
    assert capture_misses(2) == []
    assert eager_miss() == [("alloc", ms.GROW, RELAXED)]  # 1 spare < GROW / 2
    assert len(slots.free) == ms.GROW + 1 and len(slots.slot_of) == ms.SLOTS


def test_a_failed_capture_query_says_so(fake, monkeypatch):
    slots = ms.MapSlots()
    monkeypatch.setattr(slots, "_is_capturing", lambda stream, status: 906)
    monkeypatch.setattr(launch, "driver_error", lambda code: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT")
    with pytest.raises(RuntimeError, match="cuStreamIsCapturing on stream 0x0 failed: "
                                           "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"):
        slots.address(("a",), lambda: maps(1), stream=0)
    assert not slots.slot_of
