"""The warp-specialised Hopper kernel (``kernels/forward_ws.py``) on a GPU, in one command:

    python lab/ws_check.py precompile          # every variant, in parallel processes
    python lab/ws_check.py correct             # ragged/GQA/bf16/LSE/strided vs float64
    python lab/ws_check.py sanitize [--tools memcheck,racecheck,synccheck]
    python lab/ws_check.py bench [--shapes 128:4096:0,...]

Variants (the one-GEMM-at-a-time ``serial`` path was removed from the kernel in issue 32; it
never won: notebook W8): ``ovl`` (S_{j+1} issued with PV_j, softmax while PV is in flight),
``pp`` (ovl + ping-pong between the consumer warpgroups), for d64 and d128;
``c3`` has three consumer warpgroups (192 query rows, d64);
d96 (64B swizzle), d256 (128 x 80 or 128 x 64 tiles, O staged in the Q buffer) and d128 at
128 x 176 (O staged in the Q buffer) likewise.
``correct`` poisons O and LSE (NaN) before each launch, runs each case on a full grid and on
a 2-CTA grid (many tiles per CTA: the rings wrap, phases flip), and checks that repeated runs
are bit-identical. ``bench`` times against SDPA cuDNN in the same
process (median of CUDA-event-timed calls after >= 250 ms of warm-up, inputs rotated over
more than 3x the L2 cache). Each mode prints a short table last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numbaflash.kernels.shapes import WsConfig  # noqa: E402


def variants() -> dict[str, WsConfig]:
    out = {}
    for d, stages in ((64, 3), (128, 2)):
        out[f"d{d}-ovl"] = WsConfig(d, 128, stages)
        out[f"d{d}-pp"] = WsConfig(d, 128, stages, pingpong=True)
    out["d128-ovl-q1"] = WsConfig(128, 128, 2, q_stages=1)  # one Q buffer: before
    out["d64-ovl-n192"] = WsConfig(64, 192, 2)
    out["d64-pp-n192"] = WsConfig(64, 192, 2, pingpong=True)
    out["d64-c3-ovl"] = WsConfig(64, 128, 2, consumers=3)  # 192 rows, 3 consumers
    out["d64-c3-pp"] = WsConfig(64, 128, 2, consumers=3, pingpong=True)
    out["d64-c3-pp-s3"] = WsConfig(64, 128, 3, consumers=3, pingpong=True)
    for name, pp in (("ovl", False), ("pp", True)):  # d128, 128 x 176: one Q buffer, O staged in V
        out[f"d128-{name}-n176"] = WsConfig(128, 176, 2, pingpong=pp, q_stages=1, o_in_v=True)
        out[f"d128-{name}-n176-oq"] = WsConfig(128, 176, 2, pingpong=pp, q_stages=1,
                                               o_in_q=True)
    out["d128-ovl-s3-ov"] = WsConfig(128, 128, 3, q_stages=1, o_in_v=True)
    out["d128-pp-s3-ov"] = WsConfig(128, 128, 3, pingpong=True, q_stages=1, o_in_v=True)
    for n in (128, 192):  # d96: 32-column blocks of 64-byte rows
        out[f"d96-ovl-n{n}"] = WsConfig(96, n, 2)
        out[f"d96-pp-n{n}"] = WsConfig(96, n, 2, pingpong=True)
    for n in (80, 64):  # d256: one Q buffer, which also stages O
        out[f"d256-ovl-n{n}"] = WsConfig(256, n, 2, q_stages=1, o_in_q=True)
        out[f"d256-pp-n{n}"] = WsConfig(256, n, 2, pingpong=True, q_stages=1, o_in_q=True)
    return out


def _compile_one(job):
    config, causal, bf16 = job
    t = time.time()
    from numbaflash.tools.ws_launch import ws_cubin

    ws_cubin(config, causal, bf16)
    return f"{config} causal={causal} bf16={bf16}: {time.time() - t:.1f} s"


def precompile(args) -> int:
    flags = [(causal, bf16) for causal in (False, True) for bf16 in (False, True)]
    chosen = [c for n, c in variants().items() if not args.variants or n in args.variants.split(",")]
    jobs = [(c, causal, bf16) for c in chosen for causal, bf16 in flags]
    t = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for line in pool.map(_compile_one, jobs):
            print(line, flush=True)
    print(f"precompiled {len(jobs)} kernels in {time.time() - t:.1f} s")
    return 0


# --------------------------------------------------------------------------- correctness

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [
    (2, 1, 37, 4, 2),
    (1, 37, 37, 2, 2),
    (2, 200, 1000, 4, 1),
    (1, 1000, 200, 2, 2),
    (1, 1000, 1000, 2, 1),
    (2, 333, 77, 3, 3),
    (1, 513, 513, 4, 2),
    (1, 130, 129, 2, 1),
]


def _inputs(torch, shape, d, dtype, strided, seed):
    b, sq, sk, hq, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    if strided:  # q from a packed qkv-like buffer, k and v with padded heads
        q = torch.randn(b, sq, 3, hq, d, device="cuda", generator=g).to(dtype)[:, :, 1]
        k = torch.randn(b, sk, hkv + 1, d, device="cuda", generator=g).to(dtype)[:, :, 1:]
        v = torch.randn(b, sk, hkv, 2 * d, device="cuda", generator=g).to(dtype)[..., d:]
    else:
        q = torch.randn(b, sq, hq, d, device="cuda", generator=g).to(dtype)
        k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dtype)
        v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def _to_numpy(torch, t):
    import ml_dtypes
    import numpy as np

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().cpu().numpy().astype(np.float16)


def run_case(torch, config, shape, causal, dtype, strided, seed, grid=None):
    """(problems, outputs) of one launch with poisoned O and LSE."""
    from numbaflash.tools.ws_launch import flash_attention_ws

    q, k, v = _inputs(torch, shape, config.head_dim, dtype, strided, seed)
    b, sq, sk, hq, hkv = shape
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda")
    flash_attention_ws(q, k, v, causal=causal, return_lse=True, out=out, lse=lse, config=config, grid=grid)
    torch.cuda.synchronize()
    return (q, k, v), out, lse


def correct(args) -> int:
    import torch

    from numbaflash.tools.reference import compare_with_reference

    chosen = {n: c for n, c in variants().items() if not args.variants or n in args.variants.split(",")}
    failures, rows = 0, []
    for name, config in chosen.items():
        worst, cases, bad = 0.0, 0, []
        t0 = time.time()
        for si, shape in enumerate(SHAPES):
            for causal in (False, True):
                for dtype in (torch.float16, torch.bfloat16):
                    if dtype == torch.bfloat16 and si % 2:
                        continue
                    strided = si % 3 == 1
                    seed = 1000 * si + 10 * causal + (dtype == torch.bfloat16)
                    (q, k, v), out, lse = run_case(torch, config, shape, causal, dtype, strided, seed)
                    _, out2, lse2 = run_case(torch, config, shape, causal, dtype, strided, seed, grid=2)
                    qn, kn, vn = (_to_numpy(torch, x) for x in (q, k, v))
                    ratio, problems = compare_with_reference(qn, kn, vn, out.float().cpu().numpy(),
                                                             lse.cpu().numpy(), causal=causal)
                    same = torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(
                        lse.view(torch.int32), lse2.view(torch.int32))
                    if not same:
                        problems.append("grid=2 result differs bitwise from the full grid")
                    cases += 1
                    worst = max(worst, ratio if math.isfinite(ratio) else 99.0)
                    if problems:
                        bad.append(f"{shape} causal={causal} {dtype} strided={strided}: {problems}")
                    print(f"{name} {shape} causal={causal} {str(dtype)[6:]} strided={strided} "
                          f"ratio={ratio:.3f} {'OK' if not problems else problems}", flush=True)
        failures += len(bad)
        rows.append((name, cases, len(bad), worst, time.time() - t0))
        for line in bad[:5]:
            print("FAIL", name, line)
    print("\n| variant | cases | failed | worst error ratio (<= 1 passes) | s |")
    print("|---|--:|--:|--:|--:|")
    for name, cases, bad, worst, secs in rows:
        print(f"| {name} | {cases} | {bad} | {worst:.3f} | {secs:.0f} |")
    return 1 if failures else 0


# --------------------------------------------------------------------------- sanitizer

SANITIZE_SHAPES = [((1, 37, 37, 2, 1), False), ((1, 37, 37, 2, 1), True), ((1, 200, 77, 2, 2), True),
                   ((2, 130, 300, 2, 1), True), ((1, 1, 130, 2, 2), False),
                   ((1, 500, 60, 2, 1), True)]  # 2 fully masked 192-row blocks


def sanitize_worker(args) -> int:
    import torch

    from numbaflash.tools.reference import compare_with_reference

    config = variants()[args.variant]
    bad = 0
    for i, (shape, causal) in enumerate(SANITIZE_SHAPES):
        for dtype in (torch.float16, torch.bfloat16):
            for grid in (None, 2):
                (q, k, v), out, lse = run_case(torch, config, shape, causal, dtype, i % 2 == 1, 7 + i, grid)
                qn, kn, vn = (_to_numpy(torch, x) for x in (q, k, v))
                _, problems = compare_with_reference(qn, kn, vn, out.float().cpu().numpy(), lse.cpu().numpy(),
                                                     causal=causal)
                if problems:
                    bad += 1
                    print("WRONG", shape, causal, dtype, grid, problems, flush=True)
    print("worker done:", args.variant, "wrong:", bad, flush=True)
    return 3 if bad else 0


def sanitize(args) -> int:
    import re

    tools = args.tools.split(",")
    names = (args.variants.split(",") if args.variants
             else ["d64-ovl", "d64-pp-n192", "d128-ovl", "d128-pp"])
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for tool in tools:
            for name in names:
                # cuda.core's module load probes driver entry points with cuGetProcAddress, which
                # memcheck reports as host API errors (34 per process here): count kernel errors only.
                cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1",
                       "--report-api-errors", "no"]
                if tool == "racecheck":
                    cmd += ["--racecheck-report", "all"]
                cmd += [sys.executable, str(Path(__file__).resolve()), "sanitize-worker", "--variant", name]
                jobs[(tool, name)] = pool.submit(subprocess.run, cmd, capture_output=True, text=True,
                                                 timeout=args.timeout)
        results = {}
        for key, fut in jobs.items():
            try:
                proc = fut.result()
                text = proc.stdout + proc.stderr
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                text, rc = "TIMEOUT", None
            (out_dir / f"san_{key[0]}_{key[1]}.log").write_text(text)
            summary = re.findall(r"ERROR SUMMARY: (\d+)", text)
            race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?",
                              text)
            done = "worker done:" in text
            if race:
                cell = f"{sum(int(r[1]) for r in race)} err, {sum(int(r[2]) for r in race)} warn"
            elif summary:
                cell = f"{sum(int(s) for s in summary)} err"
            else:
                cell = "no summary"
            if rc is None:
                cell = "TIMEOUT"
            elif not done:
                cell += f" (worker did not finish, rc={rc})"
            elif "WRONG" in text:
                cell += " WRONG"
            results[key] = cell
    print("\n| variant | " + " | ".join(tools) + " |")
    print("|---|" + "--:|" * len(tools))
    for name in names:
        print(f"| {name} | " + " | ".join(results[(t, name)] for t in tools) + " |")
    return 0


# --------------------------------------------------------------------------- timing


def bench(args) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from numbaflash.tools.ws_launch import flash_attention_ws

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    names = args.variants.split(",") if args.variants else None
    rows = []
    for spec in args.shapes.split(","):
        d, s, causal = spec.split(":")
        d, s, causal = int(d), int(s), causal == "1"
        b, h = 65536 // s, 2048 // d
        set_bytes = 4 * b * s * h * d * 2
        n_sets = max(2, math.ceil(3 * l2 / set_bytes))
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        sets = [[torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3)]
                for _ in range(n_sets)]
        outs = [torch.empty_like(x[0]) for x in sets]
        tsets = [[y.transpose(1, 2) for y in x] for x in sets]
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        impls = {}

        def cudnn(i, causal=causal, tsets=tsets):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*tsets[i], is_causal=causal)

        impls["cudnn"] = cudnn

        for name, config in variants().items():
            if config.head_dim != d or (names and name not in names):
                continue
            impls[name] = lambda i, config=config, causal=causal, sets=sets, outs=outs: flash_attention_ws(
                *sets[i], causal=causal, out=outs[i], config=config)
        ref = cudnn(0).transpose(1, 2)
        result = {}
        for name, fn in impls.items():
            try:
                ms = median_ms(torch, fn, n_sets)
                err = float((fn(0).float() - ref.float()).abs().max()) if name != "cudnn" else 0.0
                result[name] = (flops / ms / 1e9, err)
            except Exception as exc:  # report and go on
                result[name] = (float("nan"), float("nan"))
                print(f"{name} d{d} s{s} causal={causal}: {type(exc).__name__}: {exc}", flush=True)
            print(f"d{d} s{s} causal={causal} {name}: {result[name][0]:.1f} TFLOP/s, max diff vs cuDNN "
                  f"{result[name][1]:.1e}", flush=True)
        rows.append((d, s, causal, result))
        del sets, outs, tsets
        torch.cuda.empty_cache()
    names = list(dict.fromkeys(n for row in rows for n in row[3]))
    print(f"\nGPU: {torch.cuda.get_device_name()}; {args.dtype}, TFLOP/s (ratio to cuDNN)")
    print("| d | seqlen | causal | " + " | ".join(names) + " |")
    print("|--:|--:|:--|" + "--:|" * len(names))
    for d, s, causal, result in rows:
        base = result["cudnn"][0]
        cells = [f"{result[n][0]:.0f}" + (f" ({result[n][0] / base:.2f})" if n != "cudnn" else "")
                 if n in result else "-" for n in names]
        print(f"| {d} | {s} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
    return 0


DEFAULT_SHAPES = "128:4096:0,128:4096:1,128:16384:0,128:1024:0,64:4096:0,64:4096:1"


def median_ms(torch, fn, n_sets, warmup_ms=250.0, repeats=40):
    """Median of event-timed calls after >= warmup_ms of calls, rotating over the input sets."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    i = 0
    while (time.perf_counter() - start) * 1e3 < warmup_ms or i < 5:
        fn(i % n_sets)
        i += 1
        if i % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for r, (a, b) in enumerate(events):
        a.record()
        fn(r % n_sets)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("precompile", "correct", "sanitize", "sanitize-worker", "bench"))
    parser.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    parser.add_argument("--variant", default="d128-pp")
    parser.add_argument("--tools", default="memcheck,racecheck,synccheck")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="bench inputs")
    args = parser.parse_args(argv)
    mode = {"precompile": precompile, "correct": correct, "sanitize": sanitize,
            "sanitize-worker": sanitize_worker, "bench": bench}[args.mode]
    return mode(args)


if __name__ == "__main__":
    sys.exit(main())
