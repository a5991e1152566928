"""MLA decode speed (issue 58 item 3; needs a GPU and PyTorch with CUDA): device time of
``flash_mla_with_kvcache`` from CUDA-graph replays (one graph holds a call on each of several
copies of the inputs, which together exceed the L2 cache), 3 rounds, one process; the latent cache
read a second (bytes of the rows attended to, 1152 a token) beside the GPU's HBM peak, and the
tensor work (2·(576 + 512) FLOPs a query row and key) a second. Then the host cost of an eager
call on torch tensors.

    python benchmarks/mla_speed.py [--dtype bf16] [--rows 0,1] [--peak-tbs 4.8] [--configs]

``--configs`` also times the candidates (``CANDIDATES``, forced) on each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from decode_speed import graph_times

import numbaflash
from numbaflash import configs
from numbaflash.kernels.shapes import MlaDecodeConfig, WsMlaConfig

D, DV = 576, 512
ROWS = [  # batch, query heads, cached tokens, seqlen_q, page size (None: contiguous), causal
    (64, 128, 4096, 1, 64, False),  # issue 58's bar: >= 80% of HBM peak
    (64, 64, 4096, 1, 64, False),
    (64, 32, 4096, 1, 64, False),
    (64, 16, 4096, 1, 64, False),
    (64, 16, 4096, 1, None, False),
    (64, 16, 4096, 1, 16, False),
    (64, 16, 4096, 1, 256, False),
    (64, 16, 4096, 1, 1, False),
    (1, 128, 32768, 1, 64, False),
    (32, 16, 8192, 1, 64, False),
    (64, 128, 4096, 2, 64, True),  # multi-token prediction
]
ROTATION_BYTES = 400_000_000
# The Hopper wgmma kernel's config (64-key tiles in a ring of 2, a stage a warpgroup)
WS = [WsMlaConfig()]
CANDIDATES = {  # by the call's packed rows (16, 32, 64): the shipped config's alternatives
    16: [MlaDecodeConfig(m_tiles=2, block_n=64, num_warps=8, key_warps=4, stages=2), *WS],  # 8 warps
    32: [MlaDecodeConfig(m_tiles=2, block_n=32, num_warps=4, key_warps=2, stages=3), *WS],  # the A100's
    64: [MlaDecodeConfig(m_tiles=4, block_n=32, num_warps=8, key_warps=2, stages=2), *WS],  # the A100's
}


def calls_for(dtype, b, h, s, sq, page, causal):
    """One call a copy of the inputs (enough copies to exceed ``ROTATION_BYTES``)."""
    copies = max(1, -(-ROTATION_BYTES // (b * s * D * 2)))
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    fns = []
    for _ in range(copies):
        q = torch.randn(b, sq, h, D, device="cuda", dtype=dtype)
        if page is None:
            cache, table = torch.randn(b, s, 1, D, device="cuda", dtype=dtype), None
        else:
            per_seq = s // page
            cache = torch.randn(b * per_seq, page, 1, D, device="cuda", dtype=dtype)
            table = torch.randperm(b * per_seq, device="cuda").to(torch.int32).reshape(b, per_seq)
        out = torch.empty(b, sq, h, DV, device="cuda", dtype=dtype)
        fns.append(lambda q=q, cache=cache, table=table, out=out: numbaflash.flash_mla_with_kvcache(
            q, cache, lens, table, causal=causal, out=out))
    return fns, lens


def line(name, b, h, s, sq, ms, peak):
    gbs = b * s * D * 2 / (ms * 1e-3) / 1e9
    tfs = 2 * (D + DV) * b * h * sq * s / (ms * 1e-3) / 1e12
    return f"| {name} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / (peak * 1e3):.0f}% | {tfs:.0f} |"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--rows", default="", help="indices of ROWS (default all)")
    p.add_argument("--peak-tbs", type=float, default=4.8,
                   help="the GPU's HBM peak, TB/s (H200 4.8, H100 3.35)")
    p.add_argument("--configs", action="store_true", help="time the candidates too")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, CUDA-graph replays, median of 3 rounds")
    print("| batch x heads x tokens x seqlen_q, page | µs | GB/s | of HBM peak | TFLOP/s |")
    print("|:--|--:|--:|--:|--:|")
    for b, h, s, sq, page, causal in rows:
        fns, _ = calls_for(dtype, b, h, s, sq, page, causal)
        where = "contiguous" if page is None else f"page {page}"
        name = f"{b} x {h} x {s} x {sq}, {where}{' causal' if causal else ''}"
        ms = statistics.median(graph_times(fns, 3))
        print(line(name, b, h, s, sq, ms, args.peak_tbs), flush=True)
        if args.configs:
            for config in CANDIDATES[16 if h * sq <= 16 else 32 if h * sq <= 32 else 64]:
                forced = dataclasses.replace(config, paged=page is not None)
                with configs.force_decode_config(forced):
                    ms = statistics.median(graph_times(fns, 3))
                print(line(f"  forced {forced.tag}", b, h, s, sq, ms, args.peak_tbs), flush=True)
        del fns
        torch.cuda.empty_cache()
    # host cost: eager calls on a tiny problem, the GPU never the bottleneck
    fns, _ = calls_for(dtype, 1, 16, 64, 1, 64, False)
    fn = fns[0]
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    n = 2000
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    print(f"host cost of an eager call (1 x 16 heads x 64 tokens, paged, out given): {host:.1f} µs")


if __name__ == "__main__":
    main()
