"""The pinned pool and the in-place registrations (``runtime/host_memory.py``) against a fake
driver that records its calls: what is allocated, reused, registered, unregistered and when.
The same paths run on a real GPU in ``tests/test_pipeline_gpu.py``."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from numbaflash.runtime import host_memory as hm
from numbaflash.runtime import pipeline as pl

MB = 1 << 20
# Blocks and registrations end in finalizers that run when the last reference goes (refcounting).
# gc.collect(0) is the guard against a young cycle; a full collection walks the whole process's
# heap, which after the offline compile tests of a CI run costs seconds a call.


class FakeDriver:
    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTREGISTER_PORTABLE = 1

    def __init__(self):
        self.buffers = {}
        self.registered = {}
        self.log = []
        self.refuse_register = False

    def cuMemHostAlloc(self, nbytes, flags):
        buf = (ctypes.c_char * nbytes)()
        self.buffers[ctypes.addressof(buf)] = buf
        self.log.append(("alloc", nbytes))
        return (0, ctypes.addressof(buf))

    def cuMemFreeHost(self, address):
        del self.buffers[address]
        self.log.append(("free", address))
        return (0,)

    def cuMemHostRegister(self, address, nbytes, flags):
        if self.refuse_register or address in self.registered:
            return (self.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,)
        self.registered[address] = nbytes
        self.log.append(("register", nbytes))
        return (0,)

    def cuMemHostUnregister(self, address):
        del self.registered[address]
        self.log.append(("unregister", address))
        return (0,)

    def cuCtxPushCurrent(self, ctx):
        return (0,)

    def cuCtxPopCurrent(self):
        return (0, None)


@pytest.fixture
def fake(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(hm, "_driver", lambda: driver)
    monkeypatch.setattr(hm, "POOL", hm.PinnedPool())
    monkeypatch.setattr(hm, "REGISTRATIONS", hm.Registrations())
    return driver


def test_pool_block_comes_back_when_the_result_dies(fake):
    a = hm.POOL.empty((4, 1000, 8, 64), np.float16, 64 * MB, "ctx")
    assert a.shape == (4, 1000, 8, 64) and a.dtype == np.float16 and a.flags.c_contiguous
    assert a.flags.writeable
    a[...] = 1.5  # the memory is usable
    address = a.ctypes.data
    view = a[1:3]
    del a
    gc.collect(0)
    assert hm.POOL.in_use > 0, "a view still holds the block"
    del view
    gc.collect(0)
    assert hm.POOL.in_use == 0 and len(hm.POOL.idle) == 1
    b = hm.POOL.empty((4, 1000, 8, 64), np.float16, 64 * MB, "ctx")
    assert b.ctypes.data == address, "the block is reused, not allocated again"
    assert [e for e in fake.log if e[0] == "alloc"] == [("alloc", 4 * MB)]  # 4.1e6 bytes, 2 MB steps


def test_pool_respects_the_cap_and_drops_idle_blocks_for_room(fake):
    a = hm.POOL.empty((3 * MB,), np.uint8, 8 * MB, "ctx")  # a 4 MB block
    assert hm.POOL.empty((6 * MB,), np.uint8, 8 * MB, "ctx") is None  # 4 + 6 > 8: caller copies
    del a
    gc.collect(0)
    big = hm.POOL.empty((6 * MB,), np.uint8, 8 * MB, "ctx")  # the idle 4 MB block is freed first
    assert big is not None and hm.POOL.held == 6 * MB
    assert sum(1 for e in fake.log if e[0] == "free") == 1


def test_pool_does_not_hand_a_small_request_a_huge_block(fake):
    big = hm.POOL.empty((64 * MB,), np.uint8, 256 * MB, "ctx")
    del big
    gc.collect(0)
    small = hm.POOL.empty((1 * MB,), np.uint8, 256 * MB, "ctx")
    assert hm.POOL.in_use == 2 * MB and len(hm.POOL.idle) == 1
    del small


def test_array_is_registered_on_its_second_use_and_unregistered_when_it_dies(fake):
    regs = hm.REGISTRATIONS
    x = np.ones((8, 256, 8, 128), np.float16)  # 4 MB
    users: list[int] = []
    assert not regs.page_locked(x, 64 * MB, "ctx", users), "seen once: copied"
    assert not fake.registered
    assert regs.page_locked(x[:, :, 2:4], 64 * MB, "ctx", users), "a view of the same owner, again"
    assert fake.registered == {x.ctypes.data: x.nbytes}
    assert regs.page_locked(x, 64 * MB, "ctx", users)  # no second registration
    assert len(fake.registered) == 1 and len(users) == 2
    regs.done(users)
    address = x.ctypes.data
    del x
    gc.collect(0)
    assert fake.registered == {} and ("unregister", address) in fake.log
    assert regs.registered_bytes == 0 and not regs.live and not regs.seen


def test_what_is_never_registered(fake):
    regs = hm.REGISTRATIONS
    small = np.ones(1000, np.float16)
    readonly = np.ones(4 * MB, np.uint8)
    readonly.flags.writeable = False
    foreign = np.frombuffer(bytearray(4 * MB), np.uint8)  # memory numpy does not own
    for x in (small, readonly, foreign):
        for _ in range(3):
            assert not regs.page_locked(x, 64 * MB, "ctx", [])
    too_big = np.ones(8 * MB, np.uint8)
    for _ in range(3):
        assert not regs.page_locked(too_big, 4 * MB, "ctx", [])
    assert not fake.registered


def test_pool_blocks_count_as_page_locked_without_registration(fake):
    a = hm.POOL.empty((2, 3, 4, 64), np.float16, 64 * MB, "ctx")
    assert hm.REGISTRATIONS.page_locked(a[:, :, 1:3], 64 * MB, "ctx", [])
    assert not fake.registered


def test_registration_failure_falls_back_to_copying(fake):
    fake.refuse_register = True
    x = np.ones(4 * MB, np.uint8)
    for _ in range(3):
        assert not hm.REGISTRATIONS.page_locked(x, 64 * MB, "ctx", [])
    assert hm.REGISTRATIONS.failures >= 1


def test_eviction_is_least_recently_used_and_skips_arrays_in_use(fake):
    regs = hm.REGISTRATIONS
    a0, a1, a2, a3 = (np.ones(4 * MB, np.uint8) for _ in range(4))
    limit = 8 * MB
    in_use: list[int] = []
    assert not regs.page_locked(a0, limit, "ctx", in_use)
    assert regs.page_locked(a0, limit, "ctx", in_use)  # a call is using a0
    idle: list[int] = []
    assert not regs.page_locked(a1, limit, "ctx", idle)
    assert regs.page_locked(a1, limit, "ctx", idle)
    regs.done(idle)  # that call finished with a1
    assert not regs.page_locked(a2, limit, "ctx", idle)
    assert regs.page_locked(a2, limit, "ctx", in_use)  # 4 + 4 + 4 > 8: a1 (idle) is evicted
    assert a0.ctypes.data in fake.registered and a2.ctypes.data in fake.registered
    assert a1.ctypes.data not in fake.registered
    assert not regs.page_locked(a3, limit, "ctx", [])
    assert not regs.page_locked(a3, limit, "ctx", []), "nothing idle to evict: copy a3"
    regs.done(in_use)
    regs.release()
    assert not fake.registered


def test_pitched_layouts():
    x = np.zeros((2, 10, 8, 64), np.float16)
    assert pl._pitched(x)
    assert pl._pitched(x[:, :, 2:5])  # a head range of each row
    assert pl._pitched(np.zeros((2, 20, 8, 64), np.float16)[:, ::2])  # every other row
    assert not pl._pitched(x[:, :, ::2])  # heads apart
    assert not pl._pitched(x[::-1])  # batches backwards
    assert not pl._pitched(x[..., :32])  # part of each head
    assert not pl._pitched(np.broadcast_to(x[:, :1], x.shape))  # rows overlap
