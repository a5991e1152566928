"""Decode speed: numbaflash's ``flash_attention_with_kvcache`` beside PyTorch SDPA's flash and
cuDNN backends on the same KV cache, in one process, as GB/s of K and V read (needs a GPU and
PyTorch with CUDA).

    python benchmarks/decode_speed.py [--dtypes fp16,bf16] [--paged] [--graph] [--host [--profile]]

The shapes are issue 34's table (GQA 32/8, head dim 128) plus batch 128 x 2048 keys at head dim
64. Every implementation is timed in 3 blocks of CUDA-event-timed calls interleaved with the
others', each block after 250 ms of untimed calls (``tools.bench``); the median over all calls.
Calls rotate over enough copies of the inputs (at least 300 MB of K and V in all) that no call
finds its cache in the 50 MB L2. ``--graph`` times each implementation's calls captured in one
CUDA graph instead (device time alone, no host cost). ``--host`` prints the host cost of a call
(a small problem, so the device never holds the host back) and ``--profile`` a cProfile of ours.

SDPA gets the same keys as a dense (batch, heads, seqlen_k, head_dim) view with its GQA flag, and
no mask: its ``is_causal`` is top-left (query 0 would see key 0 only), while decode's causal mask
is bottom-right and, with seqlen_q rows against thousands of keys, hides a handful of keys.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash

SHAPES = [  # batch, seqlen_k, seqlen_q, heads_q, heads_kv, head_dim
    (1, 8192, 1, 32, 8, 128), (8, 8192, 1, 32, 8, 128), (32, 4096, 1, 32, 8, 128),
    (64, 32768, 1, 32, 8, 128), (8, 8192, 4, 32, 8, 128), (1, 131072, 1, 32, 8, 128),
    (128, 2048, 1, 32, 8, 64),
]
PAGE = 64
ROTATION_BYTES = 300_000_000


def paged_copy(kc, vc, page: int, shuffle: bool = True):
    """The caches as shuffled pages of ``page`` rows and their block table (``shuffle`` False:
    the identity table, the pages in the contiguous cache's order)."""
    b, sk, hkv, d = kc.shape
    n = b * sk // page
    order = torch.randperm(n, device="cuda") if shuffle else torch.arange(n, device="cuda")
    table = order.to(torch.int32).reshape(b, sk // page)
    kp = torch.empty(n, page, hkv, d, device="cuda", dtype=kc.dtype)
    vp = torch.empty_like(kp)
    kp[table.long()] = kc.reshape(b, sk // page, page, hkv, d)
    vp[table.long()] = vc.reshape(b, sk // page, page, hkv, d)
    return kp, vp, table


def row_calls(dtype, b, sk, sq, hq, hkv, d, paged: bool) -> tuple[dict, int]:
    """{label: [one call per input copy]} for ours (and paged), SDPA flash and cuDNN where they
    run; and the bytes of K and V one call reads."""
    kv_bytes = 2 * b * sk * hkv * d * torch.finfo(dtype).bits // 8
    copies = max(1, -(-ROTATION_BYTES // kv_bytes))
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    calls: dict[str, list] = {"ours": [], "paged": [], "flash": [], "cudnn": []}
    for _ in range(copies):
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
        kc = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        vc = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        calls["ours"].append(lambda q=q, kc=kc, vc=vc, out=out:
                             numbaflash.flash_attention_with_kvcache(q, kc, vc, lens, out=out))
        if paged:
            kp, vp, table = paged_copy(kc, vc, PAGE)
            calls["paged"].append(lambda q=q, kp=kp, vp=vp, table=table, out=out:
                                  numbaflash.flash_attention_with_kvcache(q, kp, vp, lens, block_table=table,
                                                                          out=out))
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(qt=qt, kt=kt, vt=vt, backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(qt, kt, vt, enable_gqa=hq != hkv)
            calls[label].append(run)
    for label in ("flash", "cudnn"):
        try:
            calls[label][0]()
        except RuntimeError:  # the backend does not take this problem: "-" in its column
            calls[label] = []
    return {label: fns for label, fns in calls.items() if fns}, kv_bytes


def graph_times(fns: list, rounds: int) -> list[float]:
    """Milliseconds a call, from replays of one CUDA graph that holds ``fns`` in turn."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    end = time.perf_counter() + 0.25
    while time.perf_counter() < end:
        graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / len(fns))
    return times


def speed_table(args) -> None:
    from numbaflash.tools.bench import Device, round_orders, time_with_events

    device = Device(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"{'CUDA-graph replays' if args.graph else 'eager calls'}")
    print("| dtype | batch | seqlen_k | seqlen_q | d | numbaflash GB/s | paged GB/s | flash GB/s "
          "| cudnn GB/s | ours / best | paged / ours |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name in args.dtypes.split(","):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for b, sk, sq, hq, hkv, d in SHAPES:
            calls, kv_bytes = row_calls(dtype, b, sk, sq, hq, hkv, d, args.paged)
            samples: dict[str, list[float]] = {label: [] for label in calls}
            for order in round_orders(list(calls), 3):
                for label in order:
                    if args.graph:
                        samples[label] += graph_times(calls[label], max(3, args.iters // 3))
                    else:
                        samples[label] += time_with_events(device, calls[label], 5, args.iters // 3, 250.0)
            gbs = {label: kv_bytes / statistics.median(t) / 1e6 for label, t in samples.items()}
            best = max(gbs.get("flash", 0.0), gbs.get("cudnn", 0.0))
            cells = [f"{gbs[label]:.0f}" if label in gbs else "-"
                     for label in ("ours", "paged", "flash", "cudnn")]
            paged = f"{gbs['paged'] / gbs['ours']:.3f}" if "paged" in gbs else "-"
            print(f"| {name} | {b} | {sk} | {sq} | {d} | {' | '.join(cells)} | {gbs['ours'] / best:.3f} | "
                  f"{paged} |", flush=True)
            del calls
            torch.cuda.empty_cache()


def host_table(args) -> None:
    """Host microseconds of one decode call: back-to-back calls over their number, and one call
    while the device is busy (``tools.bench.time_host_issue``); a small problem (batch 1, 256
    keys, GQA 32/8, head dim 128) so that the device never holds the host back."""
    from numbaflash.tools import bench

    device = bench.Device(torch)
    b, sk, hq, hkv, d = 1, 256, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    kp, vp, table = paged_copy(kc, vc, PAGE)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def sdpa_call(backend):
        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, enable_gqa=True)
        return run

    decode = numbaflash.flash_attention_with_kvcache
    calls = {
        "numbaflash": lambda: decode(q, kc, vc, lens),
        "numbaflash out=": lambda: decode(q, kc, vc, lens, out=out),
        "numbaflash paged out=": lambda: decode(q, kp, vp, lens, block_table=table, out=out),
        "numbaflash 4 splits out=": lambda: decode(q, kc, vc, lens, out=out, num_splits=4),
        "sdpa flash": sdpa_call(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": sdpa_call(SDPBackend.CUDNN_ATTENTION),
    }
    print(f"GPU: {torch.cuda.get_device_name()}; host cost of one decode call, (B, Sk, Hq, Hkv, D) = "
          f"({b}, {sk}, {hq}, {hkv}, {d}), fp16, {args.calls} calls")
    print(f"{'implementation':<26} {'back-to-back us/call':>21} {'one call, device busy, us':>26}")
    for name, call in calls.items():
        wall, busy = bench.host_cost_us(device, call, args.calls)
        print(f"{name:<26} {wall:>21.1f} {busy:>26.1f}", flush=True)
    if args.profile:
        print(bench.profile_calls(device, calls["numbaflash out="], args.calls))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--paged", action="store_true", help="also time a paged cache (page size 64, shuffled)")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (device time alone)")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--host", action="store_true", help="print the host cost of a call instead")
    p.add_argument("--profile", action="store_true", help="with --host: a cProfile of our calls")
    p.add_argument("--calls", type=int, default=2000, help="with --host: calls to time")
    args = p.parse_args()
    if args.host:
        host_table(args)
    else:
        speed_table(args)


if __name__ == "__main__":
    main()
