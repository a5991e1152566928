"""mbarrier rings: the shared-memory stages a producer fills and consumers drain, in order.

A ring of ``stages`` stages is addressed by a use count, never by a stored slot: use ``i``
(0, 1, 2, ... over the whole kernel, counted alike by the producer and every consumer) lands
in stage ``slot(i) = i % stages`` and is round ``i // stages`` of that stage. Each stage has
a "full" mbarrier (the producer arms it with the bytes it expects; the copy engine completes
it) and an "empty" one (the consumers arrive once they have finished reading), 8 bytes apart
from stage to stage (``RingBarriers`` holds stage 0's).

An mbarrier completes one phase per round, and a wait names the parity of the phase it waits
for: use ``i`` is full once phase ``i // stages`` of its full barrier has completed
(``parity(i)``); its stage is free once round ``i // stages - 1`` has been released, the
other parity (a fresh barrier reads as completed for parity 1, so the first round passes).
A wait never runs more than one phase ahead or behind, so one bit tells the rounds apart.

``make_ring(stages, stage_bytes)`` returns the steps of one ring (``RingSteps``); the ring's
size is a compile-time constant, so ``%`` and ``//`` are a mask and a shift (or a multiply).
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, uint32

from ..ptx import hopper as hp

MBARRIER_BYTES = 8  # one mbarrier: a 64-bit shared word

# The mbarriers of one ring: 32-bit shared addresses of stage 0's full and empty barriers
# (stage s's at + 8 * s).
RingBarriers = namedtuple("RingBarriers", ["full", "empty"])

# The steps of one ring. Waits and releases take a use count ``i`` (uint32); addresses take a
# stage ``s`` (``slot(i)``, computed once where several addresses of a use are needed):
#   slot(i), parity(i)             the stage of use i, and the parity of the phase that completes it
#   full(bars, s), empty(bars, s)  shared addresses of stage s's full and empty barriers
#   offset(s)                      byte offset of stage s from the ring's first stage
#   wait_full(bars, i)             block until use i has landed in its stage
#   wait_empty(bars, i)            block until use i's stage is free (its previous round released)
#   arm(bars, s, nbytes)           the producer's arrival on stage s's full barrier, expecting nbytes
#   release(bars, i, lane)         this warp is done with use i's stage (lane 0 arrives on empty)
#   advance(i, n)                  the use count n uses after i
RingSteps = namedtuple("RingSteps", ["slot", "parity", "full", "empty", "offset", "wait_full", "wait_empty",
                                     "arm", "release", "advance"])

ONE = uint32(1)


def make_ring(stages: int, stage_bytes: int = 0) -> RingSteps:
    """The steps of a ring of ``stages`` stages of ``stage_bytes`` bytes each (uint32
    constants keep the use-count arithmetic in 32 bits)."""
    if stages < 1:
        raise ValueError(f"a ring needs at least 1 stage, got {stages}")
    SIZE = uint32(stages)
    STAGE_BYTES = uint32(stage_bytes)
    BAR_STRIDE = uint32(MBARRIER_BYTES)

    @cuda.jit(device=True, forceinline=True)
    def slot(i):
        """The stage that use ``i`` lands in."""
        return i % SIZE

    @cuda.jit(device=True, forceinline=True)
    def parity(i):
        """The parity of the full-barrier phase that completes use ``i`` (its round, mod 2)."""
        return (i // SIZE) & ONE

    @cuda.jit(device=True, forceinline=True)
    def full(bars, s):
        """Shared address of stage ``s``'s full barrier."""
        return bars.full + BAR_STRIDE * s

    @cuda.jit(device=True, forceinline=True)
    def empty(bars, s):
        """Shared address of stage ``s``'s empty barrier."""
        return bars.empty + BAR_STRIDE * s

    @cuda.jit(device=True, forceinline=True)
    def offset(s):
        """Byte offset of stage ``s`` from the ring's first stage."""
        return s * STAGE_BYTES

    # The waits spell out full(bars, slot(i)) and parity(i): the same arithmetic, in the order
    # and form that NVVM schedules best (the nested calls cost one instruction in the producer).
    @cuda.jit(device=True, forceinline=True)
    def wait_full(bars, i):
        """Wait until use ``i`` has landed in its stage (round i // stages completed)."""
        hp.mbarrier_wait_parity(bars.full + BAR_STRIDE * (i % SIZE), (i // SIZE) & ONE)

    @cuda.jit(device=True, forceinline=True)
    def wait_empty(bars, i):
        """Wait until the consumers have released the stage that use ``i`` will fill (its
        previous round; a fresh barrier reads as released)."""
        hp.mbarrier_wait_parity(bars.empty + BAR_STRIDE * (i % SIZE), ((i // SIZE) & ONE) ^ ONE)

    @cuda.jit(device=True, forceinline=True)
    def arm(bars, s, nbytes):
        """The producer's arrival on stage ``s``'s full barrier, expecting ``nbytes`` of copies."""
        hp.mbarrier_arrive_expect_tx(full(bars, s), nbytes)

    @cuda.jit(device=True, forceinline=True)
    def release(bars, i, lane):
        """This warp is done with use ``i``'s stage (one arrival per warp, from lane 0)."""
        if lane == 0:
            hp.mbarrier_arrive(empty(bars, slot(i)))

    @cuda.jit(device=True, forceinline=True)
    def advance(i, n):
        """The use count ``n`` uses after ``i``."""
        return i + uint32(n)

    return RingSteps(slot, parity, full, empty, offset, wait_full, wait_empty, arm, release, advance)
