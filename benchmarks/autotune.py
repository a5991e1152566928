"""Choose the forward kernel configuration per (GPU family, head dim, causal) by timing, or with
``--backward`` the backward's per (head dim, causal).

    python benchmarks/autotune.py [--write] [--family sm80] [--key sm86]
    python benchmarks/autotune.py --backward [--write] [--head-dims 64 128] [--causal both]

Times every candidate of ``numbaflash.configs.CANDIDATES`` for this GPU family (for head dims
its own kernel lacks, Hopper's ``dispatch_family`` is sm80: those keys are sm80's) on
the reference workload (fp16, batch*seqlen = 64k tokens, width 2048, seqlen 4096) and
prints a table; ``--write`` stores the winners in numbaflash/tuned_configs.json.

``--backward`` times the ``configs.BACKWARD_CANDIDATES`` of each head dim that fit the GPU's
shared memory a CTA (the driver's limit), each first checked against float64 on small problems
(``compare_gradients_with_reference``; a wrong one is not timed), on the same workload, and
stores the winners under ``configs.backward_table_key`` (``sm80bwd/d128/causal``): the forward's
entries are left as they are. TFLOP/s count the backward as 2.5 x the forward's FLOPs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import numpy as np
import torch

from numbaflash import configs, flash_attention, flash_attention_backward
from numbaflash.tools import bench
from numbaflash.tools.reference import compare_gradients_with_reference

# --causal: the maskings to tune
CAUSAL_CHOICES = {"both": (False, True), "full": (False,), "causal": (True,)}


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``), checked: argparse exits on a bad one."""
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
    parser.add_argument("--backward", action="store_true",
                        help="tune the backward (configs.BACKWARD_CANDIDATES, entries sm80bwd/d<head dim>/"
                             "<full|causal>) instead of the forward; every candidate that fits the GPU's "
                             "shared memory a CTA is checked against float64 on small problems first")
    parser.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default="both",
                        help="which masking to tune: both (the default), full only or causal only")
    args = parser.parse_args(argv)
    if args.backward:
        clashes = [flag for flag, given in (("--only", args.only), ("--family sm80", args.family == "sm80"),
                                            ("--key", args.key), ("--short", args.short),
                                            ("--long", args.long)) if given]
        if clashes:
            parser.error(f"--backward has one table entry per head dim and causality "
                         f"(configs.backward_table_key); not with {', '.join(clashes)}")
        unknown = [d for d in args.head_dims if d not in configs.BACKWARD_CANDIDATES]
        if unknown:
            parser.error(f"--backward tunes head dims {tuple(configs.BACKWARD_CANDIDATES)}, got {unknown}")
    if args.short and args.seqlen > configs.SHORT_SEQLEN:
        parser.error(f"--short tunes sequences of at most {configs.SHORT_SEQLEN}, got --seqlen {args.seqlen}")
    if args.long and (args.short or args.seqlen < configs.LONG_SEQLEN):
        parser.error(f"--long tunes sequences of at least {configs.LONG_SEQLEN} (not with --short), "
                     f"got --seqlen {args.seqlen}")
    return args


def tune_forward(args: argparse.Namespace, cap: tuple[int, int], table: dict) -> None:
    """Time the forward candidates of each head dim asked for and put the winners in ``table``."""
    s = args.seqlen
    for d in args.head_dims:
        family = "sm80" if args.family == "sm80" else configs.dispatch_family(cap, d)
        b, h = 65536 // s, 2048 // d
        qkv = [torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3)]
        out = torch.empty_like(qkv[0])
        for causal in CAUSAL_CHOICES[args.causal]:
            key = configs.table_key(args.key or family, d, causal, args.short, args.long)
            forced = configs.table_key(configs.arch_family(cap), d, causal)  # what OVERRIDES reads
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
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
            best = best_of(key, timed, flops)
            configs.OVERRIDES.pop(forced, None)
            if best:
                cand, tf = best
                table[key] = {**configs.config_to_json(cand), "tflops": round(tf, 1)}
                print(f"best {key}: {table[key]}")


# ---------------------------------------------------------------------------- backward

# The backward's FLOPs: 2.5 x the forward's 4 * batch * heads * seqlen^2 * head_dim (half with
# causal masking), FlashAttention's count, as benchmarks/backward_speed.py.
BACKWARD_FLOP_RATIO = 2.5
# The small problems every backward candidate must pass, deterministic or not, before it is timed:
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv). Neither length is a multiple of a tile, the
# heads are grouped (GQA), and the first has more queries than keys (causal: rows that see no key,
# whose dq must be exactly 0), the second fewer.
BACKWARD_CHECK_SHAPES = ((1, 333, 200, 4, 2), (2, 200, 333, 4, 4))


def runnable_backward_candidates(head_dim: int, shared_limit: int,
                                 match: list[str] | tuple[str, ...] = ()) -> tuple[list, list]:
    """``(fit, too_big)``: the ``configs.BACKWARD_CANDIDATES[head_dim]`` whose text contains any of
    ``match`` (all of them without), split by whether their ``shared_bytes`` fit in
    ``shared_limit`` (the device's dynamic shared memory a CTA), in the table's order."""
    cands = [c for c in configs.BACKWARD_CANDIDATES[head_dim] if not match or any(m in str(c) for m in match)]
    fit = [c for c in cands if c.shared_bytes <= shared_limit]
    return fit, [c for c in cands if c not in fit]


def backward_entry(config, tflops: float) -> dict:
    """The tuned table's entry of a backward config (``"kernel": "mma_bwd"`` and its fields, as
    ``configs.config_from_json`` reads them) with its TFLOP/s, as the forward's entries."""
    return {**configs.config_to_json(config), "tflops": round(tflops, 1)}


def record_backward(table: dict, config, causal: bool, tflops: float) -> str:
    """Store ``config`` as the backward winner of its head dim and ``causal`` in ``table``, under
    ``configs.backward_table_key`` (no other entry changes); returns the key."""
    key = configs.backward_table_key(config.head_dim, causal)
    table[key] = backward_entry(config, tflops)
    return key


def best_of(key: str, timed: dict, flops: float):
    """Print each candidate's TFLOP/s (the mean of its rounds' medians) and return ``(config,
    TFLOP/s)`` of the fastest, or None; candidates timed as None (failed or wrong) are left out."""
    best = None
    for cand, runs in timed.items():
        if not runs:
            continue
        tflops = flops / statistics.fmean(runs) / 1e9
        rounds = ", ".join(f"{flops / m / 1e9:.1f}" for m in runs)
        per_round = f"  (rounds: {rounds})" if len(runs) > 1 else ""
        print(f"{key:>19} {tflops:7.1f} TFLOP/s  {cand}{per_round}")
        if best is None or tflops > best[1]:
            best = (cand, tflops)
    return best


def device_shared_limit() -> int:
    """The dynamic shared memory a CTA may opt in to on the current device, from the driver: the
    limit the backward passes configs over by (``operations.backward``)."""
    from numbaflash.runtime import device as gpu_state

    _, ordinal = gpu_state.GPU.current()
    return gpu_state.GPU.shared_limit(ordinal)


def backward_check_problems(head_dim: int, causal: bool) -> list:
    """``BACKWARD_CHECK_SHAPES`` as fp16 problems: per shape, numpy (q, k, v, dout), the same as
    CUDA tensors, and the forward's (out, lse) on them."""
    rng = np.random.default_rng(0)
    problems = []
    for b, sq, sk, hq, hkv in BACKWARD_CHECK_SHAPES:
        q, dout = (rng.standard_normal((b, sq, hq, head_dim)).astype(np.float16) for _ in range(2))
        k, v = (rng.standard_normal((b, sk, hkv, head_dim)).astype(np.float16) for _ in range(2))
        device = [torch.from_numpy(x).cuda() for x in (q, k, v, dout)]
        out, lse = flash_attention(*device[:3], causal=causal, return_lse=True)
        problems.append(((q, k, v, dout), device, out, lse))
    return problems


def check_backward(config, cap: tuple[int, int], causal: bool, problems: list) -> list[str]:
    """What is wrong with ``config``'s gradients on ``problems`` (``backward_check_problems``),
    deterministic or not, by ``compare_gradients_with_reference`` (FlashAttention's criterion
    against float64), into gradients poisoned with NaN; empty when every case passes."""
    wrong = []
    for (q, k, v, dout), (tq, tk, tv, tdout), out, lse in problems:
        for deterministic in (False, True):
            grads = [torch.full_like(x, float("nan")) for x in (tq, tk, tv)]
            with configs.force_config(cap, causal, config):
                flash_attention_backward(tdout, tq, tk, tv, out, lse, causal=causal,
                                         deterministic=deterministic, dq=grads[0], dk=grads[1], dv=grads[2])
            _, problems_found = compare_gradients_with_reference(
                q, k, v, dout, tuple(g.cpu().numpy() for g in grads), causal=causal)
            wrong += [f"(b, sq, sk, hq, hkv)={(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])} "
                      f"deterministic={deterministic}: {p}" for p in problems_found]
    return wrong


def tune_backward(args: argparse.Namespace, cap: tuple[int, int], table: dict) -> None:
    """Time every backward candidate of each head dim asked for that fits the GPU's shared memory
    a CTA and passes the gradient check, on the forward's workload (fp16, batch * seqlen = 64k
    tokens, width 2048; the gradients written into given arrays), and put the winners in
    ``table`` under ``configs.backward_table_key``."""
    limit = device_shared_limit()
    s = args.seqlen
    for d in args.head_dims:
        b, h = max(1, 65536 // s), 2048 // d
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
        grads = [torch.empty_like(x) for x in (q, k, v)]
        cands, too_big = runnable_backward_candidates(d, limit, args.match)
        for causal in CAUSAL_CHOICES[args.causal]:
            key = configs.backward_table_key(d, causal)
            for cand in too_big:
                print(f"{key} {cand}: skipped: needs {cand.shared_bytes} bytes of shared memory a CTA, "
                      f"the GPU allows {limit}")
            flops = BACKWARD_FLOP_RATIO * 4 * b * h * s * s * d / (2 if causal else 1)
            checks = backward_check_problems(d, causal)
            timed: dict = {}
            for cand in cands:  # the check compiles the candidate's kernels too
                try:
                    wrong = check_backward(cand, cap, causal, checks)
                except Exception as exc:  # a candidate that fails to build or launch is skipped
                    print(f"{key} {cand}: failed: {str(exc)[:100]}")
                    timed[cand] = None
                    continue
                if wrong:
                    print(f"{key} {cand}: WRONG, not timed ({len(wrong)} problems): {'; '.join(wrong[:3])}")
                    timed[cand] = None
            out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            backward = functools.partial(flash_attention_backward, dout, q, k, v, out, lse, causal=causal,
                                         dq=grads[0], dk=grads[1], dv=grads[2])
            for r in range(max(1, args.rounds)):
                for cand in cands if r % 2 == 0 else cands[::-1]:
                    if timed.get(cand, []) is None:
                        continue
                    try:
                        with configs.force_config(cap, causal, cand):
                            ms = time_ms(backward, repeats=15 if args.rounds <= 1 else 20,
                                         warmup_ms=0.0 if args.rounds <= 1 else 250.0)
                    except Exception as exc:
                        print(f"{key} {cand}: failed: {str(exc)[:100]}")
                        timed[cand] = None
                        continue
                    timed.setdefault(cand, []).append(ms)
            best = best_of(key, timed, flops)
            if best:
                cand, tf = best
                record_backward(table, cand, causal, tf)
                print(f"best {key}: {table[key]}")


def main() -> None:
    args = parse_args()
    cap = torch.cuda.get_device_capability()
    print("GPU:", torch.cuda.get_device_name(), configs.arch_family(cap), time.strftime("%Y-%m-%d"))
    table = json.loads(configs.TABLE_PATH.read_text()) if configs.TABLE_PATH.is_file() else {}
    if args.backward:
        tune_backward(args, cap, table)
    else:
        tune_forward(args, cap, table)
    print(json.dumps(table, indent=1))
    if args.write:
        configs.TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
