"""A first training step's compiles from an empty cache, with no GPU: the forward's kernel and
the backward's three (prepare, main, dQ), one after the other as before, or with the backward's in
worker processes beside the forward's (``operations.warm``, what a forward whose inputs require
grad starts). ``--gpu``: the step itself on the GPU, torch tensors that require grad (needs torch and
a GPU), with ``NUMBAFLASH_BACKGROUND_COMPILE=0`` (serial) and without.

    python benchmarks/first_step.py                          # sm_90a, d128, causal, bfloat16
    python benchmarks/first_step.py --arch sm_80 --head-dim 64 --full --dtype float16
    python benchmarks/first_step.py --cpus 1                 # as on a machine with one CPU free
    python benchmarks/first_step.py --cpus 1 --workers 1     # ... with a worker all the same (niced)
    python benchmarks/first_step.py --gpu --rounds 2         # the first forward + backward on this GPU

Each mode runs in a fresh process with an empty cache folder of its own; the kernels are those the
API picks for the arch's GPU (``configs.forward_config``, ``operations.backward.backward_specs``).
Prints, per mode, when the forward's kernel was ready (the first forward's compile) and when all
four were (the step); ``--json`` prints the figures as one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("serial", "background")


def child(mode: str, arch: str, head_dim: int, causal: bool, dtype: str, cpus: int | None,
          workers: int | None) -> None:
    """In a fresh process: compile the step's kernels in ``mode``, print one JSON line."""
    if cpus:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cpus]))
    start = time.perf_counter()
    from numbaflash import configs
    from numbaflash.kernels.families import BACKWARD_OPERATIONS, family_of
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.operations import backward, warm
    from numbaflash.runtime import cache
    from numbaflash.runtime.compiler import parse_arch

    cc = parse_arch(arch)
    cap = (cc[0], cc[1])
    config = configs.forward_config(cap, head_dim, causal)
    fwd = kernel_spec(family_of(config).name, "forward", config, dtype, arch, causal=causal)
    _, main = backward.backward_specs(cap, None, head_dim, causal, dtype == "bfloat16")
    bwd = [main.sibling(op) for op in BACKWARD_OPERATIONS]
    if workers:  # as many workers as on a machine with one CPU more
        warm.cpus = lambda: workers + 1
    started = 0
    ready = {}  # operation -> seconds from the start until its kernel was ready
    if mode == "background":
        started = warm.start(bwd, "backward", cache.describe(main))
        for spec in [s for s in bwd if s in warm.PENDING]:
            warm.PENDING[spec].add_done_callback(
                lambda _, op=spec.operation: ready.setdefault(op, time.perf_counter() - start))
    configs.kernel_cubin(fwd)
    ready["forward"] = forward_s = time.perf_counter() - start
    for spec in bwd:
        warm.entry_of(spec)
        ready.setdefault(spec.operation, time.perf_counter() - start)
    print(json.dumps({"mode": mode, "forward_s": forward_s, "step_s": time.perf_counter() - start,
                      "ready": ready, "background": started, "cpus": len(os.sched_getaffinity(0)),
                      "forward": cache.describe(fwd),
                      "backward": cache.describe(main), "foreground_compiles": cache.STATS["compiles"],
                      "cpu_s": time.process_time()}))


def gpu_child(mode: str, head_dim: int, causal: bool, dtype: str) -> None:
    """In a fresh process: one forward + backward on the GPU from an empty cache (the first step),
    then a second; checked against SDPA; print one JSON line."""
    import torch

    import numbaflash
    from numbaflash.runtime import cache

    q, k, v = (torch.randn(2, 1024, 8, head_dim, device="cuda", dtype=getattr(torch, dtype),
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        out = numbaflash.flash_attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        forward_s = time.perf_counter() - start
        q.grad = k.grad = v.grad = None
        out.backward(dout)
        torch.cuda.synchronize()
        times.append((forward_s, time.perf_counter() - start))
    grads = [x.grad.float() for x in (q, k, v)]
    ref_q, ref_k, ref_v = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=causal)
    ref.backward(dout.float().transpose(1, 2))
    error = max((g - r.grad.transpose(1, 2)).abs().max().item()
                for g, r in zip(grads, (ref_q, ref_k, ref_v), strict=True))
    print(json.dumps({"mode": mode, "forward_s": times[0][0], "step_s": times[0][1],
                      "second_step_s": times[1][1], "ready": {}, "background": int(mode == "background"),
                      "cpus": len(os.sched_getaffinity(0)), "forward": torch.cuda.get_device_name(),
                      "backward": f"d{head_dim} {dtype}",
                      "foreground_compiles": cache.STATS["compiles"], "grad_error": error}))


def run_child(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "NUMBAFLASH_CACHE_DIR": folder}
        if not args.gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("NUMBAFLASH_CACHE", None)
        env.pop("NUMBAFLASH_BACKGROUND_COMPILE", None)
        if args.gpu:
            env["NUMBAFLASH_BACKGROUND_COMPILE"] = "0" if mode == "serial" else "1"
        command = [sys.executable, __file__, "--child", mode, "--arch", args.arch, "--head-dim",
                   str(args.head_dim), "--dtype", args.dtype] + (["--full"] if args.full else [])
        command += ["--cpus", str(args.cpus)] if args.cpus else []
        command += ["--workers", str(args.workers)] if args.workers else []
        command += ["--gpu"] if args.gpu else []
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"{mode} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--full", action="store_true", help="not causal")
    p.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    p.add_argument("--cpus", type=int, default=None, help="run each mode on this many CPUs")
    p.add_argument("--workers", type=int, default=None,
                   help="start this many workers whatever the CPUs (default: one fewer than the CPUs)")
    p.add_argument("--rounds", type=int, default=1, help="serial, background, serial, ...")
    p.add_argument("--gpu", action="store_true", help="the step on this GPU (torch), not the compiles alone")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child and args.gpu:
        gpu_child(args.child, args.head_dim, not args.full, args.dtype)
        return 0
    if args.child:
        child(args.child, args.arch, args.head_dim, not args.full, args.dtype, args.cpus, args.workers)
        return 0
    results = [run_child(mode, args) for _ in range(args.rounds) for mode in MODES]
    if args.json:
        print(json.dumps(results))
        return 0
    first = results[0]
    if args.gpu:
        seconds = ", ".join(f"{r['second_step_s']:.4f}" for r in results)
        print(f"first forward + backward step, empty cache, on {first['forward']} ({first['backward']}); "
              f"second steps (s): {seconds}; worst grad "
              f"error against SDPA {max(r['grad_error'] for r in results):.2e}")
    else:
        print(f"first step's compiles, empty cache, no GPU: forward {first['forward']}; "
              f"backward {first['backward']}")
    print(f"{'mode':<12} {'CPUs':>5} {'forward ready s':>16} {'step ready s':>13} {'in workers':>11}  "
          f"each kernel ready at (s)")
    for r in results:
        each = ", ".join(f"{op} {t:.1f}" for op, t in sorted(r["ready"].items(), key=lambda x: x[1]))
        print(f"{r['mode']:<12} {r['cpus']:>5} {r['forward_s']:16.1f} {r['step_s']:13.1f} "
              f"{r['background']:>11}  {each}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
