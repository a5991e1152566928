"""Choose the forward kernel configuration per (GPU family, head dim, causal) by timing.

    python benchmarks/autotune.py [--write] [--family sm80] [--key sm86]

Times every candidate of ``numbaflash.configs.CANDIDATES`` for this GPU family (for head dims
its own kernel lacks, Hopper's ``dispatch_family`` is sm80: those keys are sm80's) on
the reference workload (fp16, batch*seqlen = 64k tokens, width 2048, seqlen 4096) and
prints a table; ``--write`` stores the winners in numbaflash/tuned_configs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from numbaflash import configs, flash_attention
from numbaflash.tools import bench


def time_ms(fn, warmup=3, repeats=15, warmup_ms=0.0):
    """Median ms of ``repeats`` event-timed calls after ``warmup`` calls and, with ``warmup_ms``,
    at least that long of calls (bench's clock-settling warm-up)."""
    if warmup_ms:
        device = bench.Device(torch)
        return statistics.median(bench.time_with_events(device, [fn], warmup, repeats, warmup_ms))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(configs.SUPPORTED_HEAD_DIMS))
    parser.add_argument("--only", choices=["mma", "ws"],
                        help="time only this kernel (mma.sync, or the warp-specialised Hopper one)")
    parser.add_argument("--family", choices=["auto", "sm80"], default="auto",
                        help="sm80: tune the mma.sync kernel's table entries at every head dim, also on "
                             "Hopper (issue 13: the sm80 table from H100/H200 runs)")
    parser.add_argument("--key", help="table key prefix to write instead of the family, e.g. sm86 or sm89 "
                                      "for entries of one GPU (configs.forward_config reads them first)")
    parser.add_argument("--short", action="store_true",
                        help=f"tune the short-sequence entries (<key>/short, read for sequences of at most "
                             f"{configs.SHORT_SEQLEN}); --seqlen must be at most that")
    parser.add_argument("--long", action="store_true",
                        help=f"tune the long-sequence entries (<key>/long, read for sequences of at least "
                             f"{configs.LONG_SEQLEN}); --seqlen must be at least that")
    parser.add_argument("--match", action="append", default=[],
                        help="time only candidates whose text contains this (repeatable: any of them)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the candidates this many times, in alternating order, each after a "
                             "250 ms clock-settling warm-up; report the mean of the medians")
    args = parser.parse_args()
    if args.short and args.seqlen > configs.SHORT_SEQLEN:
        parser.error(f"--short tunes sequences of at most {configs.SHORT_SEQLEN}, got --seqlen {args.seqlen}")
    if args.long and (args.short or args.seqlen < configs.LONG_SEQLEN):
        parser.error(f"--long tunes sequences of at least {configs.LONG_SEQLEN} (not with --short), "
                     f"got --seqlen {args.seqlen}")
    cap = torch.cuda.get_device_capability()
    print("GPU:", torch.cuda.get_device_name(), configs.arch_family(cap), time.strftime("%Y-%m-%d"))
    table = json.loads(configs.TABLE_PATH.read_text()) if configs.TABLE_PATH.is_file() else {}
    s = args.seqlen
    for d in args.head_dims:
        family = "sm80" if args.family == "sm80" else configs.dispatch_family(cap, d)
        b, h = 65536 // s, 2048 // d
        qkv = [torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3)]
        out = torch.empty_like(qkv[0])
        for causal in (False, True):
            key = configs.table_key(args.key or family, d, causal, args.short, args.long)
            forced = configs.table_key(configs.arch_family(cap), d, causal)  # what OVERRIDES reads
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            best = None
            cands = [c for c in configs.CANDIDATES[(family, d)]
                     if not (args.only and configs.config_to_json(c)["kernel"] != args.only)
                     and (not args.match or any(m in str(c) for m in args.match))]
            timed: dict = {}
            for r in range(max(1, args.rounds)):
                for cand in cands if r % 2 == 0 else cands[::-1]:
                    if timed.get(cand, []) is None:
                        continue
                    configs.OVERRIDES[forced] = cand
                    try:
                        ms = time_ms(lambda c=causal, x=qkv, o=out: flash_attention(*x, causal=c, out=o),
                                     repeats=15 if args.rounds <= 1 else 20,
                                     warmup_ms=0.0 if args.rounds <= 1 else 250.0)
                    except Exception as exc:  # a candidate that fails to build or launch is skipped
                        print(f"{key} {cand}: failed: {str(exc)[:100]}")
                        timed[cand] = None
                        continue
                    timed.setdefault(cand, []).append(ms)
            for cand, runs in timed.items():
                if not runs:
                    continue
                tflops = flops / statistics.fmean(runs) / 1e9
                rounds = ", ".join(f"{flops / m / 1e9:.1f}" for m in runs)
                per_round = f"  (rounds: {rounds})" if len(runs) > 1 else ""
                print(f"{key:>18} {tflops:7.1f} TFLOP/s  {cand}{per_round}")
                if best is None or tflops > best[1]:
                    best = (cand, tflops)
            configs.OVERRIDES.pop(forced, None)
            if best:
                cand, tf = best
                table[key] = {**configs.config_to_json(cand), "tflops": round(tf, 1)}
                print(f"best {key}: {table[key]}")
    print(json.dumps(table, indent=1))
    if args.write:
        configs.TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
