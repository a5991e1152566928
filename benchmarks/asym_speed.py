"""The forward and backward with V's head dim apart from Q's and K's (issue 56 item 2: (192, 128))
beside SDPA's backends and beside our own d128, in one process (needs a GPU and PyTorch with CUDA).

    python benchmarks/asym_speed.py [--seqlens 4k,16k] [--dtype bf16] [--tokens 65536] [--dims 512/512]

The workload is ``backward_speed.py``'s (batch * seqlen = ``--tokens``, random normal, (batch,
seqlen, heads, head_dim) tensors) with 16 heads. TFLOP/s count 2 * batch * heads * seqlen^2 *
(d_qk + d_v) (halved with causal masking), the issue's count, so the pair and d128 (2 * 128) read on
one scale; the backward counts 2.5x them. Each call is the median of ``--iters`` CUDA-event-timed
calls in ``--rounds`` blocks interleaved with the others' (``backward_speed.interleaved_medians``);
our backward is ``flash_attention_backward`` from the forward's out and LSE, SDPA's through
autograd (``backward_speed.sdpa_backward``). SDPA's backends that refuse the pair print nan. The
issue's bars, each direction: ours >= SDPA's best backend, and >= 0.95x our d128. ``--dims``: the
(d_qk/d_v) pairs, by default every ``ASYMMETRIC_HEAD_DIMS`` pair; 512/512 is head dim 512 (run in
halves of V: its FLOPs are counted at 512 + 512, the work done, not the work the halves repeat).
"""

from __future__ import annotations

import argparse

import torch
from backward_speed import interleaved_medians, sdpa_backward, seqlen
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash
from numbaflash.configs import ASYMMETRIC_HEAD_DIMS

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def calls_for(d: int, dv: int, s: int, causal: bool, dtype: torch.dtype, tokens: int, tag: str) -> dict:
    """"<impl> fwd|bwd <tag>": callable, ours and each SDPA backend that takes the shape."""
    b, h = max(1, tokens // s), 16
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(b, s, h, dv, device="cuda", dtype=dtype)
    dout = torch.randn(b, s, h, dv, device="cuda", dtype=dtype)
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    found = {f"ours fwd {tag}": lambda: numbaflash.flash_attention(q, k, v, causal=causal),
             f"ours bwd {tag}": lambda: numbaflash.flash_attention_backward(dout, q, k, v, out, lse,
                                                                             causal=causal)}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for name, backend in BACKENDS.items():
        def call(backend=backend):
            with sdpa_kernel(backend):
                sdpa(qt, kt, vt, is_causal=causal)
        try:
            call()
            backward = sdpa_backward(backend, q, k, v, dout, causal)[0]
            backward()
            torch.cuda.synchronize()
            found[f"{name} fwd {tag}"] = call
            found[f"{name} bwd {tag}"] = backward
        except RuntimeError:  # this backend does not take the shape
            pass
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="4k,16k")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--iters", type=int, default=21)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dims", default=",".join(f"{d}/{dv}" for d, dv in ASYMMETRIC_HEAD_DIMS))
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"GPU: {torch.cuda.get_device_name()}; numbaflash {numbaflash.__version__}, "
          f"torch {torch.__version__}, {args.dtype}, {args.tokens} tokens, 16 heads")
    print("| d_qk/d_v | seqlen | causal | direction | ours TF/s | cuDNN | flash | efficient "
          "| ours / best SDPA | ours d128 TF/s | ours / ours d128 |")
    print("|--|--:|:--|:--|--:|--:|--:|--:|--:|--:|--:|")
    nan = float("nan")
    for d, dv in (tuple(int(x) for x in pair.split("/")) for pair in args.dims.split(",")):
        for s in (seqlen(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                calls = calls_for(d, dv, s, causal, dtype, args.tokens, "pair")
                calls |= calls_for(128, 128, s, causal, dtype, args.tokens, "d128")
                ms = interleaved_medians(calls, 5, args.iters, args.rounds, 250.0)
                b = max(1, args.tokens // s)
                for direction, factor in (("fwd", 1.0), ("bwd", 2.5)):

                    def tflops(name, dims, ms=ms, b=b, s=s, causal=causal, factor=factor):
                        flops = factor * 2 * b * 16 * s * s * dims / (2 if causal else 1)
                        return flops / ms[name] / 1e9 if name in ms else nan

                    ours = tflops(f"ours {direction} pair", d + dv)
                    sdpa_tf = [tflops(f"{n} {direction} pair", d + dv) for n in BACKENDS]
                    best = max((x for x in sdpa_tf if x == x), default=nan)
                    own = tflops(f"ours {direction} d128", 256)
                    print(f"| {d}/{dv} | {s} | {'yes' if causal else 'no'} | {direction} | {ours:.0f} | "
                          + " | ".join(f"{x:.0f}" for x in sdpa_tf)
                          + f" | {ours / best:.3f} | {own:.0f} | {ours / own:.3f} |", flush=True)


if __name__ == "__main__":
    main()
