"""Two trees' backward side by side: our ``flash_attention_backward`` and SDPA cuDNN's backward (the
in-process yardstick) on the bench workload (bf16, 64k tokens, width 2048), one line a shape; run
once per tree in alternating processes, then ``summary`` tabulates the lines (section BWL).

    git archive HEAD numbaflash ptx | tar x -C /tmp/base          # the tree before the change
    for r in 1 2 3; do
      PYTHONPATH=/tmp/base python lab/backward_ab.py base$r >> ab.txt
      PYTHONPATH=$PWD      python lab/backward_ab.py new$r  >> ab.txt
    done
    python lab/backward_ab.py summary ab.txt
    python lab/backward_ab.py summary ab.txt base pp    # two of several tags (AB_FORCE rounds)

``TAG [SHAPES]``: SHAPES a comma list of head_dim:seqlen:causal (0 or 1), default d64 and d128
at 1k, 4k and 16k, causal and not; a head dim written ``192/128`` is the pair (V's head dim apart:
16 heads, ``benchmarks/asym_speed.py``'s FLOPs); written ``f128`` it times the forward instead
(``flash_attention`` beside cuDNN's forward, 4·B·H·S²·D FLOPs, halved causal; section FA4R).
Each timing is the median of 25 CUDA-event-timed calls after 5 warm-up calls and 250 ms of
settling, two blocks per implementation, interleaved.

``AB_FORCE`` (environment): a config to launch instead of the dispatched one, written as its repr
(``AB_FORCE="WsConfig(128, block_n=128, pingpong=True)"``; ``WsConfig``, ``WsBackwardConfig``,
``ForwardConfig`` and ``BackwardConfig`` are in scope), for causal and non-causal calls alike
(``configs.force_config``): a candidate against the shipped entry in the same rounds (section RSA).
"""

from __future__ import annotations

import collections
import re
import statistics
import sys

SHAPES = ",".join(f"{d}:{s}:{c}" for d in (64, 128) for s in (1024, 4096, 16384) for c in (0, 1))
LINE = re.compile(r"(\S+?)\d? (\S+ \S+ \S+): ours ([\d.]+) TF/s cudnn ([\d.]+) ratio ([\d.]+)")


def timed_ms(torch, fns, calls: int = 25) -> float:
    """Median of ``calls`` CUDA-event-timed calls (``fns`` in turn) after 5 warm-up calls and
    250 ms of them (``tools.bench.time_with_events``)."""
    from numbaflash.tools.bench import Device, time_with_events

    return statistics.median(time_with_events(Device(torch), fns, 5, calls, warmup_ms=250.0))


def measure(tag: str, d: int, s: int, causal: bool, dv: int = 0) -> str:
    """One shape's line: both backwards' TF/s (2.5x the forward's FLOPs) and cuDNN's time over ours.
    ``dv``: V's head dim where it differs (the pair (192, 128): 16 heads, FLOPs 2·B·H·S²·(d + dv),
    as ``benchmarks/asym_speed.py`` counts them)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numbaflash

    b, h = 65536 // s, (16 if dv else 2048 // d)
    dv = dv or d
    torch.manual_seed(1)
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = sdpa(qt, kt, vt, is_causal=causal)
    dot = do.transpose(1, 2)

    def ours():
        numbaflash.flash_attention_backward(do, q, k, v, out, lse, causal=causal)

    def cudnn():
        torch.autograd.grad(o2, (qt, kt, vt), dot, retain_graph=True)

    flops = 2.5 * 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
    name = f"d{d}/{dv}" if dv != d else f"d{d}"
    return line(torch, f"{tag} {name} s{s} {'causal' if causal else 'full'}", flops, ours, cudnn)


def line(torch, label: str, flops: float, ours, cudnn) -> str:
    """``label``'s line: two interleaved blocks of each call, the medians' TF/s and cuDNN's time
    over ours."""
    blocks = [(timed_ms(torch, [ours]), timed_ms(torch, [cudnn])) for _ in range(2)]
    t_ours, t_cudnn = (statistics.median(x[i] for x in blocks) for i in (0, 1))
    return (f"{label}: ours {flops / t_ours / 1e9:.1f} TF/s cudnn {flops / t_cudnn / 1e9:.1f} "
            f"ratio {t_cudnn / t_ours:.4f}")


def measure_forward(tag: str, d: int, s: int, causal: bool) -> str:
    """One shape's line for the forward: both forwards' TF/s and cuDNN's time over ours."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numbaflash

    b, h = 65536 // s, 2048 // d
    torch.manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def ours():
        numbaflash.flash_attention(q, k, v, causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa(qt, kt, vt, is_causal=causal)

    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return line(torch, f"{tag} f{d} s{s} {'causal' if causal else 'full'}", flops, ours, cudnn)


def run(tag: str, shapes: str) -> None:
    import contextlib
    import os

    with contextlib.ExitStack() as forced:
        if os.environ.get("AB_FORCE"):
            import torch

            from numbaflash import configs
            from numbaflash.kernels.shapes import BackwardConfig, ForwardConfig, WsBackwardConfig, WsConfig

            names = {c.__name__: c for c in (WsConfig, WsBackwardConfig, ForwardConfig, BackwardConfig)}
            config = eval(os.environ["AB_FORCE"], names)
            capability = torch.cuda.get_device_capability()  # the table key of this GPU's family
            for causal in (False, True):
                forced.enter_context(configs.force_config(capability, causal, config))
        for shape in shapes.split(","):
            d, s, c = shape.split(":")
            if d.startswith("f"):
                print(measure_forward(tag, int(d[1:]), int(s), c == "1"), flush=True)
            else:
                dqk, _, dv = d.partition("/")
                print(measure(tag, int(dqk), int(s), c == "1", int(dv or 0)), flush=True)


def summary(path: str, pair: tuple[str, str] | None = None) -> None:
    """A markdown row a shape: each tree's TF/s run by run, the ratio of their means, and each
    tree's mean ratio to cuDNN (the yardstick that moves with the clocks). ``pair``: the two tags
    (without their round numbers) to set side by side; by default the first and the last tag."""
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    trees = []
    for line in open(path):
        if m := LINE.match(line):
            rows[m[2]][m[1]].append((float(m[3]), float(m[5])))
            if m[1] not in trees:
                trees.append(m[1])
    a, b = pair or (trees[0], trees[-1])
    print(f"| shape | {a} TF/s | {b} TF/s | {b} / {a} | {a} / cuDNN | {b} / cuDNN |")
    print("|:--|--:|--:|--:|--:|--:|")
    for shape, by in rows.items():
        if not (by[a] and by[b]):  # a shape only one tree ran (AB_FORCE rounds of a few shapes)
            continue
        mean = {t: statistics.mean(x[0] for x in by[t]) for t in (a, b)}
        ratio = {t: statistics.mean(x[1] for x in by[t]) for t in (a, b)}
        runs = {t: " ".join(f"{x[0]:.0f}" for x in by[t]) for t in (a, b)}
        print(f"| {shape} | {runs[a]} | {runs[b]} | {mean[b] / mean[a]:.3f} | {ratio[a]:.3f} "
              f"| {ratio[b]:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) in (3, 5) and sys.argv[1] == "summary":
        summary(sys.argv[2], tuple(sys.argv[3:5]) or None)
    elif len(sys.argv) in (2, 3):
        run(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else SHAPES)
    else:
        sys.exit(__doc__)
