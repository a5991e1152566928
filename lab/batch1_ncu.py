"""Where the batch-1 decode call's fixed cost goes (issue 58 item 1, docs/PERFORMANCE.md [B1P]: about
8 us of the 15 us graphed 1 x 8192 call is not streaming): the kernels of a few eager calls, ours
contiguous and paged (pages of 64, shuffled) and SDPA cuDNN's, inside a profiler range for Nsight
Compute, each call's kernels after a warm-up (compiles and cuDNN's plan) outside it.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,\
dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active python lab/batch1_ncu.py [--keys 8192]

Under ncu the kernels run one at a time (no overlap of the combine's launch), so each duration is
the kernel's own; the graphed call's time (``lab/batch1_probe.py``) minus the sum of its kernels'
is what launches and dependencies add. Bf16, GQA 32/8, d128, seqlen_q 1, the cache full.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from decode_speed import paged_copy  # noqa: E402

import numbaflash  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, default=8192)
    p.add_argument("--calls", type=int, default=3, help="profiled calls of each")
    args = p.parse_args()
    hq, hkv, d, sk = 32, 8, 128, args.keys
    q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kp, vp, table = paged_copy(kc, vc, 64)
    lens = torch.full((1,), sk, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    calls = {
        "ours": lambda: numbaflash.flash_attention_with_kvcache(q, kc, vc, lens, out=out),
        "ours paged": lambda: numbaflash.flash_attention_with_kvcache(q, kp, vp, lens, block_table=table,
                                                                      out=out),
    }

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True)

    calls["cudnn"] = cudnn
    for call in calls.values():  # compiles, plans, cuDNN's graph: outside the profiled range
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls.values():
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"GPU: {torch.cuda.get_device_name()}; profiled {args.calls} calls each of {', '.join(calls)} "
          f"(1 x {sk} keys, bf16, GQA {hq}/{hkv}, d{d})")


if __name__ == "__main__":
    main()
