"""Host-memory facts behind the numpy pipeline (issue 12): how fast this machine copies
between numpy (pageable) and pinned memory, with how many threads, into warm or fresh pages,
and what registering memory in place costs.

    python lab/host_copy_probe.py        # needs a GPU (pinned memory) and cuda-bindings

Prints one line per measurement: GB/s of bytes copied (not of memory traffic), median of 5.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time

import numpy as np

MB = 1 << 20


def sh(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"({e.strerror})"


def pinned(nbytes: int):
    from cuda.bindings import driver

    err, ptr = driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_PORTABLE)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    buf = (ctypes.c_char * nbytes).from_address(int(ptr))
    return np.frombuffer(buf, dtype=np.uint8)


def parallel_copy(dst: np.ndarray, src: np.ndarray, threads: int) -> float:
    """Copy src into dst split in ``threads`` row ranges; returns seconds."""
    parts = np.array_split(np.arange(dst.shape[0]), threads)
    ranges = [(p[0], p[-1] + 1) for p in parts if len(p)]
    go = threading.Barrier(len(ranges) + 1)

    def work(a, b):
        go.wait()
        np.copyto(dst[a:b], src[a:b])

    ts = [threading.Thread(target=work, args=r) for r in ranges]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def rate(nbytes: int, fn, repeats: int = 5) -> float:
    times = [fn() for _ in range(repeats)]
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    from cuda.bindings import driver

    driver.cuInit(0)
    err, dev = driver.cuDeviceGet(0)
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    driver.cuCtxSetCurrent(ctx)
    print("cpus", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)))
    print("THP enabled:", sh("/sys/kernel/mm/transparent_hugepage/enabled"))
    print("THP defrag:", sh("/sys/kernel/mm/transparent_hugepage/defrag"))
    model = [ln for ln in sh("/proc/cpuinfo").splitlines() if ln.startswith("model name")][:1]
    nodes = [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]
    print(model, "numa nodes:", len(nodes))
    n = 64 * MB
    rows = 4096
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).reshape(rows, -1)
    pin = pinned(n).reshape(rows, -1)
    warm = np.ones_like(src)
    for threads in (1, 2, 4, 8, 12, 16):
        r_in = rate(n, lambda t=threads: parallel_copy(pin, src, t))
        r_out = rate(n, lambda t=threads: parallel_copy(warm, pin, t))
        r_fresh = rate(n, lambda t=threads: parallel_copy(np.empty_like(src), pin, t))
        r_pp = rate(n, lambda t=threads: parallel_copy(warm, src, t))
        print(f"threads {threads:2d}: pageable->pinned {r_in:6.1f} GB/s  pinned->warm {r_out:6.1f}  "
              f"pinned->fresh np.empty {r_fresh:6.1f}  pageable->pageable {r_pp:6.1f}")
    # strided gather like a (batch, kv-head range) chunk: 4096 rows of 1 KB out of 4 KB rows
    s4 = src.reshape(rows, 4, -1)
    dst = pin.reshape(rows, 4, -1)[:, :1].copy()
    dstp = pinned(dst.nbytes).reshape(dst.shape)
    gather = rate(dst.nbytes, lambda: parallel_copy(dstp, s4[:, 1:2], 1))
    print(f"strided gather 1 KB of 4 KB rows, 1 thread: {gather:.1f} GB/s")
    # fresh page faulting alone
    def touch():
        t = time.perf_counter()
        a = np.empty(n, np.uint8)
        a[::4096] = 1
        return time.perf_counter() - t
    print(f"first touch of a fresh 64 MB np.empty: {rate(n, touch):.1f} GB/s equivalent")
    # register in place: warm array, fresh array
    for label, make in (("warm", lambda: warm), ("fresh np.empty", lambda: np.empty_like(src))):
        reg, unreg = [], []
        for _ in range(5):
            a = make()
            t = time.perf_counter()
            e = driver.cuMemHostRegister(a.ctypes.data, a.nbytes, 0)
            reg.append(time.perf_counter() - t)
            assert e[0] == driver.CUresult.CUDA_SUCCESS, e
            t = time.perf_counter()
            driver.cuMemHostUnregister(a.ctypes.data)
            unreg.append(time.perf_counter() - t)
        print(f"cuMemHostRegister 64 MB {label}: {1e3 * statistics.median(reg):.2f} ms, "
              f"unregister {1e3 * statistics.median(unreg):.2f} ms")
    # DMA from pinned, and from registered pageable
    err, dptr = driver.cuMemAlloc(n)
    err, stream = driver.cuStreamCreate(1)

    def dma(host_ptr, to_device=True):
        def run():
            t = time.perf_counter()
            if to_device:
                driver.cuMemcpyHtoDAsync(dptr, host_ptr, n, stream)
            else:
                driver.cuMemcpyDtoHAsync(host_ptr, dptr, n, stream)
            driver.cuStreamSynchronize(stream)
            return time.perf_counter() - t
        return run
    for width in (256, 1024, 4096):  # 2-D copies: rows of `width` bytes, 4 x width apart
        m = driver.CUDA_MEMCPY2D()
        kinds = driver.CUmemorytype
        m.srcMemoryType, m.srcHost, m.srcPitch = kinds.CU_MEMORYTYPE_HOST, pin.ctypes.data, 4 * width
        m.dstMemoryType, m.dstDevice, m.dstPitch = kinds.CU_MEMORYTYPE_DEVICE, dptr, width
        m.WidthInBytes, m.Height = width, n // (4 * width)

        def copy2d(m=m):
            t = time.perf_counter()
            driver.cuMemcpy2DAsync(m, stream)
            driver.cuStreamSynchronize(stream)
            return time.perf_counter() - t
        print(f"HtoD 2-D pinned, rows of {width} B every {4 * width} B: {rate(n // 4, copy2d):.1f} GB/s")
    for label, host in (("pinned", pin), ("registered", warm), ("pageable", src)):
        if label == "registered":
            driver.cuMemHostRegister(warm.ctypes.data, n, 0)
        up, down = rate(n, dma(host.ctypes.data)), rate(n, dma(host.ctypes.data, False))
        print(f"HtoD {label} {up:.1f} GB/s, DtoH {label} {down:.1f}")
        if label == "registered":
            driver.cuMemHostUnregister(warm.ctypes.data)


if __name__ == "__main__":
    main()
