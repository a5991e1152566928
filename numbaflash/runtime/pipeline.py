"""numpy in, numpy out: a chunked pipeline over pinned staging buffers and several streams
(issue 12; its end-to-end figures against the pinned transfer are in docs/PERFORMANCE.md).

The problem is cut into independent chunks of (batch, kv-head group) pairs: a range of whole
batches, or, when there are few batches, one batch and a range of kv heads (with their query
heads, so GQA groups stay together); and when there are fewer pairs than lanes (or one pair
is too big for a slot), a pair is cut further into ranges of query rows, each with the keys
its rows can see (all of them, or under causal masking or a window those up to its last row's
last key).

Each of ``LANES`` (8) lanes owns a CUDA stream, a device slot big enough for one chunk (and a
pinned host slot when a call copies through it), and a worker thread that runs its chunks in
turn:

    gather the chunk's q, k, v into the pinned slot, unless page-locked    host thread
    copy host -> device, run the kernel, copy O (and LSE) device -> host    the lane's stream
    wait for the stream, scatter O (and LSE), unless page-locked            host thread

Arrays in page-locked memory (``host_memory``: results from the pinned pool, inputs
registered in place) are copied by the copy engines straight from and to the caller's layout
(2-D copies, a head range of every row), with no host copy and no wait; the rest go through the
slot. The host copies of one lane overlap the DMA and kernels of the others, and the copy
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
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import host_memory

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
    """Shapes of one numpy call: q (batch, seqlen_q, heads_q, d), k (batch, seqlen_k, heads_kv, d),
    v (batch, seqlen_k, heads_kv, dv) and out (batch, seqlen_q, heads_q, dv), dv = ``value_dim``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    with_lse: bool
    causal: bool = False
    row_quantum: int = 128  # query-row ranges start at multiples of the kernel's block_m
    # Where the keys a row sees end: ``past_diagonal`` keys past its bottom-right diagonal (a
    # sliding window's right side; ``causal`` is 0), or -1: at the last key.
    past_diagonal: int = -1
    # A row chunk's problem only: its diagonal (seqlen_k - seqlen_q) lies this far before its
    # rows' own (``diagonal_shift``); a window kernel's sides move by it (left - shift, right + shift).
    diag_shift: int = 0
    head_dim_v: int = 0  # v's and out's head dim where it differs from head_dim (0: the same)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def value_dim(self) -> int:
        return self.head_dim_v or self.head_dim

    def bytes_per_pair(self) -> int:
        """Staged bytes of one (batch, kv head) pair: its q and o heads, k, v, LSE."""
        q_and_o = self.group * self.seqlen_q * (self.head_dim + self.value_dim) * 2
        kv = self.seqlen_k * (self.head_dim + self.value_dim) * 2
        lse = 4 * self.group * self.seqlen_q if self.with_lse else 0
        return q_and_o + kv + lse


@dataclass(frozen=True)
class Chunk:
    """Batches ``b0:b1``, kv heads ``g0:g1`` (query heads ``g0*group : g1*group``), query rows
    ``r0:r1`` and the keys ``0:k1`` they see (``k1 <= 0``: the rows see no key)."""

    b0: int
    b1: int
    g0: int
    g1: int
    r0: int
    r1: int
    k1: int

    @staticmethod
    def rows(p: Problem, b0: int, b1: int, g0: int, g1: int, r0: int = 0, r1: int | None = None) -> Chunk:
        """The chunk of query rows ``r0:r1`` (default all) with the keys those rows can see:
        under bottom-right causal masking, row i sees keys j <= i + seqlen_k - seqlen_q (under a
        window, j <= i + seqlen_k - seqlen_q + ``past_diagonal``), so the keys past the last
        row's last one are not needed. The kernel, given seqlen_k = k1 and seqlen_q = r1 - r0,
        puts the diagonal ``diagonal_shift`` keys before the rows' own (0 when causal)."""
        r1 = p.seqlen_q if r1 is None else r1
        end = 0 if p.causal else p.past_diagonal
        k1 = min(p.seqlen_k, r1 + p.seqlen_k - p.seqlen_q + end) if end >= 0 else p.seqlen_k
        return Chunk(b0, b1, g0, g1, r0, r1, k1)


def diagonal_shift(p: Problem, c: Chunk) -> int:
    """How far before its rows' own diagonal a kernel given chunk ``c`` alone puts it: row
    r0 + i sees keys from r0 + i + seqlen_k - seqlen_q on the diagonal, the kernel (seqlen_q =
    r1 - r0, seqlen_k = k1) from i + k1 - (r1 - r0). 0 for the whole rows, or causal masking;
    a window kernel keeps its band by taking sides (left - shift, right + shift)."""
    return p.seqlen_k - p.seqlen_q + c.r1 - c.k1


def plan_chunks(p: Problem, lanes: int = LANES, limit: int | None = None) -> list[Chunk]:
    """Independent chunks covering every (batch, kv head, query row) once: ranges of whole
    batches, or, with fewer batches than chunks wanted, one batch and a range of kv heads, or,
    with fewer pairs than lanes (or a pair too big for a slot), one pair and a range of query
    rows. About ``TARGET_CHUNKS`` chunks of at least ``MIN_CHUNK_BYTES``, each small enough
    that ``lanes`` slots fit in the staging limit where it can be; a small problem is one
    chunk."""
    limit = staging_limit_bytes() if limit is None else limit
    pair = p.bytes_per_pair()
    pairs = p.batch * p.heads_kv
    largest = limit // lanes
    wanted = max(MIN_CHUNK_BYTES, math.ceil(pair * pairs / TARGET_CHUNKS))
    pairs_per_chunk = min(largest, wanted) // pair  # 0: a pair is bigger than a chunk wanted
    if pairs_per_chunk >= p.heads_kv:  # whole batches
        per = min(p.batch, pairs_per_chunk // p.heads_kv)
        return [Chunk.rows(p, b, min(b + per, p.batch), 0, p.heads_kv) for b in range(0, p.batch, per)]
    parts = 1  # query-row ranges per pair
    if pairs_per_chunk == 0:
        if pairs < lanes:
            parts = min(math.ceil(TARGET_CHUNKS / pairs), pair // MIN_CHUNK_BYTES)
        parts = max(parts, math.ceil(pair / max(1, largest)))
        parts = max(1, min(parts, math.ceil(p.seqlen_q / p.row_quantum)))
    if parts == 1:
        per = max(1, pairs_per_chunk)
        return [Chunk.rows(p, b, b + 1, g, min(g + per, p.heads_kv))
                for b in range(p.batch) for g in range(0, p.heads_kv, per)]
    step = math.ceil(math.ceil(p.seqlen_q / parts) / p.row_quantum) * p.row_quantum
    return [Chunk.rows(p, b, b + 1, g, g + 1, r0, min(r0 + step, p.seqlen_q))
            for b in range(p.batch) for g in range(p.heads_kv) for r0 in range(0, p.seqlen_q, step)]


def _check(result, what: str):
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"numbaflash staging: {what} failed: {err.name}")
    return result[1] if len(result) == 2 else result[1:]


class _Slot:
    """One lane's device memory and, when a call copies through it, pinned host memory of the
    same size; grown on demand."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.host = 0
        self.device = 0

    def ensure(self, nbytes: int, host: bool) -> None:
        """At least ``nbytes`` of device memory, and of pinned host memory if ``host``."""
        from cuda.bindings import driver

        if nbytes <= self.nbytes and (self.host or not host):
            return
        nbytes = max(nbytes, self.nbytes)
        self.free()
        nbytes = 1 << max(20, (nbytes - 1).bit_length())  # powers of two: few regrowths
        self.device = int(_check(driver.cuMemAlloc(nbytes), f"allocating {nbytes} device bytes"))
        self.nbytes = nbytes
        if host:
            portable = driver.CU_MEMHOSTALLOC_PORTABLE  # pinned for every context, not only this one
            self.host = int(_check(driver.cuMemHostAlloc(nbytes, portable), f"pinning {nbytes} bytes"))

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
        # recorded after a chunk's host -> device copies: its pinned slot may take the next gather
        self.consumed = [_check(driver.cuEventCreate(no_timing), "creating an event") for _ in range(LANES)]
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
    """Free every device's pinned and device staging memory (after waiting for its streams),
    unregister the numpy arrays registered in place, and free the idle pooled result blocks
    (results still alive keep theirs). The next numpy call allocates again."""
    with _STAGING_LOCK:
        devices = list(_STAGING.values())
    for staging in devices:
        with staging.lock:
            staging.release()
    host_memory.release()


atexit.register(release_staging)


@dataclass
class ChunkLayout:
    """Where one chunk's arrays sit in a slot (byte offsets) and their dense shapes (q's and k's
    ``q_shape`` and ``kv_shape``; v's and out's ``v_shape`` and ``o_shape``, of v's head dim)."""

    q_shape: tuple[int, int, int, int]
    kv_shape: tuple[int, int, int, int]
    lse_shape: tuple[int, int, int]
    q: int
    k: int
    v: int
    o: int
    lse: int
    nbytes: int
    v_shape: tuple[int, int, int, int]
    o_shape: tuple[int, int, int, int]


def chunk_layout(p: Problem, c: Chunk) -> ChunkLayout:
    nb, ng, rows, keys = c.b1 - c.b0, c.g1 - c.g0, c.r1 - c.r0, max(0, c.k1)
    q_shape = (nb, rows, ng * p.group, p.head_dim)
    kv_shape = (nb, keys, ng, p.head_dim)
    v_shape, o_shape = (*kv_shape[:3], p.value_dim), (*q_shape[:3], p.value_dim)
    lse_shape = (nb, ng * p.group, rows)
    lse_bytes = 4 * math.prod(lse_shape) if p.with_lse else 0
    offsets, at = [], 0
    for size in (*(2 * math.prod(s) for s in (q_shape, kv_shape, v_shape, o_shape)), lse_bytes):
        offsets.append(at)
        at += (size + 255) // 256 * 256  # 256-byte aligned arrays
    return ChunkLayout(q_shape, kv_shape, lse_shape, *offsets, at, v_shape, o_shape)


# launch(chunk layout, device base address, problem of the chunk, stream handle)
LaunchChunk = Callable[[ChunkLayout, int, Problem, int], None]


def pinned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous result array, from the pinned pool when it has room (the
    result is then copied device -> host in place), else a plain ``np.empty``. Needs a
    current CUDA context."""
    from cuda.bindings import driver

    context = _check(driver.cuCtxGetCurrent(), "reading the current context")
    array = host_memory.POOL.empty(shape, dtype, staging_limit_bytes(), context)
    return np.empty(shape, dtype) if array is None else array


def _pitched(x: np.ndarray) -> bool:
    """Whether a (batch, rows, heads, d) array's head range of a row is one contiguous run and
    rows are a positive pitch apart: what a 2-D copy can address."""
    b_st, r_st, h_st, d_st = x.strides
    return (d_st == x.itemsize and h_st == x.shape[3] * x.itemsize and r_st >= x.shape[2] * h_st
            and b_st >= 0 and x.ctypes.data % x.itemsize == 0)


@dataclass(frozen=True)
class HostSide:
    """How each host array of a call moves: ``direct`` ones are page-locked and pitched, so
    the copy engines address them in place; the others go through the lane's pinned slot."""

    q: bool
    k: bool
    v: bool
    out: bool
    lse: bool

    @property
    def needs_slot_host(self) -> bool:
        return not all((self.q, self.k, self.v, self.out, self.lse))

    @property
    def gathers(self) -> bool:
        return not all((self.q, self.k, self.v))

    @property
    def scatters(self) -> bool:
        return not (self.out and self.lse)


# Set to a list to record a timeline of the next calls (benchmarks/numpy_pipeline.py --timeline):
# one ``Trace`` a call. Off (None) in normal use, where the marks cost nothing.
TRACE: list | None = None


class Trace:
    """When each chunk's stages ran: host copies by wall clock, stream work by timing events,
    both in ms from the call's start."""

    def __init__(self, stream) -> None:
        from cuda.bindings import driver

        self.stages: list[tuple[int, str, float | object, float | object]] = []  # lane, stage, start, end
        self.start = _timing_event()
        _check(driver.cuEventRecord(self.start, stream), "recording an event")
        _check(driver.cuEventSynchronize(self.start), "waiting for an event")
        self.host_start = time.perf_counter()
        self.lock = threading.Lock()

    def host(self, lane: int, stage: str, t0: float) -> None:
        now = time.perf_counter()
        with self.lock:
            self.stages.append((lane, stage, 1e3 * (t0 - self.host_start), 1e3 * (now - self.host_start)))

    def device(self, lane: int, stage: str, stream, begin) -> object:
        """Record the end of a stream stage that began at event ``begin``; returns the end."""
        from cuda.bindings import driver

        end = _timing_event()
        _check(driver.cuEventRecord(end, stream), "recording an event")
        with self.lock:
            self.stages.append((lane, stage, begin, end))
        return end

    def mark(self, stream) -> object:
        from cuda.bindings import driver

        event = _timing_event()
        _check(driver.cuEventRecord(event, stream), "recording an event")
        return event

    def resolve(self) -> list[tuple[int, str, float, float]]:
        """After the call: every stage as (lane, stage, start ms, end ms)."""
        from cuda.bindings import driver

        def ms(t):
            if isinstance(t, float):
                return t
            return float(_check(driver.cuEventElapsedTime(self.start, t), "timing an event"))

        return [(lane, stage, ms(a), ms(b)) for lane, stage, a, b in self.stages]


def _timing_event():
    from cuda.bindings import driver

    return _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "creating an event")


def run_numpy_forward(device: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                      lse: np.ndarray | None, launch: LaunchChunk, past_diagonal: int,
                      row_quantum: int) -> None:
    """Compute ``out`` (and ``lse``) from numpy q, k, v (any strides) through the pipeline;
    ``launch`` enqueues the kernel of one chunk whose arrays are dense in device memory.
    ``past_diagonal``: where each row's keys end, that many keys past its diagonal (0: causal
    masking or a window's right side 0), or -1 (at the last key). ``row_quantum`` is the
    kernel's query rows per CTA: a chunk of query rows starts at a multiple of it, so that its
    CTAs are the device path's and the results the same bits."""

    batch, seqlen_q, heads_q, head_dim = q.shape
    p = Problem(batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim, lse is not None,
                past_diagonal == 0, row_quantum, past_diagonal,
                head_dim_v=0 if v.shape[3] == head_dim else v.shape[3])
    chunks = plan_chunks(p)
    lanes = min(LANES, len(chunks))
    staging = _staging(device)
    limit = staging_limit_bytes()
    regs, users = host_memory.REGISTRATIONS, []

    def direct(x: np.ndarray) -> bool:
        return _pitched(x) and regs.page_locked(x, limit, staging.context, users)

    def direct_lse() -> bool:
        if lse is None:
            return True
        return lse.flags.c_contiguous and regs.page_locked(lse, limit, staging.context, users)

    with staging.lock:
        try:
            side = HostSide(direct(q), direct(k), direct(v), direct(out), direct_lse())
            largest = max(chunk_layout(p, c).nbytes for c in chunks)
            for slot in staging.slots[:lanes]:
                slot.ensure(largest, side.needs_slot_host)
            trace = Trace(staging.streams[0]) if TRACE is not None else None
            _run_lanes(staging, lanes, chunks, lambda lane, c: _run_chunk(
                p, c, side, staging, lane, (q, k, v, out, lse), launch, trace))
            if trace is not None:
                TRACE.append(trace.resolve())
        finally:
            regs.done(users)


def _run_lanes(staging: _DeviceStaging, lanes: int, chunks: list[Chunk], run_chunk) -> None:
    """Lane i runs chunks i, i + lanes, ... in turn on its stream and slot; waits for all."""
    from cuda.bindings import driver

    cancel = threading.Event()

    def run_lane(lane: int) -> None:
        driver.cuCtxSetCurrent(staging.context)
        for c in chunks[lane::lanes]:
            if cancel.is_set():
                return
            run_chunk(lane, c)

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


def _copy_2d(stream, to_device: bool, host: int, host_pitch: int, device: int, width: int,
             height: int) -> None:
    """Copy ``height`` rows of ``width`` bytes between pitched host memory and dense device
    memory (one DMA; a single run when the pitch is the width)."""
    from cuda.bindings import driver

    m = driver.CUDA_MEMCPY2D()
    host_type, device_type = driver.CUmemorytype.CU_MEMORYTYPE_HOST, driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    if to_device:
        m.srcMemoryType, m.srcHost, m.srcPitch = host_type, host, host_pitch
        m.dstMemoryType, m.dstDevice, m.dstPitch = device_type, device, width
    else:
        m.srcMemoryType, m.srcDevice, m.srcPitch = device_type, device, width
        m.dstMemoryType, m.dstHost, m.dstPitch = host_type, host, host_pitch
    m.WidthInBytes, m.Height = width, height
    _check(driver.cuMemcpy2DAsync(m, stream), "a 2-D copy to the " + ("device" if to_device else "host"))


def _copy_rows(stream, to_device: bool, x: np.ndarray, span: tuple[int, int, int, int, int, int],
               device: int) -> None:
    """Copy ``x[b0:b1, r0:r1, h0:h1]`` (``span``; pitched, page-locked) to or from dense
    device memory."""
    b0, b1, r0, r1, h0, h1 = span
    width = (h1 - h0) * x.strides[2]
    rows = r1 - r0
    base = x.ctypes.data + h0 * x.strides[2] + r0 * x.strides[1]
    if x.strides[1] == width and x.strides[0] == rows * width:  # the whole range is one run
        _copy_2d(stream, to_device, base + b0 * x.strides[0], width, device, width, (b1 - b0) * rows)
        return
    for b in range(b0, b1):
        _copy_2d(stream, to_device, base + b * x.strides[0], x.strides[1], device + (b - b0) * rows * width,
                 width, rows)


def _run_chunk(p: Problem, c: Chunk, side: HostSide, staging: _DeviceStaging, lane: int, arrays,
               launch: LaunchChunk, trace: Trace | None) -> None:
    """Gather, copy in, launch, copy out, (wait, scatter): one chunk on one lane."""
    from cuda.bindings import driver

    slot, stream, event = staging.slots[lane], staging.streams[lane], staging.events[lane]
    q, k, v, out, lse = arrays
    lay = chunk_layout(p, c)
    h0, h1 = c.g0 * p.group, c.g1 * p.group
    if c.k1 <= 0:  # rows whose keys end before the first key: 0, and LSE -inf, as the kernel gives
        out[c.b0:c.b1, c.r0:c.r1, h0:h1] = 0
        if lse is not None:
            lse[c.b0:c.b1, h0:h1, c.r0:c.r1] = -np.inf
        return
    t0 = time.perf_counter()
    u16 = np.uint16
    q_span, kv_span = (c.b0, c.b1, c.r0, c.r1, h0, h1), (c.b0, c.b1, 0, c.k1, c.g0, c.g1)
    inputs = ((q, side.q, lay.q, lay.q_shape, q_span), (k, side.k, lay.k, lay.kv_shape, kv_span),
              (v, side.v, lay.v, lay.v_shape, kv_span))
    if side.gathers:  # the lane's previous chunk must have left the slot's inputs part
        _check(driver.cuEventSynchronize(staging.consumed[lane]), "waiting for a chunk's copies")
    for x, is_direct, offset, shape, (b0, b1, r0, r1, a, b) in inputs:
        if not is_direct:
            slot.host_view(offset, shape, u16)[...] = x[b0:b1, r0:r1, a:b].view(u16)
    if trace is not None:
        trace.host(lane, "gather", t0)
        mark = trace.mark(stream)
    for x, is_direct, offset, shape, span in inputs:
        if is_direct:
            _copy_rows(stream, True, x, span, slot.device + offset)
        else:
            _check(driver.cuMemcpyHtoDAsync(slot.device + offset, slot.host + offset, 2 * math.prod(shape),
                                            stream), "copying to the device")
    if side.gathers:
        _check(driver.cuEventRecord(staging.consumed[lane], stream), "recording an event")
    if trace is not None:
        mark = trace.device(lane, "host to device", stream, mark)
    sub = Problem(c.b1 - c.b0, c.r1 - c.r0, c.k1, h1 - h0, c.g1 - c.g0, p.head_dim, p.with_lse, p.causal,
                  p.row_quantum, p.past_diagonal, diagonal_shift(p, c), p.head_dim_v)
    launch(lay, slot.device, sub, int(stream))
    if trace is not None:
        mark = trace.device(lane, "kernel", stream, mark)
    if side.out:
        _copy_rows(stream, False, out, q_span, slot.device + lay.o)
    else:
        _check(driver.cuMemcpyDtoHAsync(slot.host + lay.o, slot.device + lay.o, 2 * math.prod(lay.o_shape),
                                        stream), "copying to the host")
    if lse is not None:
        lse_bytes = 4 * math.prod(lay.lse_shape)
        if side.lse:  # lse is C-contiguous (batch, heads, rows): per batch, a head range of row runs
            per = lse_bytes // (c.b1 - c.b0)
            for b in range(c.b0, c.b1):
                host = lse[b, h0:h1, c.r0:].ctypes.data
                _copy_2d(stream, False, host, lse.strides[1], slot.device + lay.lse + (b - c.b0) * per,
                         4 * (c.r1 - c.r0), h1 - h0)
        else:
            _check(driver.cuMemcpyDtoHAsync(slot.host + lay.lse, slot.device + lay.lse, lse_bytes, stream),
                   "copying the LSE to the host")
    if trace is not None:
        trace.device(lane, "device to host", stream, mark)
    if not side.scatters:
        return  # nothing on the host waits for this chunk: the stream orders the lane's next
    _check(driver.cuEventRecord(event, stream), "recording an event")
    _check(driver.cuEventSynchronize(event), "waiting for a chunk")
    t0 = time.perf_counter()
    if not side.out:
        out[c.b0:c.b1, c.r0:c.r1, h0:h1].view(u16)[...] = slot.host_view(lay.o, lay.o_shape, u16)
    if lse is not None and not side.lse:
        lse[c.b0:c.b1, h0:h1, c.r0:c.r1] = slot.host_view(lay.lse, lay.lse_shape, np.float32)
    if trace is not None:
        trace.host(lane, "scatter", t0)
