"""numpy in, numpy out: a chunked pipeline over pinned staging buffers and several streams
(design document 003).

The problem is cut into independent chunks of (batch, kv-head group) pairs: a range of whole
batches, or, when there are few batches, one batch and a range of kv heads (with their query
heads, so GQA groups stay together). Each of ``LANES`` (8) lanes owns a CUDA stream, a pinned host
slot and a device slot big enough for one chunk, and a worker thread that runs its chunks in
turn:

    gather the chunk's q, k, v from numpy into the pinned slot (dense)   host thread
    copy host -> device, run the kernel, copy O (and LSE) device -> host  the lane's stream
    wait for the stream, scatter O (and LSE) into the numpy result       host thread

so the host copies of one lane overlap the DMA and kernels of the others, and the copy
engines run both directions at once. Slots are kept per device and reused across calls
(growing on demand, within ``NUMBAFLASH_STAGING_LIMIT_MB``, default 2048 MB of pinned and of
device memory); ``release_staging()`` frees them, and they are freed at exit. One call holds a
device's slots at a time (other threads wait), and a call that fails midway waits for every
stream before it gives the slots back, so the next call is right.

Chunks compute the same (batch, head) blocks with the same kernel as the device-array path, so
the results are bit-identical to it.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# Measured on an H200 with (4, 4096, 16, 128) fp16 (benchmarks/numpy_pipeline.py --lanes --chunks):
# 4 lanes / 8 chunks 20.2 ms, 4 / 16 25.4 ms, 8 / 16 16.3 ms, 8 / 32 18.8 ms, 12 / 24 16.4 ms,
# 16 / 32 17.2 ms: the host copies are the bound (about 33 GB/s of host memory traffic).
LANES = 8
TARGET_CHUNKS = 16  # two chunks per lane: each lane has one queued behind its current one
MIN_CHUNK_BYTES = 4 << 20  # below this a chunk costs more in launches and waits than it overlaps
DEFAULT_LIMIT_MB = 2048


def staging_limit_bytes() -> int:
    """Pinned (and device) staging memory a device may keep, from ``NUMBAFLASH_STAGING_LIMIT_MB``."""
    text = os.environ.get("NUMBAFLASH_STAGING_LIMIT_MB", str(DEFAULT_LIMIT_MB))
    try:
        mb = int(text)
    except ValueError:
        raise ValueError(f"NUMBAFLASH_STAGING_LIMIT_MB must be an integer (MB), got {text!r}") from None
    if mb < 16:
        raise ValueError(f"NUMBAFLASH_STAGING_LIMIT_MB must be at least 16, got {mb}")
    return mb << 20


@dataclass(frozen=True)
class Problem:
    """Shapes of one numpy call: q (batch, seqlen_q, heads_q, d), k/v (batch, seqlen_k, heads_kv, d)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    with_lse: bool

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def bytes_per_pair(self) -> int:
        """Staged bytes of one (batch, kv head) pair: its q and o heads, k, v, LSE."""
        q_and_o = 2 * self.group * self.seqlen_q * self.head_dim * 2
        kv = 2 * self.seqlen_k * self.head_dim * 2
        lse = 4 * self.group * self.seqlen_q if self.with_lse else 0
        return q_and_o + kv + lse


@dataclass(frozen=True)
class Chunk:
    """Batches ``b0:b1`` and kv heads ``g0:g1`` (query heads ``g0*group : g1*group``)."""

    b0: int
    b1: int
    g0: int
    g1: int


def plan_chunks(p: Problem, lanes: int = LANES, limit: int | None = None) -> list[Chunk]:
    """Independent chunks covering every (batch, kv head) pair once: ranges of whole batches,
    or, with fewer batches than chunks wanted, one batch and a range of kv heads. About
    ``TARGET_CHUNKS`` chunks of at least ``MIN_CHUNK_BYTES``, each small enough that ``lanes``
    slots fit in the staging limit; a small problem is one chunk."""
    limit = staging_limit_bytes() if limit is None else limit
    pair = p.bytes_per_pair()
    total = pair * p.batch * p.heads_kv
    largest = max(pair, limit // lanes)  # one pair always fits: the limit never refuses a call
    wanted = max(MIN_CHUNK_BYTES, math.ceil(total / TARGET_CHUNKS))
    pairs_per_chunk = max(1, min(largest, wanted) // pair)
    if pairs_per_chunk >= p.heads_kv:  # whole batches
        per = min(p.batch, pairs_per_chunk // p.heads_kv)
        return [Chunk(b, min(b + per, p.batch), 0, p.heads_kv) for b in range(0, p.batch, per)]
    per = pairs_per_chunk
    return [Chunk(b, b + 1, g, min(g + per, p.heads_kv))
            for b in range(p.batch) for g in range(0, p.heads_kv, per)]


def _check(result, what: str):
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"numbaflash staging: {what} failed: {err.name}")
    return result[1] if len(result) == 2 else result[1:]


class _Slot:
    """One lane's pinned host memory and device memory (same size), grown on demand."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.host = 0
        self.device = 0

    def ensure(self, nbytes: int) -> None:
        from cuda.bindings import driver

        if nbytes <= self.nbytes:
            return
        self.free()
        nbytes = 1 << max(20, (nbytes - 1).bit_length())  # powers of two: few regrowths
        portable = driver.CU_MEMHOSTALLOC_PORTABLE  # pinned for every context, not only this one
        self.host = int(_check(driver.cuMemHostAlloc(nbytes, portable), f"pinning {nbytes} bytes"))
        try:
            self.device = int(_check(driver.cuMemAlloc(nbytes), f"allocating {nbytes} device bytes"))
        except RuntimeError:
            driver.cuMemFreeHost(self.host)
            self.host = 0
            raise
        self.nbytes = nbytes

    def host_view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A numpy array over pinned bytes ``offset`` .. of this slot."""
        count = math.prod(shape)
        itemsize = np.dtype(dtype).itemsize
        buf = (ctypes.c_char * (count * itemsize)).from_address(self.host + offset)
        return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)

    def free(self) -> None:
        from cuda.bindings import driver

        if self.host:
            driver.cuMemFreeHost(self.host)
        if self.device:
            driver.cuMemFree(self.device)
        self.nbytes = self.host = self.device = 0


class _DeviceStaging:
    """Streams, events and slots of one device, and the lock one call holds while using them."""

    def __init__(self, context) -> None:
        from cuda.bindings import driver

        self.context = context
        self.lock = threading.Lock()
        flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.streams = [_check(driver.cuStreamCreate(flags), "creating a stream") for _ in range(LANES)]
        no_timing = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.events = [_check(driver.cuEventCreate(no_timing), "creating an event") for _ in range(LANES)]
        self.slots = [_Slot() for _ in range(LANES)]

    def release(self) -> None:
        from cuda.bindings import driver

        driver.cuCtxSetCurrent(self.context)
        for stream in self.streams:
            driver.cuStreamSynchronize(stream)
        for slot in self.slots:
            slot.free()


_STAGING: dict[int, _DeviceStaging] = {}
_STAGING_LOCK = threading.Lock()
_WORKERS: ThreadPoolExecutor | None = None


def _staging(device: int) -> _DeviceStaging:
    from cuda.bindings import driver

    with _STAGING_LOCK:
        if device not in _STAGING:
            context = _check(driver.cuCtxGetCurrent(), "reading the current context")
            _STAGING[device] = _DeviceStaging(context)
        return _STAGING[device]


def _workers() -> ThreadPoolExecutor:
    global _WORKERS
    with _STAGING_LOCK:
        if _WORKERS is None:
            _WORKERS = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="numbaflash-lane")
        return _WORKERS


def release_staging() -> None:
    """Free every device's pinned and device staging memory (after waiting for its streams).
    The next numpy call allocates again."""
    with _STAGING_LOCK:
        devices = list(_STAGING.values())
    for staging in devices:
        with staging.lock:
            staging.release()


atexit.register(release_staging)


@dataclass
class ChunkLayout:
    """Where one chunk's arrays sit in a slot (byte offsets) and their dense shapes."""

    q_shape: tuple[int, int, int, int]
    kv_shape: tuple[int, int, int, int]
    lse_shape: tuple[int, int, int]
    q: int
    k: int
    v: int
    o: int
    lse: int
    nbytes: int


def chunk_layout(p: Problem, c: Chunk) -> ChunkLayout:
    nb, ng = c.b1 - c.b0, c.g1 - c.g0
    q_shape = (nb, p.seqlen_q, ng * p.group, p.head_dim)
    kv_shape = (nb, p.seqlen_k, ng, p.head_dim)
    lse_shape = (nb, ng * p.group, p.seqlen_q)
    q_bytes, kv_bytes = 2 * math.prod(q_shape), 2 * math.prod(kv_shape)
    lse_bytes = 4 * math.prod(lse_shape) if p.with_lse else 0
    offsets, at = [], 0
    for size in (q_bytes, kv_bytes, kv_bytes, q_bytes, lse_bytes):
        offsets.append(at)
        at += (size + 255) // 256 * 256  # 256-byte aligned arrays
    return ChunkLayout(q_shape, kv_shape, lse_shape, *offsets, at)


# launch(chunk layout, device base address, problem of the chunk, stream handle)
LaunchChunk = Callable[[ChunkLayout, int, Problem, int], None]


def run_numpy_forward(device: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                      lse: np.ndarray | None, launch: LaunchChunk) -> None:
    """Compute ``out`` (and ``lse``) from numpy q, k, v (any strides) through the pipeline;
    ``launch`` enqueues the kernel of one chunk whose arrays are dense in device memory."""
    from cuda.bindings import driver

    batch, seqlen_q, heads_q, head_dim = q.shape
    p = Problem(batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim, lse is not None)
    chunks = plan_chunks(p)
    lanes = min(LANES, len(chunks))
    staging = _staging(device)
    with staging.lock:
        largest = max(chunk_layout(p, c).nbytes for c in chunks)
        for slot in staging.slots[:lanes]:
            slot.ensure(largest)
        cancel = threading.Event()

        def run_lane(lane: int) -> None:
            driver.cuCtxSetCurrent(staging.context)
            slot, stream, event = staging.slots[lane], staging.streams[lane], staging.events[lane]
            for c in chunks[lane::lanes]:
                if cancel.is_set():
                    return
                _run_chunk(p, c, slot, stream, event, q, k, v, out, lse, launch)

        futures = [_workers().submit(run_lane, lane) for lane in range(lanes)]
        try:
            for f in futures:
                f.result()
        except BaseException:
            cancel.set()  # the lanes stop after their current chunk
            for f in futures:
                try:
                    f.result()
                except BaseException:  # noqa: S110 - the first error is the one raised
                    pass
            raise
        finally:
            for stream in staging.streams[:lanes]:
                driver.cuStreamSynchronize(stream)


def _run_chunk(p: Problem, c: Chunk, slot: _Slot, stream, event, q, k, v, out, lse,
               launch: LaunchChunk) -> None:
    """Gather, copy in, launch, copy out, wait, scatter: one chunk on one lane."""
    from cuda.bindings import driver

    lay = chunk_layout(p, c)
    h0, h1 = c.g0 * p.group, c.g1 * p.group
    u16 = np.uint16
    slot.host_view(lay.q, lay.q_shape, u16)[...] = q[c.b0:c.b1, :, h0:h1].view(u16)
    slot.host_view(lay.k, lay.kv_shape, u16)[...] = k[c.b0:c.b1, :, c.g0:c.g1].view(u16)
    slot.host_view(lay.v, lay.kv_shape, u16)[...] = v[c.b0:c.b1, :, c.g0:c.g1].view(u16)
    _check(driver.cuMemcpyHtoDAsync(slot.device, slot.host, lay.o, stream), "copying to the device")
    sub = Problem(c.b1 - c.b0, p.seqlen_q, p.seqlen_k, h1 - h0, c.g1 - c.g0, p.head_dim, p.with_lse)
    launch(lay, slot.device, sub, int(stream))
    out_bytes = lay.nbytes - lay.o
    _check(driver.cuMemcpyDtoHAsync(slot.host + lay.o, slot.device + lay.o, out_bytes, stream),
           "copying to the host")
    _check(driver.cuEventRecord(event, stream), "recording an event")
    _check(driver.cuEventSynchronize(event), "waiting for a chunk")
    out[c.b0:c.b1, :, h0:h1].view(u16)[...] = slot.host_view(lay.o, lay.q_shape, u16)
    if lse is not None:
        lse[c.b0:c.b1, h0:h1] = slot.host_view(lay.lse, lay.lse_shape, np.float32)
