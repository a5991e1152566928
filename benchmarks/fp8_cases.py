"""Small ragged and fully masked e4m3 cases for compute-sanitizer (issue 60): every shipped FP8 config
(``configs.FP8_DEFAULTS``), full and causal, on rows that see no key (seqlen_q > seqlen_k, causal),
seqlen_q far below seqlen_k, one query row and a square tile edge; window, softcap and a learnable
sink at d64 and d128; the V prep kernel on each; packed (varlen) calls with empty sequences, rows that see
no key and a sequence longer than the prep's grid, every config, full and causal; window, softcap, sink
and fp16 output packed at d128. Every output finite.

    compute-sanitizer --tool {memcheck,racecheck,synccheck} --report-api-errors no \
        --error-exitcode 9 python benchmarks/fp8_cases.py [--mma]

``--head-dims 64,128``: only those head dims' cases (default: every one).
``--mma``: the dense cases on the mma.sync e4m3 kernel (``configs.FP8_MMA_DEFAULTS``, forced on Hopper;
the kernel of every other FP8 GPU), every head dim with the window, softcap and sink; no packed cases
(that kernel has none).
"""

import sys

import torch

import numbaflash as nf
from numbaflash import fp8
from numbaflash.operations.fp8_forward import mma_kernel_forced

MMA = "--mma" in sys.argv[1:]
DIMS = {64, 128, 256}
if "--head-dims" in sys.argv[1:]:
    DIMS = {int(x) for x in sys.argv[sys.argv.index("--head-dims") + 1].split(",")}
if MMA:
    mma_kernel_forced().__enter__()  # for the whole run

torch.manual_seed(0)
cases = []
for d in sorted(DIMS):
    for b, sq, sk, hq, hk in ((1, 300, 77, 2, 1), (2, 77, 300, 2, 2), (1, 1, 33, 4, 2), (1, 200, 200, 2, 1)):
        for causal in (False, True):
            cases.append((d, b, sq, sk, hq, hk, dict(causal=causal)))
for d in sorted(DIMS) if MMA else sorted(DIMS & {64, 128}):
    sink = torch.randn(2, device="cuda")
    for kw in (dict(window_size=(20, 3)), dict(softcap=3.0), dict(learnable_sink=sink)):
        cases.append((d, 1, 150, 260, 2, 1, kw))
for d, b, sq, sk, hq, hk, kw in cases:
    q = torch.randn(b, sq, hq, d, device="cuda")
    k = torch.randn(b, sk, hk, d, device="cuda")
    v = torch.randn(b, sk, hk, d, device="cuda")
    x = fp8.quantize(q, k, v)
    o = nf.flash_attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale,
                           **kw)
    assert torch.isfinite(o).all()
packed = 0
for d in () if MMA else sorted(DIMS):
    for causal in (False, True):
        lengths_q, lengths_k = [300, 0, 1, 77, 5], [77, 9, 0, 300, 200]
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                      for n in (lengths_q, lengths_k))
        q = torch.randn(int(cu_q[-1]), 4, d, device="cuda").to(torch.float8_e4m3fn)
        k = torch.randn(int(cu_k[-1]), 2, d, device="cuda").to(torch.float8_e4m3fn)
        v = torch.randn(int(cu_k[-1]), 2, d, device="cuda").to(torch.float8_e4m3fn)
        ones = torch.ones(len(lengths_q), 2, device="cuda")
        o = nf.flash_attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=causal, q_descale=ones)
        assert torch.isfinite(o).all()
        packed += 1
for kw in () if MMA or 128 not in DIMS else (dict(window_size=(20, 3)), dict(softcap=3.0),
                           dict(learnable_sink=torch.randn(4, device="cuda")),
                           dict(out_dtype=torch.float16, causal=True)):  # the packed variants at d128
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in ([150, 0, 33], [260, 7, 0]))
    q = torch.randn(int(cu_q[-1]), 4, 128, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(int(cu_k[-1]), 2, 128, device="cuda").to(torch.float8_e4m3fn)
    o = nf.flash_attention_varlen(q, k, k, cu_q, cu_k, 150, 260, q_descale=torch.ones(3, 2, device="cuda"),
                                  **kw)
    assert torch.isfinite(o).all()
    packed += 1
torch.cuda.synchronize()
print("cases", len(cases) + packed, "ok")
