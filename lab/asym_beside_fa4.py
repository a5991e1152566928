"""(192, 128) and d128 beside FlashAttention-4, forward and backward, in one process (needs a GPU,
torch and FA4 as ``../shared/device/prepare-fa4.sh`` brings it; issue 56, section PVA).

    python lab/asym_beside_fa4.py

bf16, 64k tokens, 16 heads, 4k and 16k, causal and not. TFLOP/s count 2 * B * H * S^2 * (d_qk +
d_v) (halved causal), the backward 2.5x that (``benchmarks/asym_speed.py``'s count); interleaved
medians (``backward_speed.interleaved_medians``). Ours: ``flash_attention`` and
``flash_attention_backward``; FA4: ``flash_attn_func`` and its autograd backward. The last lines
give each implementation's (192, 128) TF/s over its own d128's."""
import sys

sys.path.insert(0, "benchmarks")  # backward_speed (run from the repository root)
import torch
from backward_speed import interleaved_medians
from flash_attn.cute import flash_attn_func

import numbaflash

TOKENS, HEADS = 65536, 16
PAIRS = ("192/128", "128/128")


def calls_for(d: int, dv: int, s: int, causal: bool) -> tuple[dict, float]:
    """"<impl> fwd|bwd d/dv": callable, ours and FA4's on the same tensors; and the forward's FLOPs."""
    b = TOKENS // s
    q, k = (torch.randn(b, s, HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(b, s, HEADS, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    fa4_out = flash_attn_func(qg, kg, vg, causal=causal)[0]
    diff = (out.float() - flash_attn_func(q, k, v, causal=causal)[0].float()).abs().max().item()
    t = f"{d}/{dv}"
    print(f"s{s} causal={causal} {t}: max|ours - FA4| forward {diff:.2e}", flush=True)
    calls = {
        f"ours fwd {t}": lambda: numbaflash.flash_attention(q, k, v, causal=causal),
        f"ours bwd {t}": lambda: numbaflash.flash_attention_backward(do, q, k, v, out, lse, causal=causal),
        f"fa4 fwd {t}": lambda: flash_attn_func(q, k, v, causal=causal),
        f"fa4 bwd {t}": lambda: torch.autograd.grad(fa4_out, (qg, kg, vg), do, retain_graph=True),
    }
    return calls, 2 * b * HEADS * s * s * (d + dv) / (2 if causal else 1)


def main() -> None:
    rows = {}  # (s, causal, pair): (fwd ours, fwd FA4, bwd ours, bwd FA4) TF/s
    for s in (4096, 16384):
        for causal in (False, True):
            calls, flops = {}, {}
            for t in PAIRS:
                d, dv = (int(x) for x in t.split("/"))
                more, flops[t] = calls_for(d, dv, s, causal)
                calls.update(more)
            ms = interleaved_medians(calls, 5, 21, 3, 250.0)
            for t in PAIRS:
                rows[s, causal, t] = tuple(scale * flops[t] / 1e9 / ms[f"{impl} {way} {t}"]
                                           for way, scale in (("fwd", 1.0), ("bwd", 2.5))
                                           for impl in ("ours", "fa4"))
    print(torch.cuda.get_device_name())
    print("| s | causal | dims | fwd ours | fwd FA4 | ours/FA4 | bwd ours | bwd FA4 | ours/FA4 |")
    for (s, c, t), (fo, ff, bo, bf) in rows.items():
        print(f"| {s} | {c} | {t} | {fo:.0f} | {ff:.0f} | {fo / ff:.3f} "
              f"| {bo:.0f} | {bf:.0f} | {bo / bf:.3f} |")
    for s in (4096, 16384):
        for c in (False, True):
            a, b = rows[s, c, PAIRS[0]], rows[s, c, PAIRS[1]]
            print(f"s{s} causal={c}: (192,128)/d128 bwd ours {a[2] / b[2]:.3f} FA4 {a[3] / b[3]:.3f}; "
                  f"fwd ours {a[0] / b[0]:.3f} FA4 {a[1] / b[1]:.3f}")


if __name__ == "__main__":
    main()
