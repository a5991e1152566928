"""The shapes of the 34e1ab6 race report, on torch tensors, for each kernel family.

``flash_attention(q, k, v, causal=True)`` with batch 2, 6 heads, head_dim 64 and seqlen_q =
2 seqlen_k: rows below seqlen_q - seqlen_k see no key and must be exactly 0 (LSE -inf). Each
shape runs ``--repeats`` times (a race need not show every time); the table gives the largest
|out| on those rows over all repeats, and the error ratio of the rest against float64
(FlashAttention's criterion, <= 1 passes).

    python benchmarks/no_key_rows.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main() -> int:
    import ml_dtypes
    import torch
    from numba import cuda

    import numbaflash
    from numbaflash import configs
    from numbaflash.tools.reference import compare_with_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cap = tuple(cuda.get_current_device().compute_capability)
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    print("| family | dtype | seqlen_q | seqlen_k | max abs on no-key rows | LSE -inf there | error ratio |")
    print("|---|---|---:|---:|---:|---|---:|")
    failed = False
    torch.manual_seed(0)
    for family in configs.runnable_families(cap):
        for dtype in (torch.float16, torch.bfloat16):
            for sq, sk in ((3000, 1500), (2000, 1000)):
                q = torch.randn(2, sq, 6, 64, device="cuda", dtype=dtype)
                k, v = (torch.randn(2, sk, 6, 64, device="cuda", dtype=dtype) for _ in range(2))
                config = configs.forward_config(configs.FAMILY_CAPABILITY[family], 64, True)
                worst, lse_ok = 0.0, True
                with configs.force_config(cap, True, config):
                    for _ in range(args.repeats):
                        out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
                        worst = max(worst, out[:, : sq - sk].float().abs().max().item())
                        lse_ok &= bool(torch.isneginf(lse[:, :, : sq - sk]).all().item())
                host = [x.float().cpu().numpy() for x in (q, k, v)]
                np_dtype = np.float16 if dtype == torch.float16 else ml_dtypes.bfloat16
                ratio, problems = compare_with_reference(*(x.astype(np_dtype) for x in host),
                                                         out.float().cpu().numpy(), lse.cpu().numpy(),
                                                         causal=True)
                failed |= bool(problems) or worst != 0 or not lse_ok
                print(f"| {family} | {str(dtype).split('.')[1]} | {sq} | {sk} | {worst:g} | "
                      f"{'yes' if lse_ok else 'NO'} | {ratio:.3f} |")
    print("no-key rows: " + ("FAILED" if failed else "all exactly 0"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
