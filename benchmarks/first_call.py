"""First-call cost in a new process, with the on-disk kernel cache (issue 10).

    python benchmarks/first_call.py            # needs a GPU and torch

1. Fresh processes, one after the other, share an empty cache folder. Each times its first
   ``flash_attention`` call (fp16, d128, causal, inputs already on the GPU): the first compiles and
   stores the kernel, the next three should only load it (the fastest is reported: load on
   the machine only adds time). "import s" is ``import numbaflash`` alone.
2. ``python -m numbaflash.precompile --arch <this GPU>`` runs with no GPU visible
   (``CUDA_VISIBLE_DEVICES=``) into another empty folder; then one GPU process calls every
   shipped (head dim, causal, dtype) combination and counts its compiles (should be 0).

Each call's output is checked against PyTorch SDPA. Prints a table; ``--json`` prints the
figures as one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WARM_PROCESSES = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(mode: str) -> None:
    """Runs in a fresh process: time first calls, count compiles, print one JSON line."""
    import torch

    start = time.perf_counter()
    import numbaflash
    from numbaflash.runtime import cache

    import_s = time.perf_counter() - start  # numbaflash alone (torch is the caller's)
    combos = [(128, True, torch.float16)]
    if mode == "all":
        dtypes = (torch.float16, torch.bfloat16)
        combos = [(d, c, t) for d in (64, 128) for c in (False, True) for t in dtypes]
    first_calls, second_calls, worst_error = [], [], 0.0
    for head_dim, causal, dtype in combos:
        q, k, v = (torch.randn(2, 1024, 8, head_dim, device="cuda", dtype=dtype) for _ in range(3))
        torch.cuda.synchronize()
        for times in (first_calls, second_calls):
            t = time.perf_counter()
            out = numbaflash.flash_attention(q, k, v, causal=causal)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal).transpose(1, 2)
        worst_error = max(worst_error, (out.float() - ref).abs().max().item())
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "import_s": import_s, "first_call_s": first_calls[0],
        "max_first_call_s": max(first_calls), "second_call_s": second_calls[0], "calls": len(combos),
        "compiles": cache.STATS["compiles"], "hits": cache.STATS["hits"], "worst_error": worst_error,
        "numba_imported": "numba" in sys.modules,
    }))


def run_child(mode: str, cache_dir: str) -> dict:
    env = {**os.environ, "NUMBAFLASH_CACHE_DIR": cache_dir}
    env.pop("NUMBAFLASH_CACHE", None)
    done = subprocess.run([sys.executable, __file__, "--child", mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"child {mode} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure() -> dict:
    import torch

    from numbaflash.runtime.compiler import arch_of

    arch = arch_of(torch.cuda.get_device_capability())
    with tempfile.TemporaryDirectory() as shared, tempfile.TemporaryDirectory() as pre:
        cold = run_child("call", shared)
        # The next processes only load. Each is a fresh process; on a busy machine (the GPU
        # check runs the sanitizer beside the tests) CPU contention only adds time, so the
        # fastest of three is the figure of the code.
        warm_runs = [run_child("call", shared) for _ in range(WARM_PROCESSES)]
        warm = min(warm_runs, key=lambda x: x["first_call_s"])
        warm["all_first_call_s"] = [x["first_call_s"] for x in warm_runs]
        env = {**os.environ, "NUMBAFLASH_CACHE_DIR": pre, "CUDA_VISIBLE_DEVICES": ""}
        env.pop("NUMBAFLASH_CACHE", None)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "numbaflash.precompile", "--arch", arch], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if done.returncode:
            raise RuntimeError(f"precompile failed:\n{done.stderr}")
        precompile_s = time.perf_counter() - start
        after = run_child("all", pre)
    return {"arch": arch, "cold": cold, "warm": warm, "precompile_s": precompile_s,
            "precompile_out": done.stdout.strip(), "after_precompile": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", choices=["call", "all"], help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    if args.child:
        child(args.child)
        return 0
    r = measure()
    if args.json:
        print(json.dumps(r))
        return 0
    cold, warm, after = r["cold"], r["warm"], r["after_precompile"]
    print(f"GPU: {cold['gpu']} ({r['arch']}); first flash_attention call in a new process, inputs on the GPU")
    print(f"{'process':<44} {'import s':>9} {'1st call s':>11} {'2nd call ms':>12} {'compiles':>9}")
    for name, x in (("1: empty cache", cold), ("2: same cache, next process (best of 3)", warm),
                    (f"3: after precompile ({after['calls']} kernels)", after)):
        print(f"{name:<44} {x['import_s']:9.3f} {x['max_first_call_s']:11.3f} "
              f"{1000 * x['second_call_s']:12.3f} {x['compiles']:9d}")
    print("next processes' first calls (s): " + ", ".join(f"{t:.3f}" for t in warm["all_first_call_s"]))
    print(f"precompile with CUDA_VISIBLE_DEVICES='': {r['precompile_s']:.1f} s ({r['precompile_out']})")
    print(f"worst |out - SDPA|: {max(cold['worst_error'], warm['worst_error'], after['worst_error']):.2e}; "
          f"Numba imported on the cache-hit path: {warm['numba_imported']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
