"""Error of each numbaflash kernel configuration and of the SDPA backends against a float64
reference, on the same random inputs: which implementation is more accurate, and by how much.

    python benchmarks/accuracy_compare.py [--seqlen 1024] [--head-dim 64] [--causal]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from numbaflash import configs, flash_attention
from numbaflash.kernels import common, forward_mma, forward_ws
from numbaflash.runtime.device import GPU
from numbaflash.tools.reference import attention_reference


def errors(out, ref):
    d = np.abs(np.asarray(out, np.float64) - ref)
    return d.max(), d.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    s, d, h = args.seqlen, args.head_dim, args.heads
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s, h, d)).astype(np.float16) for _ in range(3))
    ref, _ = attention_reference(q, k, v, causal=args.causal)
    low, _ = attention_reference(q, k, v, causal=args.causal, rounding_dtype=np.float16)
    print(f"GPU {torch.cuda.get_device_name()}  seqlen {s} head_dim {d} heads {h} causal {args.causal}")
    print(f"{'implementation':<64} {'max err':>9} {'mean err':>9}")
    e = errors(low, ref)
    print(f"{'numpy, rounded to fp16 at each step':<64} {e[0]:9.2e} {e[1]:9.2e}")
    tq, tk, tv = (torch.from_numpy(x).cuda().transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
        e = errors(out.transpose(1, 2).cpu().numpy(), ref)
        print(f"{'sdpa-' + name:<64} {e[0]:9.2e} {e[1]:9.2e}")
    family = configs.arch_family(torch.cuda.get_device_capability())
    key = configs.table_key(family, d, args.causal)
    for threshold in (common.RESCALE_THRESHOLD, 0.0):
        forward_mma.THRESHOLD = forward_ws.THRESHOLD = np.float32(threshold)
        # Rebuild the kernels with this threshold: the patched module attribute is not in the
        # kernel cache's key (file contents are), so the cache is off for this script.
        GPU.launchers.clear()
        GPU.modules.clear()
        GPU.ready.clear()
        for cfg in configs.CANDIDATES[(family, d)][:2] + configs.CANDIDATES[(family, d)][-2:]:
            configs.OVERRIDES[key] = cfg
            e = errors(flash_attention(q, k, v, causal=args.causal), ref)
            print(f"{str(cfg)[:52] + f' thr={threshold:g}':<64} {e[0]:9.2e} {e[1]:9.2e}")
    configs.OVERRIDES.pop(key)


if __name__ == "__main__":
    os.environ["NUMBAFLASH_CACHE"] = "0"  # patched kernels must be compiled, not loaded
    main()
