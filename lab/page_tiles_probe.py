"""Paged decode by rows against page tiles (issue 58 item 2): forced decode configs on caches in
shuffled pages of 64, beside the contiguous cache, in CUDA-graph replays (``decode_speed.graph_times``),
bf16, GQA 32/8, d128, every sequence full; two rounds, the best of each printed with its ratio to the
contiguous call (``dispatched``: the dispatch's own config). Run from the repository root:

    python lab/page_tiles_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from decode_speed import graph_times, paged_copy  # noqa: E402

import numbaflash  # noqa: E402
from numbaflash import configs  # noqa: E402
from numbaflash.kernels.shapes import DecodeConfig  # noqa: E402

ROWS = [(1, 8192, 1), (8, 8192, 1), (8, 8192, 4), (1, 131072, 1), (32, 4096, 1)]  # batch, keys, seqlen_q
FORCED = {"rows_s2": DecodeConfig(128, stages=2, paged=True),
          "tiles_s2": DecodeConfig(128, stages=2, paged=True, page_tiles=True),
          "tiles_s3": DecodeConfig(128, stages=3, paged=True, page_tiles=True)}


def ours(x, paged: bool):
    q, kc, vc, kp, vp, table, lens, out = x
    if paged:
        return numbaflash.flash_attention_with_kvcache(q, kp, vp, lens, block_table=table, out=out)
    return numbaflash.flash_attention_with_kvcache(q, kc, vc, lens, out=out)


def main() -> None:
    print("GPU:", torch.cuda.get_device_name(), flush=True)
    hq, hkv, d = 32, 8, 128
    for b, sk, sq in ROWS:
        kv_bytes = 2 * b * sk * hkv * d * 2
        data = []
        for _ in range(max(1, -(-300_000_000 // kv_bytes))):
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            kp, vp, table = paged_copy(kc, vc, 64)
            lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
            data.append((q, kc, vc, kp, vp, table, lens, torch.empty_like(q)))
        times: dict[str, list[float]] = {}
        for _ in range(2):
            for name, paged, forced in [("contiguous", False, None), ("dispatched", True, None),
                                        *((k, True, c) for k, c in FORCED.items())]:
                fns = [partial(ours, x, paged) for x in data]
                if forced is None:
                    t = statistics.median(graph_times(fns, 30))
                else:
                    with configs.force_decode_config(forced):
                        t = statistics.median(graph_times(fns, 30))
                times.setdefault(name, []).append(t * 1000)
        base = min(times["contiguous"])
        cells = " ".join(f"{k}={min(v):.1f}({base / min(v):.3f})" for k, v in times.items())
        print(f"{b}x{sk} q{sq}: {cells}", flush=True)


if __name__ == "__main__":
    main()
