"""Decode's bytes in flight a SM on this GPU (issue 58): ``launch_decode.STREAM_BYTES_PER_SM`` (64 KB,
measured on an H100) sets how many decode CTAs an SM runs (``streaming_ctas``) and so the split
count. The H200 streams 1.43x the H100's bytes a second at about the same latency, so by Little's
law it may want more on the way. Each row of ``decode_speed.SHAPES`` (bf16), contiguous and paged
(pages of 64, shuffled), device time a call from CUDA-graph replays, at each setting in turn,
interleaved over rounds, beside SDPA cuDNN's in the same process.

    python lab/stream_bytes_probe.py [--kb 64,96,128] [--rounds 3] [--rows 0,1,2,3,4,5,6]

Prints, for each row and setting, GB/s of K and V (median over rounds), CTAs a SM and splits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from decode_speed import SHAPES, graph_times, row_calls  # noqa: E402

from numbaflash.operations import launch_decode  # noqa: E402
from numbaflash.runtime import device as gpu_state  # noqa: E402


def use(kb: int) -> None:
    """Take ``kb`` KB a SM from the next call on: the kernels' launch choices and plans made again."""
    launch_decode.STREAM_BYTES_PER_SM = kb * 1024
    launch_decode.REFERENCE_SM_BANDWIDTH = float("inf")  # kb as given, not scaled by the GPU's bandwidth
    gpu = gpu_state.GPU
    for key in [k for k in gpu.launchers if k[0] == "decode"]:
        del gpu.launchers[key]
    gpu.plans.clear()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kb", default="64,96,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", default=",".join(str(i) for i in range(len(SHAPES))))
    args = p.parse_args()
    settings = [int(x) for x in args.kb.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}; bf16; GB/s of K and V (graphs), median of {args.rounds} "
          "rounds")
    for i in (int(x) for x in args.rows.split(",")):
        b, sk, sq, hq, hkv, d = SHAPES[i]
        calls, kv_bytes = row_calls(torch.bfloat16, b, sk, sq, hq, hkv, d, True)
        times = {("cudnn", 0): []}
        shape_of = {}
        for _ in range(args.rounds):
            times[("cudnn", 0)] += graph_times(calls["cudnn"], 20)
            for kb in settings:
                use(kb)
                for label in ("ours", "paged"):
                    times.setdefault((label, kb), []).extend(graph_times(calls[label], 20))
                    plan = next(iter(gpu_state.GPU.plans.values()))
                    kernels = [v for k, v in gpu_state.GPU.launchers.items()
                               if k[0] == "decode" and v.config.paged == (label == "paged")][0]
                    splits = plan.lse_part_at // (4 * d * b * hq * sq) if plan.parts else 1
                    shape_of[(label, kb)] = f"{kernels.ctas_per_sm}/SM x{splits}"
                    gpu_state.GPU.plans.clear()
        gbs = {k: kv_bytes / statistics.median(v) / 1e6 for k, v in times.items()}
        cells = [f"cuDNN {gbs[('cudnn', 0)]:.0f}"]
        for label in ("ours", "paged"):
            cells += [f"{label} {kb}K {gbs[(label, kb)]:.0f} ({shape_of[(label, kb)]})" for kb in settings]
        print(f"{b} x {sk} q{sq} d{d}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
