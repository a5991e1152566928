"""numpy in, numpy out: end-to-end time against the kernel and the host link (issue 12).

    python benchmarks/numpy_pipeline.py            # needs a GPU and torch

For each size, in one process: the end-to-end numpy call (median of several), the kernel alone
on device tensors (CUDA events), the pure transfer of the same bytes from already-pinned memory
(q, k, v host -> device, then O device -> host, one stream, CUDA events), the ratio of the
numpy call to that transfer, and the single-stream pageable path it replaces (torch copies
from numpy, kernel, copy back).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

SIZES = [(4, 4096, 16, 128), (8, 2048, 16, 64), (1, 1024, 8, 64)]


def event_ms(torch, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def measure(shape, repeats: int) -> dict:
    import torch

    import numbaflash

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
    numbaflash.flash_attention(q, k, v)  # compile / load, allocate staging
    end_to_end = wall_ms(lambda: numbaflash.flash_attention(q, k, v), repeats)

    dq, dk, dv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    for _ in range(3):
        numbaflash.flash_attention(dq, dk, dv)
    kernel = event_ms(torch, lambda: numbaflash.flash_attention(dq, dk, dv), repeats)

    pinned = [torch.from_numpy(x).pin_memory() for x in (q, k, v)]
    pinned_out = torch.empty(shape, dtype=torch.float16).pin_memory()
    dev = [torch.empty(shape, dtype=torch.float16, device="cuda") for _ in range(4)]

    def transfer():
        for src, dst in zip(pinned, dev, strict=False):
            dst.copy_(src, non_blocking=True)
        pinned_out.copy_(dev[3], non_blocking=True)

    transfer_ms = event_ms(torch, transfer, repeats)

    def single_stream():
        tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
        numbaflash.flash_attention(tq, tk, tv).cpu().numpy()

    single = wall_ms(single_stream, repeats)
    check = numbaflash.flash_attention(q, k, v)
    on_device = numbaflash.flash_attention(dq, dk, dv).cpu().numpy()
    same = np.array_equal(check.view(np.uint16), on_device.view(np.uint16))
    return {"shape": shape, "end_to_end_ms": end_to_end, "kernel_ms": kernel, "transfer_ms": transfer_ms,
            "ratio": end_to_end / transfer_ms, "single_stream_ms": single, "bit_identical": same,
            "gb": 4 * q.nbytes / 1e9}


def register_cost(torch) -> None:
    """Time pinning the caller's numpy memory in place (the alternative to copying into pinned
    staging): cuMemHostRegister of q, k, v and o of the first size, then unregister."""
    from cuda.bindings import driver

    torch.zeros(1, device="cuda")  # a current context on this thread
    arrays = [np.ones(SIZES[0], np.float16) for _ in range(4)]
    for _ in range(2):
        t = time.perf_counter()
        for a in arrays:
            (err,) = driver.cuMemHostRegister(a.ctypes.data, a.nbytes, 0)
            assert err == driver.CUresult.CUDA_SUCCESS, err
        registered = time.perf_counter() - t
        t = time.perf_counter()
        for a in arrays:
            driver.cuMemHostUnregister(a.ctypes.data)
        unregistered = time.perf_counter() - t
        print(f"cuMemHostRegister of 4 x {arrays[0].nbytes / 1e6:.0f} MB: {1000 * registered:.1f} ms, "
              f"unregister {1000 * unregistered:.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--lanes", type=int, help="pipeline lanes (streams + host threads); default: package's")
    p.add_argument("--chunks", type=int, help="target chunk count; default: the package's")
    p.add_argument("--sizes", default="all", help="'all' or 'first'")
    p.add_argument("--register-cost", action="store_true",
                   help="also time cuMemHostRegister + unregister of the inputs and output in place")
    args = p.parse_args()
    import torch

    from numbaflash.runtime import pipeline

    if args.lanes:
        pipeline.LANES = args.lanes
    if args.chunks:
        pipeline.TARGET_CHUNKS = args.chunks
    print(f"lanes {pipeline.LANES}, target chunks {pipeline.TARGET_CHUNKS}")
    if args.register_cost:
        register_cost(torch)

    print(f"GPU: {torch.cuda.get_device_name()}; fp16 numpy q = k = v, medians of {args.repeats}")
    print(f"{'shape (B, S, H, D)':<22} {'GB moved':>8} {'numpy e2e ms':>13} {'kernel ms':>10} "
          f"{'pinned xfer ms':>15} {'e2e / xfer':>11} {'pageable 1-stream ms':>21} {'bits = device':>14}")
    for shape in SIZES if args.sizes == "all" else SIZES[:1]:
        r = measure(shape, args.repeats)
        print(f"{str(shape):<22} {r['gb']:8.3f} {r['end_to_end_ms']:13.2f} {r['kernel_ms']:10.2f} "
              f"{r['transfer_ms']:15.2f} {r['ratio']:11.2f} {r['single_stream_ms']:21.2f} "
              f"{str(r['bit_identical']):>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
