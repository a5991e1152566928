"""The e4m3 (FP8) Hopper forward against our bf16 forward, in one process (issue 60).

Shapes of record: 64k tokens (batch x seqlen), model width 2048 (heads = 2048 / head dim),
random N(0, 1) inputs quantized by ``numbaflash.fp8.quantize`` (descales per (batch, head)).
Times are medians of CUDA-event-timed calls after a warm-up; FLOPs 4·B·H·S²·D, halved for
causal. Columns: bf16 TFLOP/s; FP8 TFLOP/s of the whole call (V's transposition included);
FP8 TFLOP/s of the attention kernel alone (the call less the V prep, timed apart); the prep's
time; the ratios to bf16.

    python benchmarks/fp8_speed.py [--shapes 128:4096,128:16384,64:16384,256:16384,128:1024]
    python benchmarks/fp8_speed.py --varlen [--shapes ...]   # packed calls against dense ones
    python benchmarks/fp8_speed.py --host                    # host cost per call

``--host``: the host cost of a call (wall time per call of a loop of small calls, the GPU never
the limit), dense and packed FP8 beside the 16-bit call on the same shape.

``--varlen``: the same tokens as packed sequences of equal length through
``flash_attention_varlen`` (descales per sequence) beside the dense FP8 call on the same data:
TFLOP/s of both whole calls, their V preps' times and the ratio packed / dense.
"""

from __future__ import annotations

import argparse
import functools

import torch

import numbaflash as nf
from numbaflash import fp8
from numbaflash.kernels.fp8_layout import packed_vt_keys, padded_keys
from numbaflash.operations.fp8_forward import transpose_v, transpose_v_varlen


def median_seconds(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2] * 1e-3


def shape_rows(d: int, s: int) -> None:
    """Print the rows of head dim ``d`` at ``s`` tokens a sequence (full and causal)."""
    heads, batch = 2048 // d, 65536 // s
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    x = fp8.quantize(q, k, v)
    vt = torch.empty((batch, heads, d, padded_keys(s)), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    prep = median_seconds(lambda: transpose_v(x.v, vt, torch.cuda.current_device(), stream))
    for causal in (False, True):
        flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
        t16 = median_seconds(functools.partial(nf.flash_attention, q, k, v, causal=causal))
        t8 = median_seconds(functools.partial(nf.flash_attention, x.q, x.k, x.v, q_descale=x.q_descale,
                                              k_descale=x.k_descale, v_descale=x.v_descale, causal=causal))
        tf16, tf8, tfk = flops / t16 / 1e12, flops / t8 / 1e12, flops / (t8 - prep) / 1e12
        print(f"| {d} | {s} | {causal} | {tf16:.0f} | {tf8:.0f} | {tfk:.0f} | {prep * 1e6:.0f} | "
              f"{tf8 / tf16:.2f} | {tfk / tf16:.2f} |", flush=True)


def varlen_rows(d: int, s: int) -> None:
    """Packed against dense rows of head dim ``d``, ``s`` tokens a sequence (full and causal)."""
    heads, batch = 2048 // d, 65536 // s
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    x = fp8.quantize(q, k, v)
    packed = [t.reshape(batch * s, heads, d) for t in (x.q, x.k, x.v)]
    cu = torch.arange(0, batch * s + 1, s, dtype=torch.int32, device="cuda")
    descales = dict(q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)
    stream, device = torch.cuda.current_stream().cuda_stream, torch.cuda.current_device()
    vt = torch.empty((batch, heads, d, padded_keys(s)), dtype=torch.uint8, device="cuda")
    vt_packed = torch.empty((1, heads, d, packed_vt_keys(batch * s, batch)), dtype=torch.uint8, device="cuda")
    prep = median_seconds(lambda: transpose_v(x.v, vt, device, stream))
    prep_packed = median_seconds(lambda: transpose_v_varlen(packed[2], cu, vt_packed, s, device, stream))
    for causal in (False, True):
        flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
        dense = median_seconds(functools.partial(nf.flash_attention, x.q, x.k, x.v, causal=causal,
                                                 **descales))
        varlen = median_seconds(functools.partial(nf.flash_attention_varlen, *packed, cu, cu, s, s,
                                                  causal=causal, **descales))
        print(f"| {d} | {s} | {causal} | {flops / dense / 1e12:.0f} | {flops / varlen / 1e12:.0f} | "
              f"{prep * 1e6:.0f} | {prep_packed * 1e6:.0f} | {dense / varlen:.3f} |", flush=True)


def host_rows() -> None:
    """Microseconds of host time a call (median of 5 rounds of 200 calls; batch 2, 128 tokens, 8
    heads, d128: each kernel a few microseconds, queued far ahead of the GPU)."""
    import time

    b, s, h, d = 2, 128, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    x = fp8.quantize(q, k, v)
    packed = [t.reshape(b * s, h, d) for t in (x.q, x.k, x.v)]
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    descales = dict(q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)
    calls = {
        "bf16 dense": lambda: nf.flash_attention(q, k, v, causal=True),
        "FP8 dense": lambda: nf.flash_attention(x.q, x.k, x.v, causal=True, **descales),
        "FP8 dense, no descales": lambda: nf.flash_attention(x.q, x.k, x.v, causal=True),
        "FP8 packed": lambda: nf.flash_attention_varlen(*packed, cu, cu, s, s, causal=True, **descales),
    }
    for name, call in calls.items():
        rounds = []
        for _ in range(5):
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                call()
            rounds.append((time.perf_counter() - start) / 200)
            torch.cuda.synchronize()
        print(f"| {name} | {sorted(rounds)[2] * 1e6:.1f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="128:4096,128:16384,64:16384,256:16384,128:1024",
                   help="head_dim:seqlen pairs")
    p.add_argument("--varlen", action="store_true", help="packed calls against dense ones")
    p.add_argument("--host", action="store_true", help="host cost per call")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.host:
        print("| call | host µs a call |\n|:--|--:|")
        host_rows()
        return
    if args.varlen:
        print("| head dim | seqlen | causal | dense FP8 call | packed FP8 call | dense V prep (us) | "
              "packed V prep (us) | packed / dense |\n|--:|--:|:--|--:|--:|--:|--:|--:|")
        for pair in args.shapes.split(","):
            varlen_rows(*(int(x) for x in pair.split(":")))
        return
    print("| head dim | seqlen | causal | bf16 TFLOP/s | FP8 call | FP8 kernel | V prep (us) | call / bf16 | "
          "kernel / bf16 |\n|--:|--:|:--|--:|--:|--:|--:|--:|--:|")
    for pair in args.shapes.split(","):
        d, s = (int(x) for x in pair.split(":"))
        shape_rows(d, s)

if __name__ == "__main__":
    main()
