"""First-call times of numbaflash beside FlashAttention-4's JIT (issue 55 point 4), each in a fresh
process on the GPU host: numbaflash from an empty kernel cache (a new ``NUMBAFLASH_CACHE_DIR``), FA4
with its disk cache off (its default), both after their imports and a CUDA context.

    python lab/jit_beside_fa4.py [--shapes 128:1,128:0,64:1] [--seqlen 1024]

Each (implementation, head dim, causal) runs twice in its own process, bf16, (2, seqlen, 16,
head_dim) random inputs:
- ``forward``: the first ``flash_attention`` / ``flash_attn_func`` call with inputs that need no
  grad, to its result on the GPU (synchronised), less a later call's time: the compile of the
  forward's kernel and its loading;
- ``step``: a first forward + backward with inputs that require grad (numbaflash starts the
  backward's compiles in worker processes at that first forward, ``prepare_backward``), less a
  later step's time.
``import`` is the library's import time in that process. FA4 needs ``flash-attn-4`` importable
(``../shared/device/prepare-fa4.sh``). Seconds; a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(impl: str, mode: str, d: int, causal: bool, seqlen: int) -> None:
    import torch

    q, k, v = (torch.randn(2, seqlen, 16, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if impl == "ours":
        import numbaflash

        def attend(q, k, v):
            return numbaflash.flash_attention(q, k, v, causal=causal)
    else:
        from flash_attn.cute import flash_attn_func

        def attend(q, k, v):
            return flash_attn_func(q, k, v, causal=causal)[0]
    imported = time.perf_counter() - t0

    def once():
        if mode == "forward":
            attend(q, k, v)
        else:
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            attend(qg, kg, vg).backward(torch.ones_like(q))
        torch.cuda.synchronize()

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"impl": impl, "mode": mode, "d": d, "causal": causal, "import": imported,
                      "first": times[0], "later": min(times[1:])}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="128:1,128:0,64:1", help="head_dim:causal, comma separated")
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--child", nargs=4, metavar=("IMPL", "MODE", "D", "CAUSAL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        impl, mode, d, causal = args.child
        child(impl, mode, int(d), causal == "1", args.seqlen)
        return
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}; CPUs: {os.cpu_count()}")
    rows = []
    for shape in args.shapes.split(","):
        d, causal = shape.split(":")
        for mode in ("forward", "step"):
            for impl in ("ours", "fa4"):
                env = dict(os.environ, NUMBAFLASH_CACHE_DIR=tempfile.mkdtemp(prefix="nfjit"))
                command = [sys.executable, __file__, "--seqlen", str(args.seqlen), "--child", impl, mode, d,
                           causal]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                line = [x for x in done.stdout.splitlines() if x.startswith("{")]
                if done.returncode or not line:
                    print(f"{impl} {mode} d{d} causal={causal}: failed\n{done.stderr[-2000:]}", flush=True)
                    continue
                rows.append(json.loads(line[-1]))
                print(line[-1], flush=True)
    print("| d | causal | mode | ours import | ours first - later | FA4 import | FA4 first - later |")
    print("|--:|:--|:--|--:|--:|--:|--:|")
    keyed = {(r["impl"], r["mode"], r["d"], r["causal"]): r for r in rows}
    for shape in args.shapes.split(","):
        d, causal = int(shape.split(":")[0]), shape.split(":")[1] == "1"
        for mode in ("forward", "step"):
            cells = []
            for impl in ("ours", "fa4"):
                r = keyed.get((impl, mode, d, causal))
                cells += ([f"{r['import']:.2f}", f"{r['first'] - r['later']:.2f}"] if r else ["-", "-"])
            print(f"| {d} | {'yes' if causal else 'no'} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
