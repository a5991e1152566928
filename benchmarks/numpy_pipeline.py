"""numpy in, numpy out: end-to-end time against the kernel and the host link (issue 12).

    python benchmarks/numpy_pipeline.py            # needs a GPU and torch

For each size, in one process: the end-to-end numpy call (median of several wall times) in
three ways, the kernel alone on device tensors (CUDA events), the pure transfer of the same
bytes from already-pinned memory (q, k, v host -> device, then O device -> host, one stream,
CUDA events), the ratio of the numpy call to that transfer, and the single-stream pageable
path it replaces (torch copies from numpy, kernel, copy back). The three numpy ways:

    same arrays   the same q, k, v every call (the inputs are registered in place from the
                  second call on; results come from the pinned pool)
    fresh arrays  new q, k, v every call (copied through the pinned slots: seen once)
    copy only     the same arrays with registration and the pool turned off (every byte
                  copied through the slots both ways: the first version of the pipeline)
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
    from numbaflash.runtime import host_memory, pipeline

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
    numbaflash.flash_attention(q, k, v)  # compile / load, allocate staging
    end_to_end = wall_ms(lambda: numbaflash.flash_attention(q, k, v), repeats)

    fresh_sets = [[x.copy() for x in (q, k, v)] for _ in range(min(repeats, 6))]
    fresh = wall_ms(lambda: numbaflash.flash_attention(*fresh_sets.pop()), len(fresh_sets))
    fresh_sets.clear()

    numbaflash.release_staging()
    min_bytes, empty = host_memory.REGISTER_MIN_BYTES, pipeline.pinned_empty
    host_memory.REGISTER_MIN_BYTES = 1 << 62
    pipeline.pinned_empty = lambda shape, dtype: np.empty(shape, dtype)
    try:
        numbaflash.flash_attention(q, k, v)
        copy_only = wall_ms(lambda: numbaflash.flash_attention(q, k, v), repeats)
    finally:
        host_memory.REGISTER_MIN_BYTES, pipeline.pinned_empty = min_bytes, empty

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
    return {"shape": shape, "end_to_end_ms": end_to_end, "fresh_ms": fresh, "copy_only_ms": copy_only,
            "kernel_ms": kernel, "transfer_ms": transfer_ms,
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


def timeline(path: str, shape) -> None:
    """Trace one call with the same (registered) arrays and one with fresh arrays, and draw
    each chunk's stages per lane: host gather / scatter, host -> device, kernel, device -> host."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numbaflash
    from numbaflash.runtime import pipeline

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
    for _ in range(3):
        numbaflash.flash_attention(q, k, v)
    fresh = [x.copy() for x in (q, k, v)]
    pipeline.TRACE = []
    try:
        t = time.perf_counter()
        numbaflash.flash_attention(q, k, v)
        walls = [1e3 * (time.perf_counter() - t)]
        t = time.perf_counter()
        numbaflash.flash_attention(*fresh)
        walls.append(1e3 * (time.perf_counter() - t))
        traces = pipeline.TRACE
    finally:
        pipeline.TRACE = None
    colors = {"gather": "0.6", "host to device": "tab:blue", "kernel": "tab:green",
              "device to host": "tab:orange", "scatter": "0.3"}
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    titles = ["same arrays (inputs registered in place, result in a pooled pinned block)",
              "fresh arrays (inputs gathered into pinned slots on the lane threads)"]
    for ax, stages, title, wall in zip(axes, traces, titles, walls, strict=True):
        for lane, stage, a, b in stages:
            row = {"gather": -0.3, "scatter": -0.3}.get(stage, 0.1)
            ax.broken_barh([(a, b - a)], (lane + row, 0.25 if row < 0 else 0.3), color=colors[stage])
        ax.set_title(f"{title}: {wall:.2f} ms wall", fontsize=10)
        ax.set_ylabel("lane")
        ax.invert_yaxis()
    axes[-1].set_xlabel("ms from the start of the call")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=5, fontsize=8)
    fig.suptitle(f"numpy pipeline, fp16 {shape}", fontsize=11)
    fig.savefig(path, dpi=110)
    print(f"timeline: {path} (same arrays {walls[0]:.2f} ms, fresh arrays {walls[1]:.2f} ms wall)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--lanes", type=int, help="pipeline lanes (streams + host threads); default: package's")
    p.add_argument("--chunks", type=int, help="target chunk count; default: the package's")
    p.add_argument("--sizes", default="all", help="'all' or 'first'")
    p.add_argument("--register-cost", action="store_true",
                   help="also time cuMemHostRegister + unregister of the inputs and output in place")
    p.add_argument("--timeline", metavar="PNG", help="also draw a per-chunk timeline of the first size")
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
    print("e2e ms: wall time of the numpy call; same = same arrays every call, fresh = new arrays "
          "every call, copy = registration and pool off")
    print(f"{'shape (B, S, H, D)':<22} {'GB moved':>8} {'e2e same':>9} {'e2e fresh':>10} {'e2e copy':>9} "
          f"{'kernel ms':>10} {'pinned xfer ms':>15} {'same / xfer':>12} {'fresh / xfer':>13} "
          f"{'pageable 1-stream ms':>21} {'bits = device':>14}")
    for shape in SIZES if args.sizes == "all" else SIZES[:1]:
        r = measure(shape, args.repeats)
        print(f"{str(shape):<22} {r['gb']:8.3f} {r['end_to_end_ms']:9.2f} {r['fresh_ms']:10.2f} "
              f"{r['copy_only_ms']:9.2f} {r['kernel_ms']:10.2f} {r['transfer_ms']:15.2f} {r['ratio']:12.2f} "
              f"{r['fresh_ms'] / r['transfer_ms']:13.2f} {r['single_stream_ms']:21.2f} "
              f"{str(r['bit_identical']):>14}")
    if args.timeline:
        timeline(args.timeline, SIZES[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
