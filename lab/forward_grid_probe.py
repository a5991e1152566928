"""The Hopper forward's grid, persistent against one CTA a query block (FlashAttention-4's
non-persistent grid), with no kernel change: ``tools.ws_launch.flash_attention_ws`` with its
``grid`` knob, beside the dispatched call and SDPA cuDNN (issue 55 point 3; notebook BWL's
next item, FA4SBS's third finding: FA4 reads 23% fewer L2 bytes from a grid in launch order).

    python lab/forward_grid_probe.py [--shapes 128:4096:0,128:16384:0,...] [--rounds 3]

Each shape (bf16, 64k tokens, width 2048: batch = 65536 / seqlen, heads = 2048 / head_dim):
TFLOP/s of the dispatched ``flash_attention`` (persistent, one CTA an SM), of the same config
through ``flash_attention_ws`` with the default grid (a check that the two paths time alike) and
with one CTA a work unit (a query block, or causal a pair of them; a grid that undercounts the
units stays correct: a CTA then walks two), and of SDPA cuDNN; medians of 25 CUDA-event-timed
calls after 250 ms of settling, ``--rounds`` interleaved blocks, inputs rotated over three sets
(more than the L2).
"""

from __future__ import annotations

import argparse
import statistics

from backward_ab import timed_ms  # (lab/, this script's folder, is first on sys.path)


def measure(d: int, s: int, causal: bool, rounds: int) -> str:
    """One shape's table row."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numbaflash
    from numbaflash.configs import forward_config
    from numbaflash.tools.ws_launch import flash_attention_ws

    b, h = 65536 // s, 2048 // d
    sets = [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            for _ in range(3)]
    outs = [torch.empty_like(x[0]) for x in sets]
    config = forward_config((9, 0), d, causal, seqlen=s)
    sdpa_sets = [[x.transpose(1, 2) for x in qkv] for qkv in sets]

    def cudnn(i):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa(*sdpa_sets[i], is_causal=causal)

    def ws(i, grid):
        flash_attention_ws(*sets[i], causal=causal, out=outs[i], config=config, grid=grid)

    blocks = -(-s // config.block_m)
    units = ((blocks + 1) // 2 if causal else blocks) * h * b  # the kernel's work units (blocks.work_units)

    calls = {
        "dispatched": [lambda i=i: numbaflash.flash_attention(*sets[i], causal=causal, out=outs[i])
                       for i in range(3)],
        "default": [lambda i=i: ws(i, None) for i in range(3)],
        "unit": [lambda i=i: ws(i, units) for i in range(3)],
        "cudnn": [lambda i=i: cudnn(i) for i in range(3)],
    }
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, fns in calls.items():
            times[k].append(timed_ms(torch, fns))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    tf = {k: flops / statistics.median(v) / 1e9 for k, v in times.items()}
    return (f"| {d} | {s} | {'yes' if causal else 'no'} | {config} | {tf['dispatched']:.0f} | "
            f"{tf['default']:.0f} | {tf['unit']:.0f} | {tf['cudnn']:.0f} | "
            f"{tf['unit'] / tf['dispatched']:.3f} |")


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:4096:0,64:16384:0")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}")
    print("| d | seqlen | causal | config | dispatched | ws, default grid | ws, a CTA a unit | cuDNN "
          "| a CTA a unit / dispatched |")
    print("|--:|--:|:--|:--|--:|--:|--:|--:|--:|")
    for shape in args.shapes.split(","):
        d, s, c = (int(x) for x in shape.split(":"))
        print(measure(d, s, bool(c), args.rounds), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
