"""Where a warp-specialised kernel's warps spend their time, per SASS instruction (Nsight Compute
source counters), grouped by how often each instruction runs, or by opcode.

    ncu --profile-from-start off --section SourceCounters --section WarpStateStats -o REP \\
        python lab/ncu_source.py drive d128-ovl 4096 bf16 [causal]
    ncu -i REP.ncu-rep --page source --csv --print-source sass > SRC.csv
    python lab/ncu_source.py summary SRC.csv

    ncu --profile-from-start off -k regex:flash_backward_ws --section SourceCounters \\
        --section WarpStateStats -o REP python lab/ncu_source.py drive-backward 128 4096 full
    ncu -i REP.ncu-rep --page source --csv --print-source sass > SRC.csv
    python lab/ncu_source.py opcodes SRC.csv [TOP]

``drive-backward HEAD_DIM SEQLEN full|causal`` runs ``flash_attention_backward`` (bf16, the
benchmark workload) three times, then once in the profiler range (section BWL). ``opcodes``
sums the page by opcode (static lines, warp instructions executed, shares of the executed
instructions and of the stall samples), the stall reasons, and lists the hottest lines by stall
samples and by execution count.

``drive`` runs one ``lab/ws_check.py`` variant on the benchmark workload (64k tokens,
width 2048) three times, then once between cudaProfilerStart and Stop. ``summary`` prints the
share of warp-stall samples of each execution-count class (instructions run the same number of
times: the KV loop, once a tile, the producer, ...), then the hottest instructions. With
tiles of N KV tiles the loop's class runs N - 1 times as often as the once-a-tile class, so the
two shares tell how many KV-tile times a tile boundary costs.
"""

from __future__ import annotations

import collections
import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def drive(variant: str, seqlen: str, dtype: str, mask: str = "") -> None:
    import torch
    from ws_check import variants

    from numbaflash.tools.ws_launch import flash_attention_ws

    config = variants()[variant]
    if mask not in ("", "causal"):
        sys.exit(f"the fourth argument of drive must be 'causal' or absent, got {mask!r}")
    causal = mask == "causal"
    d, s = config.head_dim, int(seqlen)
    b, h = 65536 // s, 2048 // d
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
    out = torch.empty_like(q)
    for _ in range(3):
        flash_attention_ws(q, k, v, out=out, config=config, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    flash_attention_ws(q, k, v, out=out, config=config, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def drive_backward(head_dim: str, seqlen: str, mask: str) -> None:
    import torch

    import numbaflash

    if mask not in ("full", "causal"):
        sys.exit(f"the third argument of drive-backward must be 'full' or 'causal', got {mask!r}")
    d, s, causal = int(head_dim), int(seqlen), mask == "causal"
    b, h = 65536 // s, 2048 // d
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    for _ in range(3):
        numbaflash.flash_attention_backward(do, q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    numbaflash.flash_attention_backward(do, q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _source_page(path: str) -> tuple[dict, list]:
    rows = list(csv.reader(open(path)))
    at = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    header = rows[at]
    return {name: i for i, name in enumerate(header)}, [r for r in rows[at + 1:] if len(r) == len(header)]


def opcodes(path: str, top: int = 30) -> None:
    col, body = _source_page(path)
    samples, runs = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    stalls = [name for name in col if name.startswith("stall_") and "Not Issued" not in name]
    total_s = sum(_number(r[samples]) for r in body) or 1.0
    total_e = sum(_number(r[runs]) for r in body) or 1.0
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in body:
        op = re.sub(r"^@!?U?P[T0-9]+\s+", "", r[col["Source"]].strip()).split(" ")[0].rstrip(";")
        by[op][0] += 1
        by[op][1] += _number(r[runs])
        by[op][2] += _number(r[samples])
    print(f"{len(body)} SASS lines, {total_e / 1e6:.1f} M warp instructions, {total_s:.0f} stall samples")
    print("| opcode | static | executed (M) | of executed | of samples |\n|:--|--:|--:|--:|--:|")
    for op, (n, e, s_) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"| {op} | {n} | {e / 1e6:.2f} | {100 * e / total_e:.1f}% | {100 * s_ / total_s:.1f}% |")
    reasons = collections.Counter()
    for r in body:
        for name in stalls:
            reasons[name[6:]] += _number(r[col[name]])
    print("stall reasons:", ", ".join(f"{k} {100 * v / total_s:.1f}%" for k, v in reasons.most_common(10)))
    for title, key in (("stall samples", samples), ("execution count", runs)):
        print(f"\nhottest {top} lines by {title} (index, share of samples, executed, main stall, SASS):")
        for i in sorted(sorted(range(len(body)), key=lambda i: -_number(body[i][key]))[:top]):
            r = body[i]
            why = max(((_number(r[col[name]]), name[6:]) for name in stalls), default=(0, ""))
            print(f"{i:5d} {100 * _number(r[samples]) / total_s:5.2f}% {int(_number(r[runs])):>10}  "
                  f"{why[1] if why[0] else '':<16} {r[col['Source']].strip()[:80]}")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", "") or 0)
    except ValueError:
        return 0.0


def summary(path: str, top: int = 30) -> None:
    col, body = _source_page(path)
    samples, runs = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    total = sum(_number(r[samples]) for r in body) or 1.0
    classes: collections.Counter = collections.Counter()
    first: dict[int, int] = {}
    for i, r in enumerate(body):
        n = int(_number(r[runs]))
        classes[n] += _number(r[samples])
        first.setdefault(n, i)
    print(f"{len(body)} instructions, {total:.0f} warp-stall samples")
    print("| times run | share of samples | first instruction |")
    print("|--:|--:|--:|")
    for n, share in classes.most_common(12):
        print(f"| {n} | {100 * share / total:.2f}% | {first[n]} |")
    stalls = [name for name in col if name.startswith("stall_") and "Not Issued" not in name]
    print(f"\nhottest {top} instructions (index, share, times run, main stall reasons, SASS):")
    for i in sorted(sorted(range(len(body)), key=lambda i: -_number(body[i][samples]))[:top]):
        r = body[i]
        reasons = sorted(((_number(r[col[s]]), s[6:]) for s in stalls), reverse=True)[:2]
        why = ", ".join(f"{name} {100 * v / total:.2f}%" for v, name in reasons if v)
        print(f"{i:5d} {100 * _number(r[samples]) / total:5.2f}% {int(_number(r[runs])):>9}  {why:<32} "
              f"{r[col['Source']].strip()[:70]}")


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "drive":
        drive(*sys.argv[2:])
    elif len(sys.argv) == 5 and sys.argv[1] == "drive-backward":
        drive_backward(*sys.argv[2:])
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "opcodes":
        opcodes(sys.argv[2], *(int(x) for x in sys.argv[3:]))
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
    else:
        sys.exit(__doc__)
