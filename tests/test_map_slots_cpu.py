"""The Hopper kernel's tensor-map slots (``runtime/map_slots.py``) against a recording fake of the
driver: a hit copies nothing, a miss encodes and copies on the launch stream, and a slot is
reused (least recently used first) only after waiting for the last kernel that read it."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

driver = pytest.importorskip("cuda.bindings.driver")

from numbaflash.runtime import map_slots as ms  # noqa: E402

OK = driver.CUresult.CUDA_SUCCESS


@pytest.fixture
def fake(monkeypatch):
    log = []
    host = (ctypes.c_uint64 * (ms.SLOTS * ms.SLOT_BYTES // 8))()
    monkeypatch.setattr(driver, "cuMemAlloc", lambda n: (OK, 1 << 40))
    monkeypatch.setattr(driver, "cuMemHostAlloc", lambda n, f: (OK, ctypes.addressof(host)))
    events = iter(range(1000, 2000))
    monkeypatch.setattr(driver, "cuEventCreate", lambda f: (OK, next(events)))
    monkeypatch.setattr(driver, "cuMemcpyHtoDAsync",
                        lambda dst, src, n, stream: log.append(("copy", dst, stream)) or (OK,))
    monkeypatch.setattr(ms, "event_recorder", lambda: lambda e, stream: log.append(("record", e)) or 0)
    monkeypatch.setattr(driver, "cuEventSynchronize", lambda e: log.append(("wait", e)) or (OK,))
    monkeypatch.setattr(ms, "SLOTS", 3)
    return log, host


def maps(value):
    return np.full((4, 16), value, np.uint64)


def test_hit_copies_nothing_and_miss_copies_on_the_stream(fake):
    log, host = fake
    slots = ms.MapSlots()
    a, slot = slots.address(("a",), lambda: maps(7), stream=5)
    assert log == [("copy", a, 5)] and slots.misses == 1
    assert np.ctypeslib.as_array(host)[slot * 64:(slot + 1) * 64].tolist() == [7] * 64
    slots.used(slot, 5)
    log.clear()
    again, _ = slots.address(("a",), lambda: pytest.fail("encoded on a hit"), stream=6)
    assert again == a and log == [] and slots.misses == 1


def test_eviction_waits_for_the_slots_last_kernel(fake):
    log, _ = fake
    slots = ms.MapSlots()
    used = {}
    for key in "abc":
        _, used[key] = slots.address((key,), lambda: maps(1), stream=1)
        slots.used(used[key], 1)
    slots.address(("a",), lambda: maps(1), stream=1)  # "a" is now the most recent; "b" the least
    log.clear()
    _, slot = slots.address(("d",), lambda: maps(2), stream=2)
    assert slot == used["b"]
    assert log[0] == ("wait", slots.events[slot]) and log[1][0] == "copy"
    assert ("b",) not in slots.slot_of and ("d",) in slots.slot_of


def test_a_bad_layout_changes_nothing(fake):
    slots = ms.MapSlots()

    def bad():
        raise ValueError("outer strides must be multiples of 16 bytes")

    with pytest.raises(ValueError, match="16 bytes"):
        slots.address(("x",), bad, stream=1)
    assert not slots.slot_of and len(slots.free) == ms.SLOTS
