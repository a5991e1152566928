"""Batch-1 decode (issue 58 item 1): which ring and split count stream one sequence fastest, beside
SDPA cuDNN, on an H200. Device time a call from CUDA-graph replays (``decode_speed.graph_times``),
GQA 32/8, d128, bf16, seqlen_q 1, the cache full; each row forces a decode config (the ring of 3
at one CTA a SM, or of 2 at two) and a split count, contiguous and paged (pages of 64, shuffled).

    python lab/batch1_probe.py [--keys 8192,32768,131072] [--splits 8,16,24,32]

Needs the repository's ``benchmarks/`` on the path (it borrows ``decode_speed``'s helpers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from types import SimpleNamespace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from decode_speed import graph_times, paged_copy  # noqa: E402

import numbaflash  # noqa: E402
from numbaflash import configs  # noqa: E402
from numbaflash.kernels.shapes import DecodeConfig  # noqa: E402

ROTATION_BYTES = 300_000_000


def cudnn(x):
    """SDPA cuDNN on one copy's (q, k_cache, v_cache)."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return sdpa(x.q.transpose(1, 2), x.kc.transpose(1, 2), x.vc.transpose(1, 2), enable_gqa=True)


def ours(x, paged: bool, splits: int = 0):
    """The KV-cache call on one copy, contiguous or paged (0 splits: the dispatch's own)."""
    if paged:
        return numbaflash.flash_attention_with_kvcache(x.q, x.kp, x.vp, x.lens, block_table=x.table,
                                                       out=x.out, num_splits=splits)
    return numbaflash.flash_attention_with_kvcache(x.q, x.kc, x.vc, x.lens, out=x.out, num_splits=splits)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", default="8192,32768,131072")
    p.add_argument("--splits", default="8,16,24,32")
    args = p.parse_args()
    hq, hkv, d = 32, 8, 128
    print(f"GPU: {torch.cuda.get_device_name()}; bf16, batch 1, GQA {hq}/{hkv}, d{d}; us a call (graphs)")
    for sk in (int(x) for x in args.keys.split(",")):
        kv_bytes = 2 * sk * hkv * d * 2
        copies = max(1, -(-ROTATION_BYTES // kv_bytes))
        data = []
        for _ in range(copies):
            q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            kp, vp, table = paged_copy(kc, vc, 64)
            lens = torch.full((1,), sk, dtype=torch.int32, device="cuda")
            data.append(SimpleNamespace(q=q, kc=kc, vc=vc, kp=kp, vp=vp, table=table, lens=lens,
                                        out=torch.empty_like(q)))
        best = statistics.median(graph_times([partial(cudnn, x) for x in data], 30)) * 1000
        print(f"sk {sk}: cuDNN {best:.1f} us ({kv_bytes / best / 1e3:.0f} GB/s)", flush=True)
        for stages in (3, 2):
            for paged in (False, True):
                config = DecodeConfig(d, block_n=64, num_warps=4, stages=stages, paged=paged)
                cells = []
                for splits in (int(x) for x in args.splits.split(",")):
                    with configs.force_decode_config(config):
                        fns = [partial(ours, x, paged, splits) for x in data]
                        t = statistics.median(graph_times(fns, 30))
                    cells.append(f"{splits}:{t * 1000:.1f}({best / (t * 1000):.2f})")
                print(f"  ring {stages} {'paged' if paged else 'contiguous'}: " + " ".join(cells), flush=True)
        for paged in (False, True):
            t = statistics.median(graph_times([partial(ours, x, paged) for x in data], 30)) * 1000
            print(f"  dispatched {'paged' if paged else 'contiguous'}: {t:.1f} us ({best / t:.2f} of cuDNN)",
                  flush=True)


if __name__ == "__main__":
    main()
