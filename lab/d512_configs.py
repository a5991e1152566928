"""Head dim 512's forward candidates (the pair (512, 256)'s mma.sync configs, each forced) timed
against each other and against SDPA's backends, in one process (issue 56 item 3; needs a GPU).

    PYTHONPATH=benchmarks python lab/d512_configs.py [--seqlen 4k] [--causal both]

(batch, seqlen, 16 heads, 512), 65536 tokens, bf16; times are ``backward_speed.interleaved_medians``
(CUDA events, rounds interleaved); TFLOP/s count 4 * b * h * s^2 * 512 (halved when causal).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from backward_speed import interleaved_medians, seqlen
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash
from numbaflash import configs
from numbaflash.kernels.shapes import ForwardConfig

CANDIDATES = {
    "64x64": ForwardConfig(512, block_m=64, block_n=64, early_k=True, head_dim_v=256),
    "128x64": ForwardConfig(512, block_m=128, block_n=64, early_k=True, head_dim_v=256),
    "128x32": ForwardConfig(512, block_m=128, block_n=32, early_k=True, head_dim_v=256),
    "64x16": ForwardConfig(512, block_m=64, block_n=16, early_k=True, head_dim_v=256),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlen", default="4k")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    args = p.parse_args()
    s = seqlen(args.seqlen)
    b, h = max(1, 65536 // s), 16
    capability = torch.cuda.get_device_capability()
    print(f"GPU: {torch.cuda.get_device_name()}; b{b} s{s} h{h} d512 bf16")
    q, k, v = (torch.randn(b, s, h, 512, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]:
        calls = {}
        for name, config in CANDIDATES.items():
            def call(config=config, causal=causal):
                with contextlib.ExitStack() as stack:
                    for flag in (False, True):
                        stack.enter_context(configs.force_config(capability, flag, config))
                    numbaflash.flash_attention(q, k, v, causal=causal)
            call()
            calls[name] = call
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        backends = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("flash", SDPBackend.FLASH_ATTENTION))
        for name, backend in backends:
            def ref(backend=backend, causal=causal, qt=qt, kt=kt, vt=vt):
                with sdpa_kernel(backend):
                    sdpa(qt, kt, vt, is_causal=causal)
            try:
                ref()
                calls[name] = ref
            except RuntimeError as error:
                print(f"{name}: refuses ({str(error).splitlines()[0][:80]})")
        ms = interleaved_medians(calls, 3, 15, 3, 250.0)
        flops = 4 * b * h * s * s * 512 / (2 if causal else 1)
        for name, t in ms.items():
            print(f"causal={causal} {name:>10}: {t:8.3f} ms  {flops / t / 1e9:6.0f} TF/s", flush=True)


if __name__ == "__main__":
    main()
