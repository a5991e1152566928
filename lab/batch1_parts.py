"""Batch-1 decode (issue 58 item 1): the graphed call taken apart. Device time a call from
CUDA-graph replays (``decode_speed.graph_times``), GQA 32/8, d128, seqlen_q 1, the cache full,
bf16 and fp16, contiguous and paged (pages of 64, shuffled), beside SDPA cuDNN:

- ``full``: the dispatched call (split kernel, then the combine kernel);
- ``split only``: the same plan with its combine dropped (its output is not the answer);
- ``combine only``: the combine kernel alone on the call's scratch;
- ``node``: a one-element torch kernel, what any graph node costs.

    python lab/batch1_parts.py [--keys 8192,32768]

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from batch1_probe import cudnn  # noqa: E402  (lab/, this script's folder)
from decode_speed import graph_times, paged_copy  # noqa: E402

import numbaflash  # noqa: E402
from numbaflash.runtime import device as gpu_state  # noqa: E402

ROTATION_BYTES = 300_000_000


def ours(x, paged: bool):
    if paged:
        return numbaflash.flash_attention_with_kvcache(x.q, x.kp, x.vp, x.lens, block_table=x.table,
                                                       out=x.out)
    return numbaflash.flash_attention_with_kvcache(x.q, x.kc, x.vc, x.lens, out=x.out)


def median_us(fns) -> float:
    return statistics.median(graph_times(fns, 30)) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", default="8192,32768")
    args = p.parse_args()
    hq, hkv, d = 32, 8, 128
    plans = gpu_state.GPU.plans
    print(f"GPU: {torch.cuda.get_device_name()}; batch 1, GQA {hq}/{hkv}, d{d}; us a call (graphs)")
    tiny = torch.zeros(1, device="cuda")
    print(f"node (one-element torch kernel): {median_us([partial(tiny.add_, 1)] * 20):.2f} us")
    for dtype in (torch.bfloat16, torch.float16):
        for sk in (int(x) for x in args.keys.split(",")):
            kv_bytes = 2 * sk * hkv * d * 2
            copies = max(1, -(-ROTATION_BYTES // kv_bytes))
            data = []
            for _ in range(copies):
                q = torch.randn(1, 1, hq, d, device="cuda", dtype=dtype)
                kc = torch.randn(1, sk, hkv, d, device="cuda", dtype=dtype)
                vc = torch.randn_like(kc)
                kp, vp, table = paged_copy(kc, vc, 64)
                lens = torch.full((1,), sk, dtype=torch.int32, device="cuda")
                data.append(SimpleNamespace(q=q, kc=kc, vc=vc, kp=kp, vp=vp, table=table, lens=lens,
                                            out=torch.empty_like(q)))
            cells = [f"cuDNN {median_us([partial(cudnn, x) for x in data]):.1f}"]
            for paged in (False, True):
                fns = [partial(ours, x, paged) for x in data]
                before = set(plans)
                full = median_us(fns)
                (key,) = [k for k in plans if k not in before]
                plan = plans[key]
                part = torch.empty(2 * plan.parts, dtype=dtype, device="cuda")
                o_part = part.data_ptr()

                def combine_only(x, plan=plan, o_part=o_part):
                    plan.combine(torch.cuda.current_stream().cuda_stream, o_part, o_part + plan.lse_part_at,
                                 x.out.data_ptr(), plan.scratch)

                fns[0]()  # fill the scratch once with real partials for the combine-only graph
                combine = median_us([partial(combine_only, x) for x in data])
                plans[key] = plan._replace(combine=None)
                split = median_us(fns)
                plans[key] = plan
                label = "paged" if paged else "contiguous"
                cells.append(f"{label}: full {full:.1f}, split only {split:.1f}, combine only {combine:.1f} "
                             f"({plan.lse_part_at // (4 * d * hq)} splits)")
            print(f"{str(dtype)[6:]} sk {sk}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
