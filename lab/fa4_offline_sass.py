"""FlashAttention-4's sm90 kernels compiled with no GPU, and their step loops beside ours.

FA4 (`flash-attn-4`, the CuTe-DSL FlashAttention) cross-compiles: under torch's FakeTensorMode its
interface builds the kernels without running them, for the target in ``CUTE_DSL_ARCH``, with the SM
count from ``FLASH_ATTENTION_NUM_SMS``, and ``CUTE_DSL_KEEP=ptx,cubin`` keeps what it built. On this
2-core machine a forward compiles in 1.0-1.7 s and a backward (its three kernels) in 1.5-1.8 s.

Setup, once (Python 3.11: the CPU torch wheel on this machine's disk; FA4's own wheels from
``../shared/device/prepare-fa4.sh``'s ``.fa4b``; the DSL from PyPI)::

    PYENV_VERSION=3.11.7 python3.11 -m venv /tmp/fa4v
    /tmp/fa4v/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/fa4v/bin/pip install "nvidia-cutlass-dsl[cu13]==4.8.1" apache-tvm-ffi==0.1.15.post2 einops triton
    /tmp/fa4v/bin/pip install --no-deps .fa4b/flash_attn_4-*.whl .fa4b/quack_kernels-*.whl

Then::

    /tmp/fa4v/bin/python lab/fa4_offline_sass.py dump 128 4096 1 [--out /tmp/fa4dump]  # d seqlen causal
    /tmp/fa4v/bin/python lab/fa4_offline_sass.py dump 192/128 4096 0  # V's head dim apart
    python lab/fa4_offline_sass.py loops /tmp/fa4dump/d128_s4096_c1/*bwd_sm90*.cubin
    python lab/fa4_offline_sass.py ours backward 128 1 [--sass /tmp/ours.sass]  # ours, the same summary
    python lab/fa4_offline_sass.py ours forward 128 0 --config "WsConfig(128, pingpong=True)"  # a candidate

``dump`` compiles FA4's forward and backward (bf16, 64k tokens, width 2048: the bench workload's
shapes) into ``OUT/d{d}_s{seqlen}_c{causal}``. ``loops`` and ``ours`` (run where numbaflash and a
CUDA toolchain with cuobjdump are importable: ``numbaflash.tools.inspect.find_tool``) print each
loop of the kernel that holds 16 or more HGMMA: its static length and opcode counts, and the
order of its tensor-core, wait, barrier, shared-memory and exponential instructions.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys


def dump(d: int, seqlen: int, causal: bool, out: str, dv: int | None = None) -> None:
    """FA4's forward and backward for (d, seqlen, causal), cubins and PTX into ``out``/...; ``dv``:
    V's head dim where it differs from Q's and K's (``dump 192/128 ...``: 16 heads, as asym_speed)."""
    folder = f"{out}/d{d}{f'v{dv}' if dv else ''}_s{seqlen}_c{int(causal)}"
    os.makedirs(folder, exist_ok=True)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = folder
    import time

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # what the interface dispatches on
    from flash_attn.cute import interface

    batch, heads = max(1, 65536 // seqlen), (16 if dv else 2048 // d)
    with FakeTensorMode(allow_non_fake_inputs=True):
        shape = (batch, seqlen, heads, d)
        q, k = (torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        v = torch.empty((*shape[:3], dv or d), dtype=torch.bfloat16, device="cuda")
        start = time.perf_counter()
        out_, lse = interface.flash_attn_func(q, k, v, causal=causal, return_lse=True)[:2]
        middle = time.perf_counter()
        interface._flash_attn_bwd(q, k, v, out_, torch.empty_like(out_), lse, None, causal)
        end = time.perf_counter()
    print(f"{folder}: forward {middle - start:.2f} s, backward {end - middle:.2f} s")


def sass_of(cubin: str) -> str:
    from numbaflash.tools.inspect import find_tool

    command = [find_tool("cuobjdump"), "-sass", cubin]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


ORDER = ("HGMMA", "WARPGROUP", "MUFU", "BAR", "SYNCS", "FENCE", "MEMBAR", "STSM", "STS", "LDS", "LDGSTS",
         "REDG", "UBLKRED", "DEPBAR")


def loops(sass: str) -> None:
    """Print every loop (a backward branch) holding 16 or more HGMMA."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip(), m.group(3), m.group(4).strip()))
    at = {a: i for i, (a, *_) in enumerate(ins)}
    for i, (a, pred, op, args) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if not target or int(target.group(1), 16) >= a or int(target.group(1), 16) not in at:
            continue
        body = ins[at[int(target.group(1), 16)]:i + 1]
        if sum(x[2].startswith("HGMMA") for x in body) < 16:
            continue
        counts = collections.Counter(x[2].split(".")[0] for x in body if not x[1].startswith("@!PT"))
        print(f"loop {body[0][0]:#x}-{a:#x}: {sum(counts.values())} instructions")
        print("  " + ", ".join(f"{k} {v}" for k, v in counts.most_common(40)))
        runs, last = [], None
        for _, pred, op, _ in body:
            base = op.split(".")[0]
            if pred.startswith("@!PT") or base not in ORDER:
                continue
            tag = base if base in ("HGMMA", "MUFU", "LDS", "STS", "STSM", "REDG") else op
            if runs and tag == last:
                runs[-1][1] += 1
            else:
                runs.append([tag, 1])
            last = tag
        print("  order: " + " | ".join(f"{t} x{n}" if n > 1 else t for t, n in runs))


def ours(operation: str, d: int, causal: bool, config_text: str | None = None) -> str:
    """The SASS of our shipped Hopper build (``operation`` forward or backward, bf16, sm_90a), or of
    ``config_text`` (a config's repr, e.g. ``"WsConfig(128, pingpong=True)"``: a candidate)."""
    from numbaflash import configs
    from numbaflash.kernels.families import spec_of
    from numbaflash.kernels.shapes import WsBackwardConfig, WsConfig

    if config_text:
        config = eval(config_text, {"WsConfig": WsConfig, "WsBackwardConfig": WsBackwardConfig})
    else:
        config = (configs.BACKWARD_WS_DEFAULTS[d][0] if operation == "backward"
                  else configs.forward_config((9, 0), d, causal, seqlen=4096))
    entry = configs.kernel_cubin(spec_of(config, operation, True, "sm_90a", causal=causal))
    path = f"/tmp/ours_{operation}_d{d}_c{int(causal)}.cubin"
    with open(path, "wb") as f:
        f.write(entry.cubin)
    return sass_of(path)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["dump"]:
        out = args[args.index("--out") + 1] if "--out" in args else "/tmp/fa4dump"
        d, _, dv = args[1].partition("/")
        dump(int(d), int(args[2]), args[3] == "1", out, int(dv) if dv else None)
    elif args[:1] == ["loops"]:
        for path in args[1:]:
            print(path)
            loops(sass_of(path))
    elif args[:1] == ["ours"]:
        text = ours(args[1], int(args[2]), args[3] == "1",
                    args[args.index("--config") + 1] if "--config" in args else None)
        if "--sass" in args:
            with open(args[args.index("--sass") + 1], "w") as f:
                f.write(text)
        loops(text)
    else:
        sys.exit(__doc__)
