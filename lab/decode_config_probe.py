"""Decode configs and CTAs a SM on one row of ``decode_speed.SHAPES`` (issue 58): each forced config
(keys a tile, ring depth; 4 warps, 16 rows) at each ``launch_decode.STREAM_BYTES_PER_SM`` setting (which
sets the CTAs an SM runs, ``streaming_ctas``), contiguous and paged (pages of 64, shuffled; ``--page``
to change), device time a call from CUDA-graph replays, interleaved over rounds, beside SDPA cuDNN.

    python lab/decode_config_probe.py --row 6 --configs 128:2,128:3,64:3,64:2,256:2 --kb 64,96,128,192
    python lab/decode_config_probe.py --shape 32,8192,1,64,2,64 --configs 64:3:2 --kb 64,94

(``--shape``: batch, seqlen_k, seqlen_q, heads_q, heads_kv, head_dim in place of a row; a config
``n:s:m`` takes m m-tiles of 16 rows.)

Prints GB/s of K and V (median over rounds) and the CTAs a SM of each cell.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import decode_speed  # noqa: E402
from stream_bytes_probe import use  # noqa: E402  (lab/, this script's folder)

from numbaflash import configs  # noqa: E402
from numbaflash.kernels.shapes import DecodeConfig  # noqa: E402
from numbaflash.runtime import device as gpu_state  # noqa: E402


def timed(fns, config) -> float:
    with configs.force_decode_config(config):
        return statistics.median(decode_speed.graph_times(fns, 20))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--row", type=int, default=6)
    p.add_argument("--shape", default="")
    p.add_argument("--configs", default="128:2,128:3,64:3,64:2,256:2")
    p.add_argument("--kb", default="64,96,128,192")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    decode_speed.PAGE = args.page
    b, sk, sq, hq, hkv, d = (tuple(int(v) for v in args.shape.split(",")) if args.shape
                             else decode_speed.SHAPES[args.row])
    calls, kv_bytes = decode_speed.row_calls(torch.bfloat16, b, sk, sq, hq, hkv, d, True)
    shapes = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    settings = [int(x) for x in args.kb.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}; bf16 {b} x {sk} q{sq} GQA {hq}/{hkv} d{d}, "
          f"pages of {args.page}; GB/s of K and V (graphs), median of {args.rounds} rounds")
    times: dict = {}
    per_sm: dict = {}
    for _ in range(args.rounds):
        times.setdefault("cudnn", []).append(statistics.median(decode_speed.graph_times(calls["cudnn"], 20)))
        for n, s, *m in shapes:
            for kb in settings:
                use(kb)
                for label in ("ours", "paged"):
                    config = DecodeConfig(d, block_n=n, num_warps=4, stages=s, paged=label == "paged",
                                          m_tiles=m[0] if m else 1)
                    try:
                        t = timed(calls[label], config)
                    except Exception as error:  # a config this GPU cannot launch
                        print(f"n{n} s{s} {label}: {type(error).__name__}: {error}"[:200], flush=True)
                        continue
                    times.setdefault((n, s, kb, label), []).append(t)
                    kernels = [v for k, v in gpu_state.GPU.launchers.items() if k[0] == "decode"
                               and v.config == config]
                    per_sm[(n, s, kb, label)] = kernels[0].ctas_per_sm if kernels else "?"
    gbs = {k: kv_bytes / statistics.median(v) / 1e6 for k, v in times.items()}
    print(f"cuDNN {gbs['cudnn']:.0f}")
    for n, s, *_ in shapes:
        for label in ("ours", "paged"):
            cells = [f"{kb}K {gbs[(n, s, kb, label)]:.0f} ({per_sm[(n, s, kb, label)]}/SM, "
                     f"{gbs[(n, s, kb, label)] / gbs['cudnn']:.3f})"
                     for kb in settings if (n, s, kb, label) in gbs]
            print(f"n{n} s{s} {label}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
