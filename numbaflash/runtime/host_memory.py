"""Page-locked host memory for numpy calls: the copy engines read and write it directly, so a
call whose arrays live in it needs no host-side copy at all.

Two sources (issue 12; the figures they reach are in ``docs/PERFORMANCE.md``):

* **Results from a pinned pool.** ``pinned_empty`` returns a numpy array backed by a block of
  pinned memory (``cuMemHostAlloc``); when the last array over the block is gone the block goes
  back to the pool for the next result, so a loop of calls allocates once. Copying into fresh
  pageable pages costs a page fault per page, pinning a block costs once.
* **Inputs registered in place.** An array whose memory an earlier call already used is
  page-locked where it is (``cuMemHostRegister``) and stays so while it lives: a weak
  reference to the numpy array that owns the memory unregisters it when that array is
  deallocated, before numpy frees the memory, so a registration never outlives its memory.
  An array seen once is copied instead: registering costs about as much as the copy, and only
  pays when the array comes back.

Both are capped by ``NUMBAFLASH_STAGING_LIMIT_MB`` (the pool in pinned bytes, the
registrations in registered bytes); past the cap a call falls back to copying.
``release()`` unregisters everything and frees the idle blocks.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

REGISTER_MIN_BYTES = 4 << 20  # smaller arrays are cheap to copy, and may share pages with others
POOL_ALIGN = 2 << 20


def _driver():
    from cuda.bindings import driver

    return driver


def _ok(result) -> bool:
    return result[0] == _driver().CUresult.CUDA_SUCCESS


class _Context:
    """Make ``context`` current on this thread for a few driver calls, then restore."""

    def __init__(self, context) -> None:
        self.context = context

    def __enter__(self):
        _driver().cuCtxPushCurrent(self.context)

    def __exit__(self, *exc):
        _driver().cuCtxPopCurrent()


class PinnedBlock:
    """One pool block: ``nbytes`` of pinned memory at ``address``, exposed to numpy through
    the array interface. numpy arrays over it keep it alive; when it dies, the block goes back
    to its pool."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                    "version": 3}


class PinnedPool:
    """Pinned blocks kept for reuse: a block is in use while an array over it lives."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # finalizers may run on any thread, even inside a call
        self.idle: list[tuple[int, int]] = []  # (nbytes, address)
        self.in_use = 0
        self.context = None

    @property
    def held(self) -> int:
        return self.in_use + sum(n for n, _ in self.idle)

    def empty(self, shape: tuple[int, ...], dtype, limit: int, context) -> np.ndarray | None:
        """A C-contiguous array over a pool block, or None when the cap would be passed."""
        driver = _driver()
        want = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        with self.lock:
            self.context = context
            fits = [(n, a) for n, a in self.idle if want <= n <= 2 * want]
            if fits:
                block = min(fits)
                self.idle.remove(block)
                nbytes, address = block
            else:
                nbytes = -(-want // POOL_ALIGN) * POOL_ALIGN
                while self.idle and self.held + nbytes > limit:  # make room: drop idle blocks
                    self._free(self.idle.pop(self.idle.index(max(self.idle))))
                if self.held + nbytes > limit:
                    return None
                result = driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_PORTABLE)
                if not _ok(result):
                    return None
                address = int(result[1])
            self.in_use += nbytes
        block_obj = PinnedBlock(address, nbytes)
        weakref.finalize(block_obj, self._give_back, nbytes, address)
        array = np.asarray(block_obj)[:want].view(dtype)
        return array.reshape(shape)

    def _give_back(self, nbytes: int, address: int) -> None:
        with self.lock:
            self.in_use -= nbytes
            self.idle.append((nbytes, address))

    def _free(self, block: tuple[int, int]) -> None:
        if self.context is not None:
            with _Context(self.context):
                _driver().cuMemFreeHost(block[1])

    def release_idle(self) -> None:
        with self.lock:
            while self.idle:
                self._free(self.idle.pop())


def memory_owner(array: np.ndarray):
    """The object whose memory ``array`` views: the end of its ``base`` chain."""
    owner = array
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    return owner


class _Registration:
    __slots__ = ("address", "nbytes", "context", "ref", "users")


class Registrations:
    """numpy arrays page-locked in place, least recently used first; and the arrays seen once."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: OrderedDict[int, _Registration] = OrderedDict()  # id(owner) -> registration
        self.seen: dict[int, weakref.ref] = {}  # id(owner) -> weak ref, arrays used once
        self.registered_bytes = 0
        self.failures = 0

    def page_locked(self, array: np.ndarray, limit: int, context, users: list[int]) -> bool:
        """True when ``array``'s memory is page-locked (a pool block, or registered now or
        before). Registers an owner the second time it is seen; never raises. A registration
        found or made is marked in use (its key appended to ``users``) until ``done(users)``,
        so that no other call evicts it while copies from it may be in flight."""
        owner = memory_owner(array)
        if isinstance(owner, PinnedBlock):
            return True
        if not (isinstance(owner, np.ndarray) and owner.flags.owndata and owner.flags.writeable):
            return False  # memory numpy does not own (mmap, bytes, another library): copy it
        if owner.nbytes < REGISTER_MIN_BYTES or owner.nbytes > limit:
            return False
        key = id(owner)
        with self.lock:
            reg = self.live.get(key)
            if reg is not None:
                if reg.address == owner.ctypes.data and reg.nbytes == owner.nbytes:
                    self.live.move_to_end(key)
                    reg.users += 1
                    users.append(key)
                    return True
                self._unregister(key)  # resized in place: the old registration is stale
                return False
            if key not in self.seen:
                self.seen[key] = weakref.ref(owner, lambda _, key=key: self._forget(key))
                return False
            if not self._register(key, owner, limit, context):
                return False
            self.live[key].users += 1
            users.append(key)
            return True

    def done(self, users: list[int]) -> None:
        """The call that marked ``users`` in use has finished with them."""
        with self.lock:
            for key in users:
                reg = self.live.get(key)
                if reg is not None:
                    reg.users -= 1

    def _register(self, key: int, owner: np.ndarray, limit: int, context) -> bool:
        driver = _driver()
        idle = [k for k, r in self.live.items() if not r.users]  # least recently used first
        while idle and self.registered_bytes + owner.nbytes > limit:
            self._unregister(idle.pop(0))
        if self.registered_bytes + owner.nbytes > limit:
            return False
        flags = driver.CU_MEMHOSTREGISTER_PORTABLE
        if not _ok(driver.cuMemHostRegister(owner.ctypes.data, owner.nbytes, flags)):
            self.failures += 1  # e.g. pages shared with a registered neighbour: copy instead
            self.seen.pop(key, None)
            return False
        reg = _Registration()
        reg.address, reg.nbytes, reg.context, reg.users = owner.ctypes.data, owner.nbytes, context, 0
        # Runs in the owner's deallocation, before numpy frees the memory.
        reg.ref = weakref.ref(owner, lambda _, key=key: self._unregister(key))
        self.seen.pop(key, None)
        self.live[key] = reg
        self.registered_bytes += reg.nbytes
        return True

    def _forget(self, key: int) -> None:
        with self.lock:
            self.seen.pop(key, None)

    def _unregister(self, key: int) -> None:
        with self.lock:
            reg = self.live.pop(key, None)
            if reg is None:
                return
            self.registered_bytes -= reg.nbytes
            try:
                with _Context(reg.context):
                    _driver().cuMemHostUnregister(reg.address)
            except Exception:  # noqa: S110 - at exit the driver may be gone; nothing to undo
                pass

    def release(self) -> None:
        """Unregister every registration no call is using."""
        with self.lock:
            for key in [k for k, r in self.live.items() if not r.users]:
                self._unregister(key)
            self.seen.clear()


POOL = PinnedPool()
REGISTRATIONS = Registrations()


def release() -> None:
    """Unregister every registered array and free the pool's idle blocks."""
    REGISTRATIONS.release()
    POOL.release_idle()
